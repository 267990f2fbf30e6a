// DeepSeek-V4's shapes as llama.cpp's `deepseek4` reads them (../shared/reference/llama-cpp-deepseek4.md §1,
// checked against the running llama-server by tests/deepseek4_state_test.cpp). Configs as data: `tiny` and
// `tiny-hca` are the CPU tests' models (layers of every kind: ratio 0, 4 (CSA + lightning indexer) and 128 (HCA),
// one hash-routed layer).
#pragma once
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
  std::vector<int32_t> compress_ratios;    // per layer: 0, 4 or 128
  int64_t vocab = 0, context = 16384;

  static Deepseek4Config preset(const std::string& name) {
    Deepseek4Config c;
    if (name != "tiny" && name != "tiny-hca") throw std::invalid_argument("unknown deepseek4 preset '" + name + "' (tiny, tiny-hca)");
    c.hidden = 256; c.layers = 4; c.heads = 4; c.head_dim = 64; c.rope_dims = 32; c.q_lora = 64;
    c.window = 128; c.out_groups = 2; c.out_lora = 32;
    c.index_heads = 4; c.index_dim = 128; c.index_top_k = 8;  // index_dim != head_dim: only the indexer's rows are always rotated
    c.experts = 4; c.experts_used = 2; c.shared_experts = 1; c.expert_ff = 128; c.hash_layers = 1;
    // Layer 0 sees the decoder's own embedding, so its sections are checked exactly: `tiny` puts a ratio-4 layer
    // there (window, CSA, LID, rings), `tiny-hca` a ratio-128 one; both have every kind somewhere.
    c.compress_ratios = name == "tiny" ? std::vector<int32_t>{4, 128, 0, 4} : std::vector<int32_t>{128, 4, 0, 4};
    return c;
  }
};

}  // namespace pdb
