// Internal to the CPU engine: a deepseek2 layer's weights (HF layout [out x in]).
#pragma once
#include <vector>

#include "model/cpu_engine.h"
#include "model/moe_ffn.h"

namespace pdb {

struct CpuEngine::MlaLayer {
  std::vector<float> in_norm, post_norm, kv_a_norm;
  std::vector<float> wq;                // [n_head*(nope+rope) x hidden] (q_lora_rank 0: Lite)
  std::vector<float> wq_a, q_a_norm, wq_b;  // q_lora_rank > 0
  std::vector<float> wkv_a;             // [kv_lora + rope x hidden]
  std::vector<std::vector<float>> k_b;  // per head [kv_lora x nope]: the absorbed query's weight (W_UK_h^T)
  std::vector<std::vector<float>> v_b;  // per head [v x kv_lora]: W_UV_h
  std::vector<float> wo;                // [hidden x n_head*v]
  std::vector<float> wg, wu, wd;        // dense layers (< first_k_dense_replace), or the shared experts
  MoeWeights moe;                       // routed experts (MoE layers)
  bool dense = false;
};

}  // namespace pdb
