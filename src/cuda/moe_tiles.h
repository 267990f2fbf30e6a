// The FP4 expert products' unit of work (cuda/moe_fp4_gemm.cuh), host side only: plain C++, tested on any machine.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdb::cuda {

// The products' unit of work: up to kFp4TileRows consecutive rows of x (and y), all routed to one expert. An
// expert's rows go in tiles of 256 and a last one of what remains (the kernel multiplies tiles of up to 128 rows
// as 128: at most 127 padding rows per expert either way).
struct Fp4Tile {
  int32_t row0 = 0, rows = 0, expert = 0, unused = 0;
};
constexpr int kFp4TileRows = 256;
// The tiles of rows grouped by expert in expert order (counts[e] rows each, from row 0).
inline std::vector<Fp4Tile> fp4_tiles(const int32_t* counts, int64_t experts) {
  std::vector<Fp4Tile> t;
  int32_t at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    for (int32_t r = 0; r < counts[e]; r += kFp4TileRows) t.push_back({at + r, std::min(kFp4TileRows, counts[e] - r), int32_t(e), 0});
    at += counts[e];
  }
  return t;
}

}  // namespace pdb::cuda
