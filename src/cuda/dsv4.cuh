// DeepSeek-V4's own kernels for the GPU engine (model/cuda_engine_dsv4.h): the hyper-connection mixes, the
// compressors' pooling, the Hadamard rotation, the routing (sqrt-softplus scores, selection bias or the hash
// layers' table), the clamped SwiGLU, MXFP4 experts back to bf16, and the pieces of the sparse attention (the
// keys each query sees gathered into one batch, the softmax with per-head sinks, the de-RoPE of the output).
// CPU twins: numerics/deepseek4_blocks.h (hc, indexer), recipes/deepseek4.cpp (pool, rings), recipes/recipe.h
// (hadamard_rows), model/cpu_engine_dsv4.cpp (routing, SwiGLU, attention), formats/ggml_types.h (MXFP4).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cache_rows.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/rope.cuh"

namespace pdb::cuda {

// One token's mix, as 24 floats: pre[4], post[4], comb[dst * 4 + src].
constexpr int kDsv4MixFloats = 24;

// m [n x 24]: fn . rms_norm(x) (the caller's product). mix [n x 24]; y [n x E] = sum_h pre[h] x_h.
void dsv4_hc_mix(const float* m, const float* x, const float* base, const float* scale, int64_t n, int64_t E, float hc_eps, int iters,
                 float* mix, float* y, cudaStream_t s);
// The mix alone, from products of the raw streams: m [n x ldm] = fn . x (the first 24 of each row), each row's
// products times inv_rms[t] (nullptr: m is already of the normalized streams).
void dsv4_hc_coefs(const float* m, int64_t ldm, const float* inv_rms, const float* base, const float* scale, int64_t n, float hc_eps, int iters,
                   float* mix, cudaStream_t s);
// y [n x E] = sum_h pre[h] x_h with the mix's pre.
void dsv4_hc_pre_sum(const float* x, const float* mix, int64_t n, int64_t E, float* y, cudaStream_t s);
// The pre-sum then rmsnorm_rows with weights w, in one pass (the sum never leaves the block): y [n x E] the normed
// rows, with y_bf16 also their bf16 copy (f32_to_bf16's), with q8 / q8_scales also their Q8_0 blocks
// (quantize_rows_q8's; E a multiple of 32). The same bits as dsv4_hc_pre_sum + rmsnorm_rows (+ f32_to_bf16, +
// quantize_rows_q8): each element's sum and each row's double sum of squares in the same order. Needs E <= 4,096
// (dsv4_hc_pre_sum_norm_supported); 0.6-0.9 GB less traffic a use at a 32K chunk.
bool dsv4_hc_pre_sum_norm_supported(int64_t E);
void dsv4_hc_pre_sum_norm(const float* x, const float* mix, int64_t n, int64_t E, const float* w, float eps, float* y, __nv_bfloat16* y_bf16,
                          cudaStream_t s, int8_t* q8 = nullptr, float* q8_scales = nullptr);
// inv[t] = 1 / sqrt(mean(x_t^2) + eps) over rows of `width` (rmsnorm_rows' scale, without the normalized copy).
void dsv4_row_inv_rms(const float* x, int64_t n, int64_t width, float eps, float* inv, cudaStream_t s);
// x_next[dst] = f * post[dst] + sum_src comb[dst][src] x[src]   (x, x_next [n x 4 x E], f [n x E]); with inv_next,
// also x_next's inv-rms over its 4E values (dsv4_row_inv_rms of x_next, in the same pass).
// With combine.y: f's rows plus the routed experts' rows weighted (moe_combine's sums, added as it adds them), in
// the same pass: f is read once and never rewritten (the same bits as moe_combine then dsv4_hc_post).
struct Dsv4Combine {
  const __nv_bfloat16* y = nullptr;  // [rows x n_used, as slot_of places them] x E
  const int32_t* slot_of = nullptr;
  const float* weights = nullptr;
  int n_used = 0;
};
void dsv4_hc_post(const float* f, const float* mix, const float* x, int64_t n, int64_t E, float* x_next, cudaStream_t s,
                  float* inv_next = nullptr, float eps = 0.0f, const Dsv4Combine& combine = {});
// x [n x 4 x E]: each token's embedding row in all four streams.
void dsv4_embed_streams(const float* table, const int32_t* tokens, int64_t n, int64_t E, float* x, cudaStream_t s);

// g[t] += ape[(pos0 + t) % ratio]  (rows of cw)
void dsv4_add_ape(float* g, const float* ape, int64_t n, int64_t cw, int64_t pos0, int ratio, cudaStream_t s);
// The compressor's pooled rows of blocks b0 .. b0 + nb - 1 from its history a, g [rows x cw] (row 0 = position h0;
// cw = 2 width for ratio 4, width for 128): per channel the softmax of the scores over the block's entries.
void dsv4_pool(const float* a, const float* g, int64_t h0, int64_t b0, int64_t nb, int ratio, int64_t width, float* out, cudaStream_t s);
// q [n x heads x D] f32 -> out bf16: each head's row RMS-normalized without a weight (rmsnorm_rows' arithmetic),
// its last r dims roped by cs [n x r] (rope_tail's), then bf16: one pass where the three took five over q.
// D a multiple of 64.
void dsv4_head_norm_rope_bf16(const float* q, const float* cs, int64_t n, int heads, int D, int r, float eps, __nv_bfloat16* out, cudaStream_t s);
// The same from a bf16 q (the q product's own output: half the bytes through the pass and the product's epilogue).
void dsv4_head_norm_rope_bf16(const __nv_bfloat16* q, const float* cs, int64_t n, int heads, int D, int r, float eps, __nv_bfloat16* out,
                              cudaStream_t s);

// Routing: p = sqrt(softplus(logit)); the experts: tid2eid[token] (hash layers) or the top k of p + bias; the
// weights p / max(sum, 2^-14) * scale (scale 0 or 1: none). n_expert <= 256, k <= 16.
void dsv4_route(const float* logits, const float* bias, const int32_t* tid2eid, const int32_t* tokens, int64_t n, int n_expert, int k,
                float scale, int32_t* experts, float* weights, cudaStream_t s);
// out[r][i] = silu(min(g, L)) * clamp(u, -L, L) with gu = [gate | up] per row (L <= 1e-6: no clamp)
void swiglu_clamp_rows(const __nv_bfloat16* gu, __nv_bfloat16* out, int64_t rows, int64_t ff, float limit, cudaStream_t s);
// GGUF MXFP4 blocks (1 byte e8m0, 16 bytes of 32 e2m1 codes) -> bf16 (exact). blocks_per_group > 0: each group of
// that many blocks (one expert's matrix) starts group_stride elements after the previous one in `out` (the gate and
// up matrices into the halves of each expert's fused gate|up rows).
void mxfp4_to_bf16(const uint8_t* blocks, int64_t n_blocks, __nv_bfloat16* out, cudaStream_t s, int64_t blocks_per_group = 0,
                   int64_t group_stride = 0);
// GGUF MXFP4 matrices [experts x rows x cols] (32-blocks along cols; rows, cols multiples of 128) -> e4m3 codes
// with one f32 scale per 128 x 128 tile, the weight operand of the block-scaled FP8 product (gemm.cuh xwt_fp8):
// a tile's scale is 2^(its largest block exponent - 128) and each value m x 2^(e - emax) (m the doubled e2m1
// magnitude, ggml's kvalues_mxfp4), which e4m3 holds exactly while e - emax >= -9; a nonzero value that it does
// not hold is rounded to nearest and counted into *inexact. Expert x's row r goes to codes + x * code_stride +
// (row0 + r) * cols, tile (nb, kb)'s scale to scales + x * scale_stride + (kb_fastest ? (row0 / 128 + nb) * ld + kb
// : kb * ld + row0 / 128 + nb): W's grid order as Fp8ScaleLayout::weight_index has it.
struct Mxfp4ToFp8 {
  const uint8_t* blocks;
  int64_t experts, rows, cols;
  uint8_t* codes;
  int64_t code_stride, row0;
  float* scales;
  int64_t scale_stride, ld;
  bool kb_fastest;
  unsigned* inexact;
};
void mxfp4_to_fp8_tiles(const Mxfp4ToFp8& a, cudaStream_t s);

// The sparse attention's keys for queries at positions t0 .. t0 + nq - 1: slot j < W the window row of position
// t - W + 1 + j (from win [rows x D], row 0 = position win_first), slot W + i the compressed row: ratio 128 block
// i while i < (t + 1) / 128, ratio 4 the indexer's choice idx[q][i] (>= 0). kg [nq x NK x D], valid [nq x NK].
struct Dsv4KeyGather {
  const __nv_bfloat16* win = nullptr;
  int64_t win_first = 0;
  const __nv_bfloat16* pool = nullptr;
  const int32_t* idx = nullptr;  // ratio 4: [nq x top_k]
  int top_k = 0, ratio = 0, W = 0, NK = 0, D = 0;
  int64_t t0 = 0, nq = 0;
};
void dsv4_gather_keys(const Dsv4KeyGather& g, __nv_bfloat16* kg, uint8_t* valid, cudaStream_t s);
// p = softmax over the valid slots of s * scale, with the head's sink as one more logit (its weight dropped):
// s [nq x H x NK] f32 -> p bf16 (0 where not valid).
void dsv4_sink_softmax(const float* sc, const uint8_t* valid, const float* sinks, int64_t nq, int H, int NK, float scale, __nv_bfloat16* p,
                       cudaStream_t st);
// The output's last r dims of each head rotated back by its query's angle (cs [n x r]: cos, sin per pair).
void dsv4_derope(__nv_bfloat16* o, const float* cs, int64_t n, int H, int D, int r, cudaStream_t s);

// Random weights for the real-shape benchmarks (a hash of seed and index; uniform with this sd).
void fill_random_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed, float sd, cudaStream_t s);
void fill_random_f32(float* p, int64_t n, uint64_t seed, float sd, float mean, cudaStream_t s);
void fill_random_mxfp4(uint8_t* blocks, int64_t n_blocks, uint64_t seed, uint8_t e8m0, cudaStream_t s);
void fill_random_q8(int8_t* q, float* d, int64_t n, uint64_t seed, float scale, cudaStream_t s);  // d [n / 32]

}  // namespace pdb::cuda
