// The float arithmetic of llama.cpp's CPU forward that our engine mirrors in its decoder-faithful
// mode: ggml's vectorized expf, SiLU/SwiGLU, and the tiled flash attention over the KV cache (64-key
// tiles, sequential FMA dots, online softmax with a double-summed exponent total). Each function
// reproduces one ggml-cpu routine lane for lane, so results match bit for bit, for the decoder's
// SIMD ISA named by its float width `lanes`: 8 = AVX2, 16 = AVX-512 (F+DQ), 4 = NEON. The ISAs differ
// in ggml_v_expf (AVX-512 scales by 2^n with vscalefps and keeps the polynomial's constant term)
// and in how ggml_vec_soft_max_f32 folds each vector of exponentials before adding it to its
// double total (16 or 8 lanes folded in halves; NEON's vaddvq adds adjacent pairs).
#pragma once
#include <cstdint>
#include <vector>

#include "formats/ggml_types.h"

namespace pdb::ggmlnum {

// What ggml-cpu makes of the activations before a product with quantized weights (its type traits' vec_dot_type):
// Q8_0 blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4: Q8_1's values are Q8_0's), Q8_K super-blocks (the
// K-quants and IQ types), or nothing (float weights: f16/bf16 rounding is the engine's activation precision).
enum class ActQuant { none, q8_0, q8_k };
ActQuant act_quant_for(GgmlType weight_type);
// Each row of x [rows x cols] replaced by the values its quantization holds (code times scale): ggml-cpu's x86 Q8_0
// (scale amax/127 stored as f16, codes x * 127/amax rounded to even) or Q8_K (scale -max/127 in f32 with max the
// element of largest magnitude, codes rounded to even, at most 127). Rows not whole blocks are left as they are.
void round_through(ActQuant q, float* x, int64_t rows, int64_t cols);

// Q4_1 and Q5_1 weights (w = d * q + m per 32-block) multiply ggml-cpu's Q8_1 activations, which carry each block's
// sum as f16(d * sum q) with d = amax/127 in f32: the min's term is m * that sum, where a product with the activations'
// exact values (round_through's Q8_0 values: the same codes) sums f16(d) * q. Per block of each row of x [rows x cols]
// (cols a multiple of 32): c = f16(d * sum q) - f16(d) * sum q, what m * c adds to the exact product.
bool carries_q8_1_sums(GgmlType weight_type);
void q8_1_sum_corrections(const float* x, int64_t rows, int64_t cols, float* c);
// A Q4_1 or Q5_1 weight's block mins m [rows x cols/32] as f32 (the f16 at bytes 2-3 of each block).
std::vector<float> q8_1_block_mins(GgmlType t, const uint8_t* blocks, int64_t rows, int64_t cols);

float v_expf(float x, int lanes = 8);  // ggml_v_expf, one lane
float silu(float x, int lanes = 8);    // ggml_v_silu: x / (1 + v_expf(-x))
// ggml_vec_swiglu_f32 on each of `rows` rows of `n` elements; the tail past the last full vector
// goes through ggml_silu_f32 (libm expf), as in ggml.
void swiglu(int64_t rows, int64_t n, float* y, const float* gate, const float* up, int lanes = 8);

// ggml_vec_dot_f32 / ggml_vec_dot_f16 (the per-row products of mul_mat_id, i.e. every MoE expert
// matmul, which never go through tinyBLAS): 4 accumulators of `lanes` floats over steps of 4*lanes,
// folded pairwise, then the vector's horizontal sum (AVX-512 halves; AVX2 halves to 4 then hadd's
// neighbour pairs; NEON vaddvq), then the scalar tail (f32: in float with FMA; f16: in double).
// For f16 pass the values already rounded to f16.
float vec_dot_f32(const float* x, const float* y, int64_t n, int lanes = 8);
float vec_dot_f16(const float* x, const float* y, int64_t n, int lanes = 8);

// ggml_compute_forward_soft_max_f32 on one row without mask or scale: max, ggml_vec_soft_max_f32
// (ggml_v_expf per full vector, its horizontal sum added to a double total; libm expf for the
// tail), then every element times (float)(1/total).
void soft_max_row(const float* x, float* y, int64_t n, int lanes = 8);

// One query row of ggml_compute_forward_flash_attn_ext_tiled: keys/values [n_keys x stride] (rows
// already as the decoder's cache holds them), only keys j < n_valid are visible (causal mask).
void flash_attn_row(const float* q, const float* k, const float* v, int64_t stride, int64_t n_valid, int64_t head_dim,
                    float scale, float* out, int lanes = 8);
// The same with values narrower than keys (MLA's absorbed attention: keys kv_lora + rope wide, values
// the first kv_lora elements of the same rows).
void flash_attn_row_kv(const float* q, const float* k, const float* v, int64_t stride, int64_t n_valid, int64_t dk, int64_t dv,
                       float scale, float* out, int lanes = 8);

}  // namespace pdb::ggmlnum

namespace pdb::ggmlnum {

// ggml_vec_dot_q8_0_q8_0 (AVX2): per block, 8 lanes of 4-product integer sums scaled by d_x*d_y and
// FMA-accumulated, then folded. `n` elements, both rows in Q8_0 blocks.
float vec_dot_q8_0(const uint8_t* x, const uint8_t* y, int64_t n);

// One query row of ggml_compute_forward_flash_attn_ext_f16_one_chunk for a Q8_0 K cache: `q_q8` is
// the (already rotated) query in Q8_0, `k_q8` rows of Q8_0 keys with `k_stride` bytes between rows,
// `v` dequantized value rows (`v_stride` floats apart). Per-key online softmax, as llama.cpp does.
void flash_attn_row_q8(const uint8_t* q_q8, const uint8_t* k_q8, int64_t k_stride, const float* v, int64_t v_stride,
                       int64_t n_valid, int64_t head_dim, float scale, float* out);

}  // namespace pdb::ggmlnum
