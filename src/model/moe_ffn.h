// The mixture-of-experts FFN block (qwen3moe today; deepseek2's routed part next), shared by every
// architecture whose layers route tokens to experts. Two arithmetics, as for the dense blocks:
//  - decoder-faithful (`lanes` 4/8/16): llama.cpp's build_moe_ffn on its CPU backend, op for op: the
//    F32 router through tinyBLAS, ggml's soft_max, a descending argsort, the selected weights
//    renormalized (double sum, clamped at 2^-14), each expert's products as mul_mat_id computes
//    them (per-row ggml_vec_dot, not tinyBLAS), ggml's SwiGLU, the weight applied after the down
//    projection and the experts summed in selection order;
//  - fast (`lanes` 0): tokens grouped by expert, one OpenBLAS GEMM per expert and projection.
#pragma once
#include <cstdint>
#include <vector>

namespace pdb {

struct MoeWeights {
  int64_t n_expert = 0, n_used = 0, hidden = 0, ff = 0;  // ff: one expert's width
  bool norm_topk = true;                                 // renormalize the selected weights (qwen3moe: always)
  float w_scale = 1.0f;                                  // routed_scaling_factor (llama.cpp applies it unless 0 or 1)
  std::vector<float> router;                             // [n_expert x hidden], HF layout
  std::vector<std::vector<float>> gate, up, down;        // per expert: [ff x hidden], [ff x hidden], [hidden x ff]
};

// Routing for `rows` tokens: the selected experts (in llama.cpp's order: descending probability) and
// their weights, [rows x n_used] each.
struct MoeRouting {
  std::vector<int32_t> experts;
  std::vector<float> weights;
};
MoeRouting moe_route(const MoeWeights& w, const float* x, int64_t rows, int lanes, int threads);

// out[rows x hidden] = MoE(x[rows x hidden]) (the block's output, before the residual add).
// `act_precision`: 16 / 17 round each expert product's input to f16 / bf16 (the decoder's
// vec_dot_type for F16 / BF16 expert weights), 32 leaves it.
void moe_ffn(const MoeWeights& w, const float* x, int64_t rows, int lanes, int act_precision, int threads, float* out);

}  // namespace pdb
