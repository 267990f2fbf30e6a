// f32 products with few outputs per row, y [rows x n] = x [rows x k] . w [n x k]^T: DeepSeek-V4's hyper-connection
// mixes (k = 4E = 16,384; n = 48 for the attention side's two, 24 for the FFN's). They stay f32 (the mixes decide
// the residual streams and, through the FFN's, the experts: the decoder's choices), and cuBLAS's f32 products ran them
// at 17 TFLOP/s (docs/RESULTS.md, session 35): a tile of 128 rows by all n outputs per CTA reads x once and keeps
// the f32 units busy (8 rows x n/12 outputs per thread, operands by 16-byte shared loads without bank conflicts).
// Each output is one f32 sum in k order with fused multiply-adds. CPU twin: the f64 product (f32_narrow_test.cpp).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

// n 24 or 48, k a multiple of 32, x and w 16-byte aligned: otherwise false (the caller's cuBLAS product).
bool f32_narrow_supported(const float* x, const float* w, int64_t k, int64_t n);
// Enough rows to give every SM a tile (128 rows each): below that cuBLAS's split products use the GPU better.
bool f32_narrow_fills_gpu(int64_t rows);
// The k-splits that give a product of `rows` rows a tile per SM (1 where the rows alone do; at most 8, each of at
// least 8 k-steps): PDBRIDGE_DSV4_MIX=split's products in the prefill server's 4,096-row chunks.
int f32_narrow_splits(int64_t rows, int64_t k);
// y [rows x n] = x . w^T where f32_narrow_supported; throws otherwise. With splits > 1 (dividing k / 32), each split
// sums its share of k in order into partials [splits x rows x n], then each output is their sum in split order.
void f32_narrow_xwt(const float* x, const float* w, float* y, int64_t rows, int64_t k, int64_t n, cudaStream_t s, float* partials = nullptr,
                    int splits = 1);

// y [count] = partials [splits x count] summed in split order (each split's own sum in k order before): the split
// products' second pass, here and in f32_tensor.cuh.
void f32_add_splits(const float* partials, int splits, int64_t count, float* y, cudaStream_t s);

}  // namespace pdb::cuda
