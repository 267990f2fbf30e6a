// DeepSeek-V4's hyper-connection mix (llama.cpp's build_hc_pre / build_hc_sinkhorn / build_hc_post,
// src/models/deepseek4.cpp), shared by the deepseek4 recipe (which needs only `pre`) and the CPU engine.
// Four residual streams per token; `mixes` = fn . rms_norm(flat 4E); pre[h] = sigmoid(m[h] s0 + b[h]) + eps;
// post[h] = 2 sigmoid(m[4+h] s1 + b[4+h]); comb[dst][src] = sinkhorn(m[8 + dst + 4 src] s2 + b[...]).
#pragma once
#include <cstdint>
#include <vector>

#include "formats/deepseek4_config.h"
#include "numerics/rope_ggml.h"

namespace pdb {

struct Dsv4HcWeights {
  const std::vector<float>* fn = nullptr;     // {4E, 24}: 24 rows of 4E
  const std::vector<float>* base = nullptr;   // {24}
  const std::vector<float>* scale = nullptr;  // {3}
};

struct Dsv4HcMix {
  float pre[4], post[4], comb[4][4];  // comb[dst][src]
};

// x: one token's 4 streams [4 x E]. Writes the mix and y = sum_h pre[h] x_h ([E]).
Dsv4HcMix dsv4_hc_pre(const Dsv4HcWeights& w, const float* x, int64_t E, float rms_eps, float hc_eps, int sinkhorn_iters, float* y);
// x_next[dst] = f * post[dst] + sum_src x[src] comb[dst][src]   (x, x_next: [4 x E]; may not alias)
void dsv4_hc_post(const Dsv4HcMix& m, const float* f, const float* x, int64_t E, float* x_next);

// The lightning indexer's choice for one query (the GPU twin: cuda/dsv4_indexer.cuh): the score of each of the
// `visible` blocks, sum_h w[h] * max(0, q_h . k_b) (q [heads x dim], keys [visible x dim]), and the top_k blocks by
// score in ascending block order (ties of the k-th score: lower indices first); all of them when fewer are visible.
std::vector<int64_t> dsv4_indexer_select(const float* q, const float* w, const float* keys, int64_t heads, int64_t dim, int64_t visible,
                                         int64_t top_k, std::vector<float>* scores = nullptr);
// The selection alone (the GPU twin: cuda/dsv4_indexer.cuh indexer_topk): the top_k of `visible` scores, as above.
std::vector<int64_t> dsv4_indexer_top_k(const float* scores, int64_t visible, int64_t top_k);

// The FP8 operands of the GPU's FP8 lightning indexer (cuda/dsv4_indexer.cuh indexer_fp8_rows, its twin): each
// dim-wide row of x as e4m3 codes with one power-of-two scale (ue8m0, as DeepSeek's own FP8 indexer), scale =
// 2^ceil(log2(amax / 448)) (1 for a zero row), code = e4m3(x / scale); values, where not null, gets code x scale
// (the operand the product sees; a power-of-two scale makes q.k of the values the scaled q.k of the codes);
// values may be x (each row is read whole before its values are written).
void dsv4_indexer_fp8_rows(const float* x, int64_t rows, int64_t dim, uint8_t* codes, float* scales, float* values = nullptr);

// One query's sparse attention before the output's de-RoPE (the GPU twin: cuda/dsv4_attention.cuh): per head h
// of q [heads x dim], out[h] = sum_j p_j keys[j] with p the softmax of scale * q_h . keys[j] over the keys and the
// head's sink as one more logit whose weight is dropped (the rows are the keys and the values).
void dsv4_attend(const float* q, const std::vector<const float*>& keys, const float* sinks, int64_t heads, int64_t dim, float scale, float* out);

// The RoPE of a layer (llama.cpp deepseek4.cpp:903-910): NORM pairs on the last r dims; ratio 0 plain with
// rope.freq_base; compressed layers (q, window, pools, indexer) the compress base with the model's YaRN, whose
// attn_factor 1/(1 + 0.1 ln factor) cancels ggml's YaRN magnitude factor.
GgmlRopeParams dsv4_rope(const Deepseek4Config& c, int64_t ratio);

}  // namespace pdb
