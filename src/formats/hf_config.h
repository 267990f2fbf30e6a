// Hugging Face config.json for the architectures we prefill: llama, qwen3 (dense), qwen3moe and deepseek2
// (Qwen3MoeForCausalLM: qwen3's attention, a routed mixture-of-experts FFN in every layer).
#pragma once
#include <cstdint>
#include <optional>
#include <vector>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace pdb {

enum class RopeScalingType { None, Linear, Yarn, Llama3 };
const char* rope_scaling_name(RopeScalingType t);

struct RopeScaling {
  RopeScalingType type = RopeScalingType::None;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  double beta_fast = 32.0, beta_slow = 1.0;               // yarn
  std::optional<double> attention_factor;                  // yarn: default 0.1*ln(factor)+1
  double mscale = 0, mscale_all_dim = 0;                   // deepseek yarn (0: absent)
  // llama3 read from a GGUF: its rope_freqs (the divisors of each pair's frequency, f32 as the decoder uses them)
  // stand for factor / low / high / original context, which the GGUF does not keep.
  std::vector<float> freq_factors;
};

struct HfConfig {
  std::string arch;  // llama.cpp's name, from model_type: llama, qwen3, qwen3moe, deepseek2 (the engines' definitions/)
  int64_t hidden_size = 0, intermediate_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0;
  int64_t head_dim = 0, vocab_size = 0, max_position_embeddings = 0;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0;
  bool tie_word_embeddings = false, attention_bias = false;
  std::string torch_dtype = "float32";
  RopeScaling rope_scaling;
  // Mixture of experts (qwen3moe): routed experts, how many each token uses, each expert's FFN width,
  // and the checkpoint's norm_topk_prob (llama.cpp renormalizes the selected weights whatever it says).
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate_size = 0;
  bool norm_topk_prob = true;
  bool moe() const { return num_experts > 0; }
  // deepseek2 (DeepseekV2ForCausalLM): multi-head latent attention and shared experts. head_dim is
  // then qk_nope + qk_rope (the score width); the cache row is kv_lora_rank + qk_rope wide.
  int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  int64_t n_shared_experts = 0, first_k_dense_replace = 0;
  double routed_scaling_factor = 1.0;
  // Expert groups (1 group: plain top-k); 0 when config.json omits them. Written to the GGUF as llama.cpp's
  // converter writes them, for the loader's n_expert_groups / n_group_used.
  int64_t n_group = 0, topk_group = 0;
  bool mla() const { return kv_lora_rank > 0; }
  // Block-FP8 checkpoints: quantization_config {quant_method: fp8, weight_block_size: [128, 128]}.
  bool fp8 = false;
  int64_t fp8_block_rows = 128, fp8_block_cols = 128;

  static HfConfig parse(const nlohmann::json& j);  // throws std::runtime_error naming the bad field
  static HfConfig load(const std::string& dir);    // dir/config.json
  nlohmann::json to_json() const;
  // Per-dimension-pair inverse frequencies as HF computes them (for the prefill engine's own RoPE).
  std::vector<double> inv_freq() const;
  double attention_scaling() const;  // cos/sin multiplier (yarn), 1 otherwise
};

}  // namespace pdb
