// DeepSeek-V4 state files (formats/state_file_dsv4): any bytes parse or throw a clear error, never crash;
// whatever parses re-writes to exactly the bytes it came from (the writer is the parser's inverse).
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#include "formats/state_file_dsv4.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<uint8_t> in(data, data + size);
  try {
    const pdb::Dsv4State s = pdb::parse_dsv4_state_bytes(in, "fuzz");
    if (pdb::serialize_dsv4_state(s) != in) {
      std::fprintf(stderr, "a parsed DSV4 state did not re-write to its own bytes\n");
      std::abort();
    }
  } catch (const std::runtime_error&) {
  }
  return 0;
}
