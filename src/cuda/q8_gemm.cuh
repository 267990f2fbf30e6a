// The recipe's products with block-quantized decoder weights (Q8_0, Q4_0), as ggml-cpu computes them:
// the activation quantized to Q8_0, 32-element blocks multiplied in integers (int8 tensor cores,
// mma.sync m16n8k32), each block's sum scaled by d_x * d_w and added in f32 in block order. The same
// operations in the same order as the host's numerics/q8_dot.cpp (its twin): results are bit-identical.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

// x [rows x k] f32 (k a multiple of 32) -> codes [rows x k] and f16-rounded scales [rows x k/32].
void quantize_rows_q8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, cudaStream_t s);

// y [rows x n] f32 = the block products of qx/dx [rows x k] and qw/dw [n x k] (k a multiple of 128).
void q8_block_gemm(const int8_t* qx, const float* dx, const int8_t* qw, const float* dw, float* y, int64_t rows, int64_t k, int64_t n,
                   cudaStream_t s);

}  // namespace pdb::cuda
