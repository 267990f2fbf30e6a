// DeepSeek-V4's shapes as llama.cpp's `deepseek4` reads them (../shared/reference/llama-cpp-deepseek4.md §1,
// checked against the running llama-server by tests/deepseek4_state_test.cpp). Configs as data: `tiny` and
// `tiny-hca` are the CPU tests' models (layers of every kind: ratio 0, 4 (CSA + lightning indexer) and 128 (HCA),
// one hash-routed layer); `v4-flash` the real model's shapes.
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pdb {

struct Deepseek4Config {
  int64_t hidden = 0, layers = 0, heads = 0, head_dim = 0, rope_dims = 0, q_lora = 0;
  int64_t window = 0;                      // sliding window W of the raw K rows
  int64_t out_groups = 0, out_lora = 0;    // grouped output LoRA
  int64_t index_heads = 0, index_dim = 0, index_top_k = 0;
  int64_t experts = 0, experts_used = 0, shared_experts = 0, expert_ff = 0, hash_layers = 0;
  float swiglu_clamp = 10.0f, rms_eps = 1e-6f, hc_eps = 1e-6f, expert_scale = 1.0f;
  int64_t hc_streams = 4, hc_iterations = 2;
  float rope_base = 10000.0f, compress_rope_base = 160000.0f;
  // YaRN on the compressed layers' RoPE (ratio 4 and 128; ratio-0 layers are plain): factor 0 = none.
  float yarn_factor = 0.0f;
  int64_t yarn_orig_ctx = 0;
  std::vector<int32_t> compress_ratios;    // per layer: 0, 4 or 128
  int64_t vocab = 0, context = 16384;

  static Deepseek4Config preset(const std::string& name) {
    Deepseek4Config c;
    if (name == "v4-flash") {  // DeepSeek-V4-Flash's config.json (../shared/reference/llama-cpp-deepseek4.md section 9)
      c.hidden = 4096; c.layers = 43; c.heads = 64; c.head_dim = 512; c.rope_dims = 64; c.q_lora = 1024;
      c.window = 128; c.out_groups = 8; c.out_lora = 1024;
      c.index_heads = 64; c.index_dim = 128; c.index_top_k = 512;
      c.experts = 256; c.experts_used = 6; c.shared_experts = 1; c.expert_ff = 2048; c.hash_layers = 3;
      c.expert_scale = 1.5f; c.hc_iterations = 20; c.yarn_factor = 16.0f; c.yarn_orig_ctx = 65536; c.context = 1048576;
      c.compress_ratios = {0, 0};
      for (int i = 0; i < 20; ++i) { c.compress_ratios.push_back(4); c.compress_ratios.push_back(128); }
      c.compress_ratios.push_back(4);
      return c;
    }
    if (name != "tiny" && name != "tiny-hca") throw std::invalid_argument("unknown deepseek4 preset '" + name + "' (tiny, tiny-hca, v4-flash)");
    c.hidden = 256; c.layers = 4; c.heads = 4; c.head_dim = 64; c.rope_dims = 32; c.q_lora = 64;
    c.window = 128; c.out_groups = 2; c.out_lora = 32;
    c.index_heads = 4; c.index_dim = 128; c.index_top_k = 8;  // index_dim != head_dim: only the indexer's rows are always rotated
    c.experts = 4; c.experts_used = 2; c.shared_experts = 1; c.expert_ff = 128; c.hash_layers = 1;
    // Layer 0 sees the decoder's own embedding, so its sections are checked exactly: `tiny` puts a ratio-4 layer
    // there (window, CSA, LID, rings), `tiny-hca` a ratio-128 one; both have every kind somewhere. `tiny-hca` has
    // YaRN on its compressed layers with a short original context, so that prompts of a few hundred tokens
    // reach the ramp's interpolated frequencies.
    c.compress_ratios = name == "tiny" ? std::vector<int32_t>{4, 128, 0, 4} : std::vector<int32_t>{128, 4, 0, 4};
    if (name == "tiny-hca") { c.yarn_factor = 4.0f; c.yarn_orig_ctx = 256; }
    return c;
  }
};

// Every field that makes two DeepSeek-V4 configs compute different models (the checkpoint's against the decoder
// GGUF's): "name: a vs b" for each that differs.
inline std::vector<std::string> deepseek4_config_differences(const Deepseek4Config& a, const Deepseek4Config& b) {
  std::vector<std::string> out;
  auto i = [&](const char* n, int64_t x, int64_t y) { if (x != y) out.push_back(std::string(n) + ": " + std::to_string(x) + " vs " + std::to_string(y)); };
  auto f = [&](const char* n, float x, float y) {
    if (std::fabs(x - y) > 1e-6f * std::max(1.0f, std::fabs(x))) out.push_back(std::string(n) + ": " + std::to_string(x) + " vs " + std::to_string(y));
  };
  i("hidden_size", a.hidden, b.hidden); i("layers", a.layers, b.layers); i("heads", a.heads, b.heads); i("head_dim", a.head_dim, b.head_dim);
  i("rope dims", a.rope_dims, b.rope_dims); i("q_lora_rank", a.q_lora, b.q_lora); i("sliding_window", a.window, b.window);
  i("o_groups", a.out_groups, b.out_groups); i("o_lora_rank", a.out_lora, b.out_lora); i("index_n_heads", a.index_heads, b.index_heads);
  i("index_head_dim", a.index_dim, b.index_dim); i("index_topk", a.index_top_k, b.index_top_k); i("experts", a.experts, b.experts);
  i("experts per token", a.experts_used, b.experts_used); i("shared experts", a.shared_experts, b.shared_experts);
  i("expert width", a.expert_ff, b.expert_ff); i("hash layers", a.hash_layers, b.hash_layers); i("hc streams", a.hc_streams, b.hc_streams);
  i("sinkhorn iterations", a.hc_iterations, b.hc_iterations); i("vocab", a.vocab, b.vocab);
  i("yarn original context", a.yarn_orig_ctx, b.yarn_orig_ctx);
  f("swiglu limit", a.swiglu_clamp, b.swiglu_clamp); f("rms_norm_eps", a.rms_eps, b.rms_eps); f("hc_eps", a.hc_eps, b.hc_eps);
  f("routed scaling", a.expert_scale, b.expert_scale); f("rope_theta", a.rope_base, b.rope_base);
  f("compress_rope_theta", a.compress_rope_base, b.compress_rope_base); f("yarn factor", a.yarn_factor, b.yarn_factor);
  if (a.compress_ratios != b.compress_ratios) out.push_back("compress_ratios differ");
  return out;
}

}  // namespace pdb
