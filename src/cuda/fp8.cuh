// Activations into FP8 for the block-scaled products (gemm.cuh xwt_fp8): one f32 scale per row and
// 128 columns (DeepSeek-V3's 1x128 activation blocks), scale = amax / 448 (1 for an all-zero block),
// code = e4m3(x / scale), round-to-nearest-even, saturating. CPU twin: numerics/reference_ops.h
// quantize_rows_fp8 (scales in row-major order there; here in the order the product reads them).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm.cuh"

namespace pdb::cuda {

// x [rows x k] bf16 (k a multiple of 128) -> q [rows x k] e4m3 codes, scales at L.act_index(r, kb).
void quantize_rows_fp8(const __nv_bfloat16* x, int64_t rows, int64_t k, uint8_t* q, float* scales, const Fp8ScaleLayout& L,
                       cudaStream_t s);
// Bytes the scales of `rows` rows of width k take in layout L.
size_t fp8_scale_bytes(int64_t rows, int64_t k, const Fp8ScaleLayout& L);
// The engine's fp8 K/V rows (e4m3 codes [n_heads x capacity x head_dim], one f32 scale per head row
// [n_heads x capacity]) back to bf16 in the same layout, rows 0..rows-1 of each head: bf16(code x scale),
// round-to-nearest-even, the values the fused fp8 attention kernel computes in shared memory. The
// engine expands one layer's rows before each attention so the bf16 kernels run on them. CPU twin:
// bf16(fp8_e4m3_to_f32(code) x scale) (numerics/reference_ops.h, numeric.h).
void expand_fp8_rows(const uint8_t* codes, const float* scales, int n_heads, int64_t capacity, int64_t rows, int head_dim, __nv_bfloat16* out,
                     cudaStream_t s);
// y[i] += float(x[i]) (the residual add where the library has no f32-accumulating FP8 product)
void add_bf16_into_f32(const __nv_bfloat16* x, float* y, int64_t n, cudaStream_t s);

}  // namespace pdb::cuda
