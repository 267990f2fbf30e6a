#include "numerics/gemm_lanes.h"

#include <cmath>
#include <stdexcept>

#include "common/parallel.h"

namespace pdb {
namespace {

// A 4 x 4 tile of outputs; each accumulator sees exactly the sequence dot_lanes would.
template <int KN>
void tile(const float* x, const float* w, float* y, int64_t rr, int64_t oo, int64_t nr, int64_t no, int64_t k, int64_t ldy) {
  float acc[4][4][KN] = {};
  for (int64_t l = 0; l < k; l += KN)
    for (int64_t r = 0; r < nr; ++r) {
      const float* xr = x + (rr + r) * k + l;
      for (int64_t o = 0; o < no; ++o) {
        const float* wo = w + (oo + o) * k + l;
        float* a = acc[r][o];
        for (int i = 0; i < KN; ++i) a[i] = std::fma(wo[i], xr[i], a[i]);
      }
    }
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t o = 0; o < no; ++o) y[(rr + r) * ldy + oo + o] = fold_lanes(acc[r][o], KN);
}

template <int KN>
void run(const float* x, const float* w, float* y, int64_t rows, int64_t out, int64_t k, int threads) {
  const int64_t row_tiles = (rows + 3) / 4;
  parallel_for(row_tiles, threads, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t rr = t * 4, nr = std::min<int64_t>(4, rows - rr);
      for (int64_t oo = 0; oo < out; oo += 4) tile<KN>(x, w, y, rr, oo, nr, std::min<int64_t>(4, out - oo), k, out);
    }
  });
}

}  // namespace

void gemm_lanes(const float* x, const float* w, float* y, int64_t rows, int64_t out, int64_t k, int kn, int threads) {
  if (k % kn) throw std::invalid_argument("gemm_lanes: k is not a multiple of the lane count");
  switch (kn) {
    case 4: return run<4>(x, w, y, rows, out, k, threads);
    case 8: return run<8>(x, w, y, rows, out, k, threads);
    case 16: return run<16>(x, w, y, rows, out, k, threads);
    default: throw std::invalid_argument("gemm_lanes: lanes must be 4, 8 or 16");
  }
}

}  // namespace pdb
