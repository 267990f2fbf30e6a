// The experts' rows padded into equal chunks so that one batched product covers every expert at the dense
// products' rate (cuBLAS's batched GEMM ran 541-607 TFLOP/s of routed rows where its grouped call ran 264-293 and
// one product per expert 102-332, docs/RESULTS.md): expert e's rows fill ceil(n_e / cap) chunks of cap rows, chunk
// after chunk, and the padding rows are computed and never read. Host-side arithmetic on the downloaded counts;
// the engine's MoE block (cuda_moe_ffn.cpp) places the rows at these offsets.
#pragma once
#include <cstdint>
#include <vector>

namespace pdb {

struct PaddedExperts {
  int64_t cap = 0;                    // rows per chunk; 0: not worth padding (the grouped products run)
  int64_t rows = 0;                   // padded rows in all
  std::vector<int32_t> offsets;       // [experts]: the first padded row of each expert (a multiple of cap)
  std::vector<int32_t> chunk_expert;  // [rows / cap]: the expert whose weights each chunk multiplies
};

// The chunk size (a multiple of 64 from 128 to the largest expert's rows, rounded up) whose products cost least:
// rows x (cap + 16) / cap, the padded rows with smaller products' lower rate (fitted to the H200: chunks of 128 rows
// ran 7.6% slower than chunks of 320 at 1% fewer rows); not worth it (cap 0) where the padding would multiply the
// routed rows by more than max_ratio_num / max_ratio_den.
inline int64_t padded_cost(int64_t rows, int64_t cap) { return rows * (cap + 16) / cap; }

inline PaddedExperts pad_experts(const int32_t* counts, int64_t experts, int64_t max_ratio_num = 2, int64_t max_ratio_den = 1) {
  PaddedExperts p;
  int64_t routed = 0, largest = 0;
  for (int64_t e = 0; e < experts; ++e) {
    routed += counts[e];
    largest = counts[e] > largest ? counts[e] : largest;
  }
  if (routed == 0) return p;
  const int64_t top = (largest + 63) / 64 * 64;
  int64_t best_cap = 0, best_rows = 0;
  for (int64_t cap = 128; cap <= (top > 128 ? top : 128); cap += 64) {
    int64_t rows = 0;
    for (int64_t e = 0; e < experts; ++e) rows += (counts[e] + cap - 1) / cap * cap;
    if (best_cap == 0 || padded_cost(rows, cap) <= padded_cost(best_rows, best_cap)) {
      best_cap = cap;
      best_rows = rows;
    }
  }
  if (best_rows * max_ratio_den > routed * max_ratio_num) return p;
  p.cap = best_cap;
  p.rows = best_rows;
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e) {
    p.offsets.push_back(int32_t(row));
    for (int64_t c = 0; c < (counts[e] + best_cap - 1) / best_cap; ++c) p.chunk_expert.push_back(int32_t(e));
    row += (counts[e] + best_cap - 1) / best_cap * best_cap;
  }
  return p;
}

}  // namespace pdb
