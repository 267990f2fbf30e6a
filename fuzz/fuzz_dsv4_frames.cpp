// libFuzzer: the DeepSeek-V4 capture assembler (cache/assembler.h, Dsv4CaptureAssembler) must reject any byte
// stream with an error, never crash, and never commit a file that is not a DSV4 state of the capture's tokens
// (or, after a SEAL, of their prefix).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "dsv4_fuzz_state.h"
#include "cache/assembler.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("pdbridge-fuzz-dsv4-frames-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  static const pdb::Dsv4State like = pdb::parse_dsv4_state_bytes(dsv4_fuzz_state(), "fuzz layout");
  const std::vector<int32_t> tokens = {11, 12, 13, 14, 15, 16, 17, 18};
  const std::string path = dir + "/s.bin";
  int64_t mounted = -1;
  try {
    pdb::Dsv4CaptureAssembler a(path, like, tokens, 8, "fp");
    a.feed(data, size);
    mounted = a.commit();
  } catch (const std::exception&) {
  }
  if (mounted >= 0) {
    pdb::Dsv4State s;
    try {
      s = pdb::parse_dsv4_state_file(path);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "committed a file that does not parse: %s\n", e.what());
      std::abort();
    }
    if (s.cells() != uint32_t(mounted) || s.tokens != std::vector<int32_t>(tokens.begin(), tokens.begin() + mounted)) {
      std::fprintf(stderr, "committed a state of %u cells for %lld mounted tokens\n", s.cells(), (long long)mounted);
      std::abort();
    }
    std::filesystem::remove(path);
  }
  return 0;
}
