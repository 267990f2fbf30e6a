// make-model for llama.cpp's `deepseek4` (DeepSeek-V4): random weights at the preset's shapes written as the
// decoder GGUF llama-server loads (keys and tensors as src/models/deepseek4.cpp reads them). The HF checkpoint
// in the official FP8/FP4 layout and `pdbridge convert` for it are not written yet (issue 19): this GGUF is what
// the state-file and restore tests need from the decoder side.
#include <cmath>
#include <random>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include "formats/gguf.h"
#include "formats/hf_to_gguf.h"
#include "model/deepseek4_config.h"
#include "tools/make_model.h"

namespace pdb {
namespace {

// Deterministic per tensor: the same seed and name give the same values whatever the order of writing.
GgufWriter::Producer normal(uint64_t seed, const std::string& name, float mean, float sd) {
  return [=](uint8_t* dst, size_t n_bytes) {
    std::mt19937_64 g(seed ^ XXH3_64bits(name.data(), name.size()));
    std::normal_distribution<float> d(mean, sd);
    auto* f = reinterpret_cast<float*>(dst);
    for (size_t i = 0; i < n_bytes / 4; ++i) f[i] = sd > 0 ? d(g) : mean;
  };
}

}  // namespace

void make_deepseek4_model(const MakeModelOptions& o, const std::string& vocab_gguf) {
  Deepseek4Config c = Deepseek4Config::preset(o.preset);
  if (o.layers > 0) {
    if (o.layers > int64_t(c.compress_ratios.size())) throw std::invalid_argument("--layers: the preset has fewer compress ratios");
    c.layers = o.layers;
    c.compress_ratios.resize(size_t(o.layers));
  }
  if (o.context_length > 0) c.context = o.context_length;
  c.vocab = vocab_size_of(vocab_gguf);
  const std::string a = "deepseek4";
  GgufWriter w;
  w.set("general.architecture", GgufValue::of_str(a));
  w.set("general.name", GgufValue::of_str("pdbridge-deepseek4-" + o.preset));
  auto u32 = [&](const std::string& k, int64_t v) { w.set(a + "." + k, GgufValue::of_u32(uint32_t(v))); };
  auto f32 = [&](const std::string& k, float v) { w.set(a + "." + k, GgufValue::of_f32(v)); };
  u32("context_length", c.context);
  u32("embedding_length", c.hidden);
  u32("block_count", c.layers);
  u32("expert_count", c.experts);
  u32("expert_used_count", c.experts_used);
  u32("attention.head_count", c.heads);
  u32("attention.head_count_kv", 1);
  u32("attention.key_length", c.head_dim);
  u32("attention.value_length", c.head_dim);
  u32("rope.dimension_count", c.rope_dims);
  f32("rope.freq_base", c.rope_base);
  f32("attention.layer_norm_rms_epsilon", c.rms_eps);
  u32("attention.q_lora_rank", c.q_lora);
  u32("attention.sliding_window", c.window);
  u32("expert_feed_forward_length", c.expert_ff);
  u32("expert_shared_count", c.shared_experts);
  f32("expert_weights_scale", c.expert_scale);
  w.set(a + ".expert_weights_norm", GgufValue::of_bool(true));
  f32("swiglu_clamp_exp", c.swiglu_clamp);
  u32("attention.indexer.head_count", c.index_heads);
  u32("attention.indexer.key_length", c.index_dim);
  u32("attention.indexer.top_k", c.index_top_k);
  u32("attention.output_group_count", c.out_groups);
  u32("attention.output_lora_rank", c.out_lora);
  f32("attention.compress_rope_freq_base", c.compress_rope_base);
  u32("hyper_connection.count", c.hc_streams);
  u32("hyper_connection.sinkhorn_iterations", c.hc_iterations);
  f32("hyper_connection.epsilon", c.hc_eps);
  u32("hash_layer_count", c.hash_layers);
  std::vector<GgufValue> ratios;
  for (int32_t r : c.compress_ratios) ratios.push_back(GgufValue::of_u32(uint32_t(r)));
  w.set(a + ".attention.compress_ratios", GgufValue::of_array(GgufType::U32, ratios));
  u32("expert_gating_func", 4);  // sqrt-softplus
  {
    auto vocab = GgufFile::open(vocab_gguf);
    for (const auto& [k, v] : vocab->kv())
      if (k.rfind("tokenizer.", 0) == 0) w.set(k, v);
  }
  const uint64_t seed = o.seed;
  const int64_t E = c.hidden, V = c.vocab, hc = c.hc_streams, mix = (2 + hc) * hc, D = c.head_dim, I = c.index_dim;
  // 2-D weights {in, out}: N(0, 1/sqrt(in)) keeps every product O(1); norms 1; the hyper-connection mixes O(1).
  auto matrix = [&](const std::string& n, int64_t in, std::vector<int64_t> ne) {
    w.add_tensor(n, GgmlType::F32, ne, normal(seed, n, 0.0f, 1.0f / std::sqrt(float(in))));
  };
  auto ones = [&](const std::string& n, int64_t len) { w.add_tensor(n, GgmlType::F32, {len}, normal(seed, n, 1.0f, 0.0f)); };
  auto small = [&](const std::string& n, std::vector<int64_t> ne, float mean, float sd) { w.add_tensor(n, GgmlType::F32, ne, normal(seed, n, mean, sd)); };
  matrix("token_embd.weight", 1, {E, V});
  ones("output_norm.weight", E);
  matrix("output.weight", E, {E, V});
  matrix("output_hc_fn.weight", hc * E, {hc * E, hc});
  small("output_hc_base.weight", {hc}, 0.0f, 0.5f);
  small("output_hc_scale.weight", {1}, 1.0f, 0.0f);
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    const int64_t ratio = c.compress_ratios[size_t(l)];
    ones(p + "attn_norm.weight", E);
    small(p + "attn_sinks.weight", {c.heads}, 0.0f, 0.5f);
    matrix(p + "attn_q_a.weight", E, {E, c.q_lora});
    ones(p + "attn_q_a_norm.weight", c.q_lora);
    matrix(p + "attn_q_b.weight", c.q_lora, {c.q_lora, c.heads * D});
    matrix(p + "attn_kv.weight", E, {E, D});
    ones(p + "attn_kv_a_norm.weight", D);
    matrix(p + "attn_output_a.weight", c.heads * D / c.out_groups, {c.heads * D / c.out_groups, c.out_lora * c.out_groups});
    matrix(p + "attn_output_b.weight", c.out_groups * c.out_lora, {c.out_groups * c.out_lora, E});
    for (const char* k : {"attn", "ffn"}) {
      matrix(p + fmt::format("hc_{}_fn.weight", k), hc * E, {hc * E, mix});
      small(p + fmt::format("hc_{}_base.weight", k), {mix}, 0.0f, 0.5f);
      small(p + fmt::format("hc_{}_scale.weight", k), {3}, 1.0f, 0.0f);
    }
    if (ratio != 0) {
      const int64_t coff = ratio == 4 ? 2 : 1;
      matrix(p + "attn_compressor_kv.weight", E, {E, coff * D});
      matrix(p + "attn_compressor_gate.weight", E, {E, coff * D});
      small(p + "attn_compressor_ape.weight", {coff * D, ratio}, 0.0f, 0.1f);
      ones(p + "attn_compressor_norm.weight", D);
      if (ratio == 4) {
        matrix(p + "indexer.proj.weight", E, {E, c.index_heads});
        matrix(p + "indexer.attn_q_b.weight", c.q_lora, {c.q_lora, c.index_heads * I});
        matrix(p + "indexer_compressor_kv.weight", E, {E, 2 * I});
        matrix(p + "indexer_compressor_gate.weight", E, {E, 2 * I});
        small(p + "indexer_compressor_ape.weight", {2 * I, 4}, 0.0f, 0.1f);
        ones(p + "indexer_compressor_norm.weight", I);
      }
    }
    matrix(p + "ffn_gate_inp.weight", E, {E, c.experts});
    if (l < c.hash_layers) {
      const std::string n = p + "ffn_gate_tid2eid.weight";
      const int64_t NE = c.experts, k = c.experts_used;
      w.add_tensor(n, GgmlType::I32, {k, V}, [=](uint8_t* dst, size_t n_bytes) {
        std::mt19937_64 g(seed ^ XXH3_64bits(n.data(), n.size()));
        auto* e = reinterpret_cast<int32_t*>(dst);
        for (size_t t = 0; t < n_bytes / 4 / size_t(k); ++t)  // k distinct experts per token
          for (int64_t j = 0; j < k; ++j) e[t * size_t(k) + size_t(j)] = int32_t((int64_t(g() % uint64_t(NE)) + j) % NE);
      });
    } else {
      small(p + "exp_probs_b.bias", {c.experts}, 0.0f, 0.0f);
    }
    ones(p + "ffn_norm.weight", E);
    matrix(p + "ffn_gate_exps.weight", E, {E, c.expert_ff, c.experts});
    matrix(p + "ffn_up_exps.weight", E, {E, c.expert_ff, c.experts});
    matrix(p + "ffn_down_exps.weight", c.expert_ff, {c.expert_ff, E, c.experts});
    matrix(p + "ffn_gate_shexp.weight", E, {E, c.expert_ff * c.shared_experts});
    matrix(p + "ffn_up_shexp.weight", E, {E, c.expert_ff * c.shared_experts});
    matrix(p + "ffn_down_shexp.weight", c.expert_ff * c.shared_experts, {c.expert_ff * c.shared_experts, E});
  }
  const std::string path = o.out + "/decoder-f32.gguf";
  w.write(path);
  spdlog::info("make-model: deepseek4 {} seed {} -> {} (decoder GGUF only; the HF checkpoint is not written for deepseek4 yet)", o.preset,
               o.seed, path);
}

}  // namespace pdb
