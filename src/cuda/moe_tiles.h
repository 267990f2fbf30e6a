// The FP4 expert products' unit of work (cuda/moe_fp4_gemm.cuh), host side only: plain C++, tested on any machine.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdb::cuda {

// The products' unit of work: up to fp4_tile_rows(shape) consecutive rows of x (and y), all routed to one expert. An
// expert's rows go in full tiles and a last one of what remains (the kernel multiplies a tile of at most half the
// rows as half: fewer than half a full tile's rows of padding per expert either way).
struct Fp4Tile {
  int32_t row0 = 0, rows = 0, expert = 0, unused = 0;
};
// A CTA's work in the products (cuda/moe_fp4_gemm.cu): 128 outputs x up to 256 rows (PDBRIDGE_DSV4_FP4_TILE=rows256,
// session 36's), or 256 outputs x up to 128 rows (each token row read by half as many CTAs: a third less of L2's
// traffic per product at V4-Flash's shapes, the codes read twice as often).
enum class Fp4Shape { kRows256, kOutputs256 };
constexpr int fp4_tile_rows(Fp4Shape s) { return s == Fp4Shape::kRows256 ? 256 : 128; }
constexpr int fp4_tile_outputs(Fp4Shape s) { return s == Fp4Shape::kRows256 ? 128 : 256; }
// The tiles of rows grouped by expert in expert order (counts[e] rows each, from row 0), for the products of `shape`.
inline std::vector<Fp4Tile> fp4_tiles(const int32_t* counts, int64_t experts, Fp4Shape shape) {
  const int32_t most = fp4_tile_rows(shape);
  std::vector<Fp4Tile> t;
  int32_t at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    for (int32_t r = 0; r < counts[e]; r += most) t.push_back({at + r, std::min(most, counts[e] - r), int32_t(e), 0});
    at += counts[e];
  }
  return t;
}

}  // namespace pdb::cuda
