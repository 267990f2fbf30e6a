// Activations into FP8 for the block-scaled products (gemm.cuh xwt_fp8): one f32 scale per row and
// 128 columns (DeepSeek-V3's 1x128 activation blocks), scale = amax / 448 (1 for an all-zero block),
// code = e4m3(x / scale), round-to-nearest-even, saturating. CPU twin: model/reference_ops.h
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
// y[i] += float(x[i]) (the residual add where the library has no f32-accumulating FP8 product)
void add_bf16_into_f32(const __nv_bfloat16* x, float* y, int64_t n, cudaStream_t s);

}  // namespace pdb::cuda
