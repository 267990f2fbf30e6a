// libFuzzer: the GGUF reader must reject malformed files with an error, never crash or read out of bounds.
#include <cstdint>
#include <vector>

#include "formats/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto g = pdb::GgufFile::from_bytes(std::vector<uint8_t>(data, data + size), "fuzz");
    for (const auto& t : g->tensors())
      if (t.n_elements() <= 4096 && pdb::can_dequantize(t.type)) (void)g->to_f32(t);
  } catch (const std::exception&) {
  }
  return 0;
}
