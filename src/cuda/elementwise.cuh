// The engine's small fused kernels: embedding gather, SwiGLU, precision conversions, and the
// decoder's Q8_0 activation round trip. CPU twins: numerics/reference_ops.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

// h[r] = table[tokens[r]]  (rows x dim; f32 table: the residual stream starts exact)
void embed_rows(const float* table, const int32_t* tokens, int64_t rows, int64_t dim, float* h, cudaStream_t s);
// out[r][i] = silu(gu[r][i]) * gu[r][ff + i]   with gu = [gate | up] per row; f32 math, bf16 result
void swiglu_rows(const __nv_bfloat16* gu, __nv_bfloat16* out, int64_t rows, int64_t ff, cudaStream_t s);
// The same in f32 throughout (the decoder's; model/product_numerics.h).
void swiglu_rows_f32(const float* gu, float* out, int64_t rows, int64_t ff, cudaStream_t s);
// The same rounded to half as it is written: swiglu_rows_f32 then product_input_half(block 0) in one pass (the down
// product's input under half numerics, without the f32 rows' write and read).
void swiglu_rows_f32_half(const float* gu, __half* out, int64_t rows, int64_t ff, cudaStream_t s);
// A product's activations as the decoder rounds them (model/product_numerics.h), as half: x [n] (f32, or bf16 when
// !x_f32; n a multiple of `block`) quantized per block first (0: none; 32: Q8_0 values as q8_0_round_trip; 256: Q8_K
// values as q8_k_round_trip), then rounded to half. CPU twin: the round trips' host twins, then f32 -> f16.
void product_input_half(const void* x, bool x_f32, int64_t n, int block, __half* y, cudaStream_t s);
// Round-to-nearest-even conversions (what F16C and ggml's bf16 conversion do).
void f32_to_f16(const float* x, __half* y, int64_t n, cudaStream_t s);
void f32_to_bf16(const float* x, __nv_bfloat16* y, int64_t n, cudaStream_t s);
void f16_to_f32(const __half* x, float* y, int64_t n, cudaStream_t s);
// qkv[r] = q[r] | bf16(k[r]) | bf16(v[r])  (rows of qw, kw, kw values): a fused q|k|v product's bf16 rows from its
// q columns' product and the k and v columns' f32 products (the engine's own cache rows, which it makes anyway).
void assemble_qkv_rows(const __nv_bfloat16* q, const float* k, const float* v, int64_t rows, int64_t qw, int64_t kw, __nv_bfloat16* qkv,
                       cudaStream_t s);
// x <- dequantize(quantize_q8_0(x)) per 32-element block, with ggml-cpu's x86 quantizer
// (d = amax/127, q = round-half-even(x * 127/amax), d stored as f16).
void q8_0_round_trip(float* x, int64_t n, cudaStream_t s);
// x [n] (n a multiple of 256) replaced by its Q8_K values, as ggml's quantize_row_q8_K_ref: scale -max/127 (max the
// block's first element of largest magnitude), codes rounded to even, at most 127. CPU twin: ggmlnum::round_through.
void q8_k_round_trip(float* x, int64_t n, cudaStream_t s);
// Q4_1/Q5_1 weights' Q8_1 block sums (ggmlnum::q8_1_sum_corrections, its CPU twin): per 32-block of x [n] (f32),
// c = f16(d * sum q) - f16(d) * sum q with ggml-cpu's x86 Q8_1 codes and d = amax/127.
void q8_1_sum_corrections(const float* x, int64_t n, float* c, cudaStream_t s);
// y[r][c] += bias[c]
void add_bias_rows(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t s);

// x <- x as a cache of `type` holds it: 1 f16, 2 bf16 (0: f32, nothing to do).
void round_as_cached(float* x, int64_t n, int type, cudaStream_t s);
void scale_f32(float* x, int64_t n, float a, cudaStream_t s);

}  // namespace pdb::cuda
