// The decoder's cache row formats, produced on the GPU so that quantized-cache rows leave the device
// already in their final bytes (a q8_0 row is 1.06 bytes per element instead of 4 as f32, and the
// host no longer rotates and quantizes them on the capture's critical path). CPU twins:
// recipes/recipe.h hadamard_rows (llama.cpp's rotation of quantized caches) and formats/ggml_types.h
// quantize_row with Q8Rounding::TiesEven (ggml-cpu's x86 quantizers, which write the decoder's cache).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "formats/ggml_types.h"

namespace pdb::cuda {

// In-place normalized Walsh-Hadamard transform of consecutive n-element chunks (n a power of two,
// 2..512), in ggml-cpu's order: scale first, then butterflies of growing span. Only whole chunks are
// transformed, as on the CPU. Bit-identical to the twin (each step is one rounded add or multiply).
void hadamard_rows(float* x, int64_t n_total, int64_t n, cudaStream_t s);
// The same over `groups` consecutive groups of `n` floats (n a power of two <= 4096): DeepSeek-V4's rotations.
void hadamard_groups(float* x, int64_t groups, int n, cudaStream_t s);

// Types encode_rows writes on the GPU.
bool encodes_on_gpu(GgmlType t);
// x: n f32 values (rows of a multiple-of-32 width laid end to end) -> out: their bytes in type t
// (F32, F16, Q8_0, Q4_0), what ggml_row_bytes says per row.
void encode_rows(GgmlType t, const float* x, int64_t n, uint8_t* out, cudaStream_t s);

}  // namespace pdb::cuda
