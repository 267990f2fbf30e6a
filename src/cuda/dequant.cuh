// GGUF weight blocks to bf16, half (or f32) on the GPU: the per-layer expansion of weights kept quantized in device memory
// (model/cuda_weights.h), and the embedding rows of a quantized token table. The block decoders are the host's own
// source (formats/ggml_decode.h): each value is ggml's to_float bit for bit, then rounded to bf16 (round to nearest
// even). CPU twin: dequantize_row + f32_to_bf16 (tests: cuda/kernels_test.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "formats/ggml_types.h"

namespace pdb::cuda {

// One contiguous stretch of quantized blocks and where its bf16 values go (element offset into the destination).
struct DequantSegment {
  const uint8_t* src = nullptr;
  int64_t dst_offset = 0;  // elements
  int64_t block0 = 0;      // the stretch's first group in the launch's running count (segments sorted by it)
};

// Weights one GPU thread decodes (a group): 32 of a quantized type (ggml_decode.h's groups), 8 of a float type.
int64_t dequant_group_elements(GgmlType t);
bool can_dequantize_on_device(GgmlType t);

// Expands `total_groups` groups of type t described by `segments` (device memory, `n_segments` of them, block0
// ascending from 0) into dst, as bf16 (or half: the decoder's products, model/product_numerics.h).
void dequantize_segments(GgmlType t, const DequantSegment* segments, int n_segments, int64_t total_groups, void* dst, bool half, cudaStream_t s);

// h[i, :] = row tokens[i] of a [vocab x dim] table of type t (rows of row_bytes), as f32.
void dequantize_rows_f32(GgmlType t, const uint8_t* table, int64_t row_bytes, const int32_t* tokens, int64_t rows, int64_t dim, float* h,
                         cudaStream_t s);

}  // namespace pdb::cuda
