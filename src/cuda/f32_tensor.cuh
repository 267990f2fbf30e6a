// f32 products y [rows x n] = x [rows x k] . w [n x k]^T on the tensor cores, f32 in and out: DeepSeek-V4's
// hyper-connection mixes (k = 4E = 16,384 inputs, 48 or 24 outputs) and its router (E inputs, 256 outputs). They stay
// f32-accurate (the mixes decide the residual streams and, through the FFN's, the experts: the decoder's choices), but
// the f32 units bound them: the narrow kernel ran the sections' mixes at 31 TFLOP/s and cuBLAS the router at ~50
// (docs/RESULTS.md, sessions 35-36). Here each operand is split into TF32 parts, v = hi + lo (hi: v rounded to TF32,
// lo: the rest rounded to TF32), and each product is summed as lo.hi + hi.lo + hi.hi by TF32 tensor-core products
// into f32 accumulators ("3xTF32"): the dropped lo.lo and the roundings are ~2^-22 of a term, below the f32 sum's
// own rounding over k terms. CPU twin: the f64 product (dsv4_kernels_test.cpp), with the f32 sum's bound.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

// n 24, 48 or a multiple of 8; k a multiple of 32; x, w and y 16-byte aligned; an sm_80+ GPU: otherwise false (the
// caller's f32 path).
bool f32_tensor_supported(const float* x, const float* w, const float* y, int64_t k, int64_t n);
// The k-splits that give a product of `rows` rows a tile per SM (1 where the rows alone do; at most 8, each of at
// least 8 steps of 32): the prefill server's 4,096-row chunks.
int f32_tensor_splits(int64_t rows, int64_t n, int64_t k);
// y = x . w^T where f32_tensor_supported; throws otherwise. With splits > 1 (dividing k / 32), each split sums its
// share of k into partials [splits x rows x n], then each output is their sum in split order (f32_add_splits).
// Widths other than 24 and 48 take 128 x 128 tiles (a warp: 32 rows x 64 outputs). variant 2 (the twin test's
// measure of what the per-stage sums buy; 0 the default): the tensor cores' accumulation alone.
void f32_tensor_xwt(const float* x, const float* w, float* y, int64_t rows, int64_t k, int64_t n, cudaStream_t s, float* partials = nullptr,
                    int splits = 1, int variant = 0);

}  // namespace pdb::cuda
