// GEMM whose every output is summed in one fixed order — `kn` FMA lane accumulators over k, then
// folded in halves — the order of llama.cpp's CPU matmul (llamafile tinyBLAS). Two properties
// follow: results are bit-identical whatever the batch (so chunked prefill == one-shot prefill),
// and identical to the decoder's own products on the same inputs.
#pragma once
#include <cstdint>

namespace pdb {

// tinyBLAS's horizontal sum of one accumulator vector of `kn` lanes: x86 folds in halves
// (_mm512_reduce_add_ps; extract-add, movehl, movehdup), NEON's vaddvq_f32 adds neighbours.
inline float fold_lanes(float* acc, int kn) {
  if (kn == 4) return (acc[0] + acc[1]) + (acc[2] + acc[3]);
  for (int w = kn / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) acc[i] = acc[i + w] + acc[i];
  return acc[0];
}

// y[rows x out] = x[rows x k] * w[out x k]^T; kn in {4 (NEON), 8 (AVX2), 16 (AVX-512)}, k % kn == 0.
void gemm_lanes(const float* x, const float* w, float* y, int64_t rows, int64_t out, int64_t k, int kn, int threads);

}  // namespace pdb
