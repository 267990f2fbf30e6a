// The decoder's integer path for block-quantized weights (Q8_0, Q4_0): ggml-cpu quantizes the
// activation to Q8_0 (ties to even, as its SIMD quantizer rounds), multiplies 32-element blocks in
// integers, and scales each block's integer sum by d_x * d_w in f32. These are the host functions
// the recipe uses; src/cuda/q8_gemm.cu does the same products on the GPU in the same order.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/ggml_types.h"

namespace pdb {

// A weight as signed 8-bit codes and one f32 scale per 32 codes (row-major: [rows x cols], [rows x cols/32]).
struct Q8Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
};

// GGUF Q8_0 / Q4_0 blocks of a [rows x cols] weight -> codes and scales (Q4_0 codes are nibble - 8).
// d * q reproduces dequantize_row exactly. Throws for other types.
Q8Matrix unpack_q8_blocks(GgmlType t, const uint8_t* blocks, int64_t rows, int64_t cols);
bool has_q8_path(GgmlType t);

// x [rows x k] f32 -> Q8_0 codes and scales (f16-rounded), ggml-cpu's rounding.
void quantize_rows_q8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d);

// y[r][o] = sum over blocks b, in order, of fma(dx[r][b] * dw[o][b], float(sum_k qx*qw), acc)
void q8_block_gemm(const int8_t* qx, const float* dx, const Q8Matrix& w, int64_t rows, float* y);

}  // namespace pdb
