// The experts' rows padded into chunks so that batched products cover every expert at the dense products' rate
// (cuBLAS's batched GEMM ran 541-607 TFLOP/s of routed rows where its grouped call ran 264-293 and one product per
// expert 102-332, docs/RESULTS.md). Expert e's rows are contiguous from offsets[e]: first whole chunks of the large
// size, then its remainder in chunks of the small size (or one more large chunk, whichever costs less); the padding
// rows are computed and never read. One batched product per chunk size. Host-side arithmetic on the downloaded
// counts; the engine's MoE block (cuda_moe_ffn.cpp) places the rows at these offsets.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdb {

// Chunks of one size: chunk i is rows [first_row[i], first_row[i] + cap), multiplied by expert[i]'s weights.
struct ChunkClass {
  int64_t cap = 0;
  std::vector<int32_t> expert, first_row;
};

struct PaddedExperts {
  int64_t rows = 0;                 // padded rows in all
  std::vector<int32_t> offsets;     // [experts]: the first padded row of each expert
  std::vector<ChunkClass> classes;  // the large chunks, then the small ones if any; empty: not worth padding
  int64_t cap() const { return classes.empty() ? 0 : classes.front().cap; }
};

// The cost of rows multiplied in chunks of cap: the padded rows with smaller products' lower rate (fitted to the
// H200: chunks of 128 rows ran 7.6% slower than chunks of 320 at 1% fewer rows).
inline int64_t padded_cost(int64_t rows, int64_t cap) { return rows * (cap + 16) / cap; }

namespace moe_padding_detail {
// Expert n's rows as whole large chunks, then the rest as small chunks or one more large one (small == 0: none).
inline void split(int64_t n, int64_t large, int64_t small, int64_t& n_large, int64_t& n_small) {
  n_large = n / large, n_small = 0;
  const int64_t rest = n - n_large * large;
  if (rest == 0) return;
  const int64_t as_small = small > 0 ? (rest + small - 1) / small : 0;
  if (small > 0 && padded_cost(as_small * small, small) < padded_cost(large, large)) n_small = as_small;
  else ++n_large;
}
}  // namespace moe_padding_detail

// The chunk sizes whose products cost least: one size (a multiple of 64 from 128 to the largest expert's rows,
// rounded up, at most 1024: larger products run no faster), or a large size of 384-1024 rows with a small one of 128-256 for the experts' remainders where that
// saves more than a second product's launch (2% of the routed rows). Few candidates: the GPU waits while this runs.
// Not worth it (no classes) where the padding would multiply the routed rows by more than max_ratio_num /
// max_ratio_den. two_sizes false: one chunk size only.
inline PaddedExperts pad_experts(const int32_t* counts, int64_t experts, int64_t max_ratio_num = 2, int64_t max_ratio_den = 1,
                                 bool two_sizes = true) {
  using moe_padding_detail::split;
  PaddedExperts p;
  int64_t routed = 0, largest = 0;
  for (int64_t e = 0; e < experts; ++e) {
    routed += counts[e];
    largest = counts[e] > largest ? counts[e] : largest;
  }
  if (routed == 0) return p;
  const int64_t top = std::min<int64_t>(std::max<int64_t>((largest + 63) / 64 * 64, 128), 1024);
  int64_t best_large = 0, best_small = 0, best_rows = 0, best_cost = 0;
  auto consider = [&](int64_t large, int64_t small) {
    int64_t large_rows = 0, small_rows = 0;
    for (int64_t e = 0; e < experts; ++e) {
      int64_t nl = 0, ns = 0;
      split(counts[e], large, small, nl, ns);
      large_rows += nl * large;
      small_rows += ns * small;
    }
    if (small > 0 && small_rows == 0) return;
    const int64_t cost = padded_cost(large_rows, large) + (small_rows ? padded_cost(small_rows, small) + routed / 50 : 0);
    if (best_large == 0 || cost <= best_cost) best_large = large, best_small = small, best_rows = large_rows + small_rows, best_cost = cost;
  };
  for (int64_t large = 128; large <= top; large += 64) consider(large, 0);
  if (two_sizes)
    for (int64_t large : {384, 512, 768, 1024})
      for (int64_t small : {128, 192, 256})
        if (large <= top) consider(large, small);
  if (best_rows * max_ratio_den > routed * max_ratio_num) return p;
  p.rows = best_rows;
  p.classes.resize(best_small ? 2 : 1);
  p.classes[0].cap = best_large;
  if (best_small) p.classes[1].cap = best_small;
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e) {
    p.offsets.push_back(int32_t(row));
    int64_t nl = 0, ns = 0;
    split(counts[e], best_large, best_small, nl, ns);
    for (int64_t c = 0; c < nl; ++c, row += best_large) p.classes[0].expert.push_back(int32_t(e)), p.classes[0].first_row.push_back(int32_t(row));
    for (int64_t c = 0; c < ns; ++c, row += best_small) p.classes[1].expert.push_back(int32_t(e)), p.classes[1].first_row.push_back(int32_t(row));
  }
  return p;
}

}  // namespace pdb
