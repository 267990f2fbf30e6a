// deepseek2's RoPE and score scale as llama.cpp derives them (src/llama-context.cpp, src/models/deepseek2.cpp):
// NORM pairs over qk_rope_head_dim, YaRN with attn_factor 1 / (1 + 0.1 ln f) (which cancels ggml's own
// YaRN magnitude), and kq_scale = mscale^2 / sqrt(nope + rope) with DeepSeek's mscale_all_dim. Both
// engines' MLA blocks use it (model/cpu_attention_mla.cpp, model/cuda_attention_mla.cpp).
#pragma once
#include "formats/hf_config.h"
#include "numerics/rope_ggml.h"

namespace pdb {

struct MlaRope {
  GgmlRopeParams rope;
  float kq_scale = 1.0f;
};
MlaRope mla_rope(const HfConfig& c);  // throws for a RoPE scaling other than YaRN or none

}  // namespace pdb
