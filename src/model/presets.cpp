#include "model/presets.h"

#include <stdexcept>

namespace pdb {

std::vector<std::string> preset_names() { return {"tiny", "small", "8b", "qwen3-30b-a3b", "deepseek-v2-lite"}; }

namespace {
// Qwen3MoE shapes. tiny: every width a multiple of 64, so the decoder's per-row expert dot products
// (ggml_vec_dot, 32 or 64 floats per step) have no scalar tail on any x86 ISA.
HfConfig qwen3moe_preset(const std::string& preset) {
  HfConfig c;
  c.arch = "qwen3moe";
  c.torch_dtype = "float32";
  c.rope_theta = 1000000.0;
  c.rms_norm_eps = 1e-6;
  c.norm_topk_prob = true;
  if (preset == "tiny") {
    c.hidden_size = 128; c.num_layers = 2; c.num_heads = 4; c.num_kv_heads = 2; c.head_dim = 64;
    c.intermediate_size = 384; c.max_position_embeddings = 32768;
    c.num_experts = 8; c.num_experts_per_tok = 2; c.moe_intermediate_size = 64;
  } else if (preset == "qwen3-30b-a3b") {  // Qwen3-30B-A3B's config.json
    c.hidden_size = 2048; c.num_layers = 48; c.num_heads = 32; c.num_kv_heads = 4; c.head_dim = 128;
    c.intermediate_size = 6144; c.max_position_embeddings = 40960;
    c.num_experts = 128; c.num_experts_per_tok = 8; c.moe_intermediate_size = 768;
  } else {
    throw std::invalid_argument("unknown qwen3moe preset '" + preset + "' (tiny, qwen3-30b-a3b)");
  }
  return c;
}

// DeepSeek-V2 shapes (MLA, softmax top-k routing, shared experts, YaRN with mscale). tiny: every row a
// whole number of q8_0 blocks (the cache row is kv_lora + rope = 96), widths multiples of 64.
HfConfig deepseek2_preset(const std::string& preset) {
  HfConfig c;
  c.arch = "deepseek2";
  c.torch_dtype = "float32";
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-6;
  c.q_lora_rank = 0;
  c.norm_topk_prob = false;
  c.routed_scaling_factor = 1.0;
  c.first_k_dense_replace = 1;
  c.n_group = c.topk_group = 1;  // DeepSeek-V2-Lite's config.json
  auto& rs = c.rope_scaling;
  rs.type = RopeScalingType::Yarn;
  rs.original_max_position_embeddings = 4096;
  rs.beta_fast = 32; rs.beta_slow = 1;
  rs.mscale = 0.707; rs.mscale_all_dim = 0.707;
  if (preset == "tiny") {
    c.hidden_size = 128; c.num_layers = 2; c.num_heads = 2; c.num_kv_heads = 2;
    c.kv_lora_rank = 64; c.qk_rope_head_dim = 32; c.qk_nope_head_dim = 32; c.v_head_dim = 32;
    c.intermediate_size = 256; c.max_position_embeddings = 16384;
    c.num_experts = 4; c.num_experts_per_tok = 2; c.moe_intermediate_size = 64; c.n_shared_experts = 1;
    rs.factor = 4;
  } else if (preset == "small") {  // V2's own head widths (nope 128 + rope 64 keys, 128 values) at a small hidden size: the GPU tests' MLA
    c.hidden_size = 256; c.num_layers = 3; c.num_heads = 4; c.num_kv_heads = 4;
    c.kv_lora_rank = 128; c.qk_rope_head_dim = 64; c.qk_nope_head_dim = 128; c.v_head_dim = 128;
    c.intermediate_size = 512; c.max_position_embeddings = 16384;
    c.num_experts = 8; c.num_experts_per_tok = 2; c.moe_intermediate_size = 128; c.n_shared_experts = 1;
    rs.factor = 4;
  } else if (preset == "deepseek-v2-lite") {  // DeepSeek-V2-Lite's config.json
    c.hidden_size = 2048; c.num_layers = 27; c.num_heads = 16; c.num_kv_heads = 16;
    c.kv_lora_rank = 512; c.qk_rope_head_dim = 64; c.qk_nope_head_dim = 128; c.v_head_dim = 128;
    c.intermediate_size = 10944; c.max_position_embeddings = 163840;
    c.num_experts = 64; c.num_experts_per_tok = 6; c.moe_intermediate_size = 1408; c.n_shared_experts = 2;
    rs.factor = 40;
  } else {
    throw std::invalid_argument("unknown deepseek2 preset '" + preset + "' (tiny, small, deepseek-v2-lite)");
  }
  c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  return c;
}
}  // namespace

HfConfig preset_config(const std::string& arch, const std::string& preset) {
  if (arch == "qwen3moe") return qwen3moe_preset(preset);
  if (arch == "deepseek2") return deepseek2_preset(preset);
  if (arch != "llama" && arch != "qwen3") throw std::invalid_argument("unknown arch '" + arch + "' (llama, qwen3, qwen3moe, deepseek2)");
  HfConfig c;
  c.arch = arch;
  c.torch_dtype = "float32";
  const bool llama = arch == "llama";
  if (preset == "tiny") {
    // head_dim 64 so the quantized-cache Hadamard rotation path is exercised even in CI.
    c.hidden_size = 128; c.num_layers = 2; c.num_heads = 4; c.num_kv_heads = 2; c.head_dim = 64;
    c.intermediate_size = 384; c.max_position_embeddings = 32768;
    c.rope_theta = llama ? 500000.0 : 1000000.0;
    c.rms_norm_eps = llama ? 1e-5 : 1e-6;
  } else if (preset == "small") {
    c.hidden_size = 768; c.num_layers = 12; c.num_heads = 6; c.num_kv_heads = 2; c.head_dim = 128;
    c.intermediate_size = 2048; c.max_position_embeddings = 131072;
    c.rope_theta = llama ? 500000.0 : 1000000.0;
    c.rms_norm_eps = llama ? 1e-5 : 1e-6;
  } else if (preset == "8b") {
    if (llama) {  // Llama-3.1-8B
      c.hidden_size = 4096; c.num_layers = 32; c.num_heads = 32; c.num_kv_heads = 8; c.head_dim = 128;
      c.intermediate_size = 14336; c.max_position_embeddings = 131072; c.rope_theta = 500000.0; c.rms_norm_eps = 1e-5;
      c.rope_scaling.type = RopeScalingType::Llama3; c.rope_scaling.factor = 8.0;
      c.rope_scaling.low_freq_factor = 1.0; c.rope_scaling.high_freq_factor = 4.0;
      c.rope_scaling.original_max_position_embeddings = 8192;
    } else {  // Qwen3-8B
      c.hidden_size = 4096; c.num_layers = 36; c.num_heads = 32; c.num_kv_heads = 8; c.head_dim = 128;
      c.intermediate_size = 12288; c.max_position_embeddings = 40960; c.rope_theta = 1000000.0; c.rms_norm_eps = 1e-6;
    }
  } else {
    throw std::invalid_argument("unknown preset '" + preset + "' (tiny, small, 8b)");
  }
  return c;
}

}  // namespace pdb
