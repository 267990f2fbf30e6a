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
  // Chunk e is expert e's, every expert's: the chunks are a strided batch (rows e cap.., weights e out in..).
  bool one_chunk_per_expert(int64_t experts) const {
    if (classes.size() != 1 || int64_t(classes[0].expert.size()) != experts) return false;
    for (int64_t e = 0; e < experts; ++e)
      if (classes[0].expert[size_t(e)] != e) return false;
    return true;
  }
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

// The chunk sizes: one size whose products cost least (a multiple of 64 from 128 to the largest expert's rows,
// rounded up, at most 1024: larger products run no faster); or, where that pads at least 4% of the routed rows less,
// a large size of 384-1024 rows with the experts' remainders in a small one of 128-256, the pair of least cost. On the
// H200 the rate per padded row barely moved with the chunk size (128-832 rows: 560-690 TFLOP/s) while a second
// size's product ran 4-7% slower where it padded no less (docs/RESULTS.md): fewer padded rows is what pays. Few
// candidates: the GPU waits while this runs. Not worth it (no classes) where the padding would multiply the routed
// rows by more than max_ratio_num / max_ratio_den. two_sizes false: one chunk size only.
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
  struct Choice { int64_t large = 0, small = 0, rows = 0, cost = 0; };
  auto evaluate = [&](int64_t large, int64_t small) {
    Choice c{large, small, 0, 0};
    int64_t large_rows = 0, small_rows = 0;
    for (int64_t e = 0; e < experts; ++e) {
      int64_t nl = 0, ns = 0;
      split(counts[e], large, small, nl, ns);
      large_rows += nl * large;
      small_rows += ns * small;
    }
    if (small_rows == 0) c.small = 0;
    c.rows = large_rows + small_rows;
    c.cost = padded_cost(large_rows, large) + (small_rows ? padded_cost(small_rows, small) : 0);
    return c;
  };
  Choice one, two;
  for (int64_t large = 128; large <= top; large += 64)
    if (const Choice c = evaluate(large, 0); one.large == 0 || c.cost <= one.cost) one = c;
  if (two_sizes)
    for (int64_t large : {384, 512, 768, 1024})
      for (int64_t small : {128, 192, 256})
        if (large <= top)
          if (const Choice c = evaluate(large, small); c.small && (two.large == 0 || c.cost < two.cost)) two = c;
  const Choice& best = two.large && two.rows + routed / 25 <= one.rows ? two : one;
  const int64_t best_large = best.large, best_small = best.small, best_rows = best.rows;
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
