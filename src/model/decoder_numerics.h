// The float arithmetic of llama.cpp's CPU forward that our engine mirrors in its decoder-faithful
// mode (x86 AVX2 path): ggml's vectorized expf, SiLU/SwiGLU, and the tiled flash attention over the
// KV cache (64-key tiles, sequential FMA dots, online softmax with a double-summed exponent total).
// Each function reproduces one ggml-cpu routine lane for lane, so results match bit for bit.
#pragma once
#include <cstdint>

namespace pdb::ggmlnum {

float v_expf(float x);                 // ggml_v_expf (AVX2), one lane
float silu(float x);                   // ggml_v_silu: x / (1 + v_expf(-x))
void swiglu(int64_t n, float* y, const float* gate, const float* up);  // ggml_vec_swiglu_f32

// One query row of ggml_compute_forward_flash_attn_ext_tiled: keys/values [n_keys x stride] (rows
// already as the decoder's cache holds them), only keys j < n_valid are visible (causal mask).
void flash_attn_row(const float* q, const float* k, const float* v, int64_t stride, int64_t n_valid, int64_t head_dim,
                    float scale, float* out);

}  // namespace pdb::ggmlnum
