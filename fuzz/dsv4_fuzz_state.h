// The small DeepSeek-V4 state the DSV4 fuzzers start from, laid out as llama-server lays it out: 9 cells, a
// window of 8, layers with ratios [0, 4], 2 CSA and LID rows, no HCA layer, the three rings.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/state_file.h"
#include "formats/state_file_dsv4.h"

inline std::vector<uint8_t> dsv4_fuzz_state() {
  std::vector<uint8_t> b;
  auto put = [&](auto v) { const auto* p = reinterpret_cast<const uint8_t*>(&v); b.insert(b.end(), p, p + sizeof v); };
  auto zeros = [&](size_t n) { b.insert(b.end(), n, 0); };
  put(pdb::kStateMagic); put(pdb::kStateVersion); put(uint32_t(9));
  for (int32_t t = 0; t < 9; ++t) put(int32_t(100 + t));
  put(pdb::kDsv4Magic); put(uint32_t(1)); put(uint32_t(0));
  for (int part = 0; part < 2; ++part) {  // base (no layers), then the window
    const uint32_t cells = part ? 8 : 9;
    put(uint32_t(1)); put(cells);
    for (uint32_t c = 0; c < cells; ++c) { put(int32_t(9 - cells + c)); put(uint32_t(1)); put(int32_t(0)); }
    put(uint32_t(0)); put(uint32_t(part ? 2 : 0));
    for (int l = 0; l < (part ? 2 : 0); ++l) { put(int32_t(1)); put(uint64_t(32)); zeros(32 * cells); }
  }
  for (int pool = 0; pool < 3; ++pool) {  // CSA, HCA, LID
    const uint32_t rows = pool == 1 ? 0 : 2, layers = pool == 1 ? 0 : 1, ne0 = pool == 2 ? 64 : 16;
    put(uint32_t(2)); put(rows); put(uint32_t(1)); put(layers);
    for (uint32_t l = 0; l < layers; ++l) { put(uint32_t(1)); put(int32_t(1)); put(uint64_t(ne0)); put(uint64_t(rows)); put(uint64_t(2 * ne0)); zeros(2 * ne0 * rows); }
  }
  for (int ring = 0; ring < 3; ++ring) {
    const uint32_t ratio = ring == 1 ? 128 : 4, size = ring == 1 ? 128 : 8, embd = ring == 2 ? 128 : 32, layers = ring == 1 ? 0 : 1;
    put(uint32_t(1)); put(ratio); put(size); put(embd); put(uint32_t(1)); put(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      put(uint32_t(1));
      for (int t = 0; t < 2; ++t) { put(int32_t(0)); put(uint64_t(embd)); put(uint64_t(size)); put(uint64_t(4 * embd)); zeros(4 * embd * size); }
    }
  }
  return b;
}
