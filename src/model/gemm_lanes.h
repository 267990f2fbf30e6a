// GEMM whose every output is summed in one fixed order — `kn` FMA lane accumulators over k, then
// folded in halves — the order of llama.cpp's CPU matmul (llamafile tinyBLAS). Two properties
// follow: results are bit-identical whatever the batch (so chunked prefill == one-shot prefill),
// and identical to the decoder's own products on the same inputs.
#pragma once
#include <cstdint>

namespace pdb {

// y[rows x out] = x[rows x k] * w[out x k]^T; kn in {4, 8, 16}, k % kn == 0.
void gemm_lanes(const float* x, const float* w, float* y, int64_t rows, int64_t out, int64_t k, int kn, int threads);

}  // namespace pdb
