// libFuzzer: the wire frame parser and the capture assembler must reject any byte stream with an
// error, never crash, and never commit a state file from a stream that is not a complete capture.
// The first byte picks the decoder's layout (even: K and V sections; odd: K sections only, as MLA).
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cache/assembler.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("pdbridge-fuzz-frames-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  if (size == 0) return 0;
  const bool k_only = data[0] & 1;
  ++data;
  --size;
  pdb::StateLayout layout;
  for (int l = 0; l < 2; ++l) {
    pdb::StateLayerTypes t;
    t.n_embd_k = 64;
    t.k_row_bytes = 128;
    t.n_embd_v = k_only ? 0 : 64;
    t.v_row_bytes = k_only ? 0 : 128;
    layout.layers.push_back(t);
  }
  std::vector<int32_t> tokens(8, 1);
  try {
    pdb::CaptureAssembler a(dir + "/s.bin", layout, tokens, "fp");
    a.feed(data, size);
    a.finish();
    std::filesystem::remove(dir + "/s.bin");
  } catch (const std::exception&) {
  }
  // also raw parsing in odd slices
  try {
    pdb::wire::FrameParser p([](const pdb::wire::FrameHeader&, const uint8_t*) {}, 1 << 20);
    for (size_t off = 0; off < size; off += 7) p.feed(data + off, std::min<size_t>(7, size - off));
  } catch (const std::exception&) {
  }
  return 0;
}
