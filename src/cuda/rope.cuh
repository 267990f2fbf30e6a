// RoPE on the GPU, two flavours:
//  - the engine's own (HF rotate-half with the checkpoint's inverse frequencies and attention
//    scaling, incl. linear/yarn/llama3), fused with the QKV split, qwen3's per-head Q/K norms and
//    the write of K/V into the engine's cache;
//  - the recipe's (the decoder's: ggml's pair layout and its cos/sin values, computed on the host by
//    numerics/rope_ggml.cpp so that every angle is the decoder's to the bit).
// CPU twins: numerics/reference_ops.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

struct QkvRopeArgs {
  int64_t rows = 0, pos0 = 0;
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  const float* inv_freq = nullptr;  // [head_dim/2]
  float attn_scale = 1.0f;          // multiplies cos and sin (yarn's mscale), 1 otherwise
  const float* q_norm = nullptr;    // [head_dim] per-head RMSNorm weights (qwen3), or null
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  int64_t kv_capacity = 0;          // rows per head in the caches
  // The engine's fp8 K/V option: when set, K and V rows go here instead of the bf16 caches, as e4m3
  // codes [n_kv_heads x kv_capacity x head_dim] with one f32 scale per (head, row)
  // [n_kv_heads x kv_capacity]: the bf16-rounded row quantized as quantize_rows_fp8 quantizes a
  // 128-wide block (scale = amax / 448, 1 for a zero row; code = e4m3(x / scale), RNE, saturating).
  uint8_t* k_fp8 = nullptr;
  uint8_t* v_fp8 = nullptr;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
};

// qkv: [rows x (n_heads + 2 n_kv_heads) x head_dim] (one GEMM's output: Q heads, K heads, V heads).
// Writes q_out [rows x n_heads x head_dim], and K/V rows pos0.. into k_cache/v_cache
// [n_kv_heads x kv_capacity x head_dim].
void qkv_rope_to_cache(const __nv_bfloat16* qkv, __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                       const QkvRopeArgs& a, cudaStream_t s);
// The same from an f32 product (a half product's result, read without its bf16 copy): values that bf16 holds exactly
// give the same bits as the bf16 form.
void qkv_rope_to_cache(const float* qkv, __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const QkvRopeArgs& a,
                       cudaStream_t s);

// The decoder's RoPE on K rows [rows x n_heads x head_dim] (f32, in place). cs: [rows x n_dims]
// interleaved cos, sin per pair (ggml_rope_cache's layout). k_norm: per-head RMSNorm applied first
// (qwen3's attn_k_norm, ggml's order: double sum, x*scale, then *w), or null. row_stride: elements from
// one row to the next (0: n_heads * head_dim; MLA ropes the k_pe tail of its wider cache row).
void rope_ggml_rows(float* k, const float* cs, int64_t rows, int n_heads, int head_dim, int n_dims, bool neox,
                    const float* k_norm, float eps, cudaStream_t s, int64_t row_stride = 0);

// The engine's K and V rows [rows x n_heads x head_dim] (f32) straight into an f16 cache's bytes in one pass: K from
// HF's order where hf_order (as qk_rows_to_gguf_order), k_norm and the decoder's RoPE (as rope_ggml_rows), both
// rounded to f16 (as encode_rows); k_out and v_out hold rows x n_heads x head_dim halves. (The GPU backend's rows for
// an f16 cache without rotation, the engine's or the recipe's, in place of two copies, the RoPE and two encodes;
// PDBRIDGE_ROWS_FUSED=0 runs those.) in_stride: floats from one input row to the next (0: a row's n_heads x head_dim),
// e.g. the K and V columns of a q|k|v product read where the product wrote them.
void kv_rows_to_f16(const float* k, const float* v, const float* cs, int64_t rows, int n_heads, int head_dim, int n_dims, bool neox, bool hf_order,
                    const float* k_norm, float eps, void* k_out, void* v_out, cudaStream_t s, int64_t in_stride = 0);

// Q/K rows from HF's order into the order convert_hf_to_gguf permutes llama's rows into (per head, element 2i + a is
// HF's a * head_dim/2 + i): the CPU twin is formats/hf_to_gguf.h's permute_qk_rows. in and out must not overlap.
void qk_rows_to_gguf_order(const float* in, float* out, int64_t rows, int n_heads, int head_dim, cudaStream_t s);

// ggml's NORM RoPE on the last r dims of each of `heads` groups of `width` per row (rows row_stride apart, 0:
// heads * width): pair i0 of row t by cs[t * r + i0], cs[t * r + i0 + 1] (cos, sin).
// cs_stride: floats from one row's cos/sin to the next (0: r; the pools read every ratio-th row of the chunk's table).
void rope_tail(float* x, const float* cs, int64_t n, int heads, int width, int r, int64_t row_stride, cudaStream_t s, int64_t cs_stride = 0);

}  // namespace pdb::cuda
