#include "formats/hf_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numbers>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace pdb {
using json = nlohmann::json;

const char* rope_scaling_name(RopeScalingType t) {
  switch (t) {
    case RopeScalingType::None: return "none";
    case RopeScalingType::Linear: return "linear";
    case RopeScalingType::Yarn: return "yarn";
    case RopeScalingType::Llama3: return "llama3";
  }
  return "?";
}

namespace {
[[noreturn]] void bad(const std::string& why) { throw std::runtime_error("config.json: " + why); }

int64_t req_int(const json& j, const char* k) {
  if (!j.contains(k) || !j[k].is_number_integer()) bad(fmt::format("'{}' must be an integer", k));
  const int64_t v = j[k].get<int64_t>();
  if (v <= 0) bad(fmt::format("'{}' must be positive, got {}", k, v));
  return v;
}
double num(const json& j, const char* k, double dflt) {
  if (!j.contains(k) || j[k].is_null()) return dflt;
  if (!j[k].is_number()) bad(fmt::format("'{}' must be a number", k));
  return j[k].get<double>();
}
}  // namespace

namespace {
// DeepSeek-V2's MLA widths and routing; what llama.cpp's deepseek2 cannot run is refused here.
void parse_deepseek2(const json& j, HfConfig& c) {
  c.q_lora_rank = j.contains("q_lora_rank") && !j["q_lora_rank"].is_null() ? req_int(j, "q_lora_rank") : 0;
  c.kv_lora_rank = req_int(j, "kv_lora_rank");
  c.qk_nope_head_dim = req_int(j, "qk_nope_head_dim");
  c.qk_rope_head_dim = req_int(j, "qk_rope_head_dim");
  c.v_head_dim = req_int(j, "v_head_dim");
  if (c.qk_rope_head_dim % 2) bad("qk_rope_head_dim must be even");
  c.num_experts = req_int(j, "n_routed_experts");
  c.num_experts_per_tok = req_int(j, "num_experts_per_tok");
  c.moe_intermediate_size = req_int(j, "moe_intermediate_size");
  c.n_shared_experts = req_int(j, "n_shared_experts");
  c.first_k_dense_replace = j.value("first_k_dense_replace", int64_t(0));
  c.norm_topk_prob = j.value("norm_topk_prob", false);
  c.routed_scaling_factor = num(j, "routed_scaling_factor", 1.0);
  if (j.value("scoring_func", std::string("softmax")) != "softmax") bad("scoring_func other than softmax (DeepSeek-V3's sigmoid) is not supported");
  if (j.value("n_group", int64_t(1)) > 1 && j.value("topk_group", int64_t(1)) < j.value("n_group", int64_t(1)))
    bad("group-limited routing (n_group > 1) is not supported: llama.cpp's rule differs from DeepSeek-V2's");
  if (j.value("moe_layer_freq", int64_t(1)) != 1) bad("moe_layer_freq != 1 is not what llama.cpp's deepseek2 runs");
  c.n_group = j.value("n_group", int64_t(0));
  c.topk_group = j.value("topk_group", int64_t(0));
}

void parse_qwen3moe(const json& j, HfConfig& c) {
  c.num_experts = req_int(j, "num_experts");
  c.num_experts_per_tok = req_int(j, "num_experts_per_tok");
  c.moe_intermediate_size = req_int(j, "moe_intermediate_size");
  if (c.num_experts_per_tok > c.num_experts) bad(fmt::format("num_experts_per_tok {} exceeds num_experts {}", c.num_experts_per_tok, c.num_experts));
  // Kept for the record only: llama.cpp's qwen3moe always renormalizes the top-k weights
  // (src/models/qwen3moe.cpp), and the engine computes what the decoder computes.
  c.norm_topk_prob = j.value("norm_topk_prob", false);
  // Dense layers between MoE layers have no experts to convert: llama.cpp's qwen3moe cannot load them.
  if (j.value("decoder_sparse_step", int64_t(1)) != 1) bad("decoder_sparse_step != 1 (dense layers between MoE layers) is not what llama.cpp's qwen3moe runs");
  if (j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array() && !j["mlp_only_layers"].empty())
    bad("mlp_only_layers is not empty: llama.cpp's qwen3moe runs every layer as MoE");
}

// Needs c.max_position_embeddings: the default of original_max_position_embeddings.
void parse_rope_scaling(const json& rs, HfConfig& c) {
  if (!rs.is_object()) bad("rope_scaling must be an object or null");
  std::string t = rs.value("rope_type", rs.value("type", "default"));
  auto& s = c.rope_scaling;
  if (t == "default") s.type = RopeScalingType::None;
  else if (t == "linear") s.type = RopeScalingType::Linear;
  else if (t == "yarn") s.type = RopeScalingType::Yarn;
  else if (t == "llama3") s.type = RopeScalingType::Llama3;
  else bad(fmt::format("rope_scaling type '{}' is not supported (default, linear, yarn, llama3)", t));
  s.factor = num(rs, "factor", 1.0);
  if (s.type != RopeScalingType::None && !(s.factor >= 1.0)) bad(fmt::format("rope_scaling.factor {} must be >= 1", s.factor));
  s.original_max_position_embeddings = int64_t(num(rs, "original_max_position_embeddings", double(c.max_position_embeddings)));
  s.low_freq_factor = num(rs, "low_freq_factor", 1.0);
  s.high_freq_factor = num(rs, "high_freq_factor", 4.0);
  s.beta_fast = num(rs, "beta_fast", 32.0);
  s.beta_slow = num(rs, "beta_slow", 1.0);
  if (rs.contains("attention_factor") && !rs["attention_factor"].is_null()) s.attention_factor = num(rs, "attention_factor", 1.0);
  s.mscale = num(rs, "mscale", 0.0);
  s.mscale_all_dim = num(rs, "mscale_all_dim", 0.0);
}

void parse_quantization(const json& q, HfConfig& c) {
  if (q.value("quant_method", "") != "fp8") bad(fmt::format("quantization_config.quant_method '{}' is not supported (fp8)", q.value("quant_method", "")));
  c.fp8 = true;
  if (q.contains("weight_block_size")) {
    const json& b = q["weight_block_size"];
    if (!b.is_array() || b.size() != 2) bad("weight_block_size must be [rows, cols]");
    c.fp8_block_rows = b[0].get<int64_t>();
    c.fp8_block_cols = b[1].get<int64_t>();
  }
}
}  // namespace

HfConfig HfConfig::parse(const json& j) {
  if (!j.is_object()) bad("not a JSON object");
  HfConfig c;
  const std::string mt = j.value("model_type", "");
  if (mt == "llama") c.arch = "llama";
  else if (mt == "qwen3") c.arch = "qwen3";
  else if (mt == "qwen3_moe") c.arch = "qwen3moe";
  else if (mt == "deepseek_v2") c.arch = "deepseek2";
  else bad(fmt::format("model_type '{}' is not supported (llama, qwen3, qwen3_moe, deepseek_v2)", mt));
  c.hidden_size = req_int(j, "hidden_size");
  // A MoE checkpoint's intermediate_size is the unused dense width (Qwen3-30B-A3B: 6144); optional there.
  c.intermediate_size = c.arch == "qwen3moe" && !j.contains("intermediate_size") ? 0 : req_int(j, "intermediate_size");
  if (c.arch == "deepseek2") parse_deepseek2(j, c);
  if (c.arch == "qwen3moe") parse_qwen3moe(j, c);
  c.num_layers = req_int(j, "num_hidden_layers");
  c.num_heads = req_int(j, "num_attention_heads");
  c.num_kv_heads = j.contains("num_key_value_heads") ? req_int(j, "num_key_value_heads") : c.num_heads;
  c.vocab_size = req_int(j, "vocab_size");
  c.max_position_embeddings = j.contains("max_position_embeddings") ? req_int(j, "max_position_embeddings") : 4096;
  if (c.arch == "deepseek2") c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  else if (j.contains("head_dim") && !j["head_dim"].is_null()) c.head_dim = req_int(j, "head_dim");
  else {
    if (c.hidden_size % c.num_heads) bad("hidden_size is not a multiple of num_attention_heads and head_dim is absent");
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.num_heads % c.num_kv_heads) bad("num_attention_heads is not a multiple of num_key_value_heads");
  c.rms_norm_eps = num(j, "rms_norm_eps", 1e-6);
  c.rope_theta = num(j, "rope_theta", 10000.0);
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.attention_bias = j.value("attention_bias", false);
  c.torch_dtype = j.value("torch_dtype", "float32");
  // transformers 5 re-saves call it rope_parameters
  const char* rs_key = j.contains("rope_scaling") && !j["rope_scaling"].is_null() ? "rope_scaling" : "rope_parameters";
  if (j.contains(rs_key) && !j[rs_key].is_null()) parse_rope_scaling(j[rs_key], c);
  if (j.contains("quantization_config") && !j["quantization_config"].is_null()) parse_quantization(j["quantization_config"], c);
  return c;
}

HfConfig HfConfig::load(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  json j;
  try { j = json::parse(in); } catch (const std::exception& e) { throw std::runtime_error(path + ": " + e.what()); }
  return parse(j);
}

json HfConfig::to_json() const {
  json j;
  j["architectures"] = {arch == "llama" ? "LlamaForCausalLM" : arch == "qwen3" ? "Qwen3ForCausalLM"
                        : arch == "qwen3moe" ? "Qwen3MoeForCausalLM" : "DeepseekV2ForCausalLM"};
  j["model_type"] = arch == "qwen3moe" ? "qwen3_moe" : arch == "deepseek2" ? "deepseek_v2" : arch;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  if (moe()) {
    j[arch == "deepseek2" ? "n_routed_experts" : "num_experts"] = num_experts;
    j.update({{"num_experts_per_tok", num_experts_per_tok}, {"moe_intermediate_size", moe_intermediate_size}, {"norm_topk_prob", norm_topk_prob}});
  }
  if (arch == "deepseek2")
    j.update({{"q_lora_rank", q_lora_rank ? json(q_lora_rank) : json(nullptr)}, {"kv_lora_rank", kv_lora_rank},
              {"qk_nope_head_dim", qk_nope_head_dim}, {"qk_rope_head_dim", qk_rope_head_dim}, {"v_head_dim", v_head_dim},
              {"n_shared_experts", n_shared_experts}, {"first_k_dense_replace", first_k_dense_replace}, {"moe_layer_freq", 1},
              {"routed_scaling_factor", routed_scaling_factor}, {"scoring_func", "softmax"}, {"topk_method", "greedy"},
              {"n_group", n_group ? n_group : 1}, {"topk_group", topk_group ? topk_group : 1}});
  else if (moe())
    j.update({{"decoder_sparse_step", 1}, {"mlp_only_layers", json::array()}});
  j["num_hidden_layers"] = num_layers;
  j["num_attention_heads"] = num_heads;
  j["num_key_value_heads"] = num_kv_heads;
  if (arch != "deepseek2") j["head_dim"] = head_dim;  // deepseek's config derives it from the MLA dims
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["attention_bias"] = attention_bias;
  j["hidden_act"] = "silu";
  j["torch_dtype"] = torch_dtype;
  if (rope_scaling.type == RopeScalingType::None) j["rope_scaling"] = nullptr;
  else {
    json rs = {{"rope_type", rope_scaling_name(rope_scaling.type)}, {"factor", rope_scaling.factor},
               {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
    if (rope_scaling.type == RopeScalingType::Llama3) { rs["low_freq_factor"] = rope_scaling.low_freq_factor; rs["high_freq_factor"] = rope_scaling.high_freq_factor; }
    if (rope_scaling.type == RopeScalingType::Yarn) { rs["beta_fast"] = rope_scaling.beta_fast; rs["beta_slow"] = rope_scaling.beta_slow; }
    if (rope_scaling.mscale) rs["mscale"] = rope_scaling.mscale;
    if (rope_scaling.mscale_all_dim) rs["mscale_all_dim"] = rope_scaling.mscale_all_dim;
    j["rope_scaling"] = rs;
  }
  if (fp8) j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {fp8_block_rows, fp8_block_cols}}};
  return j;
}

std::vector<double> HfConfig::inv_freq() const {
  const int64_t half = head_dim / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) f[i] = 1.0 / std::pow(rope_theta, double(2 * i) / double(head_dim));
  const auto& s = rope_scaling;
  switch (s.type) {
    case RopeScalingType::None: break;
    case RopeScalingType::Linear: for (auto& x : f) x /= s.factor; break;
    case RopeScalingType::Llama3: {
      if (!s.freq_factors.empty()) {
        if (int64_t(s.freq_factors.size()) != half) throw std::runtime_error("rope_freqs: one factor per rotated pair expected");
        for (int64_t i = 0; i < half; ++i) f[size_t(i)] /= double(s.freq_factors[size_t(i)]);
        break;
      }
      const double old_ctx = double(s.original_max_position_embeddings);
      const double low_wl = old_ctx / s.low_freq_factor, high_wl = old_ctx / s.high_freq_factor;
      for (auto& x : f) {
        const double wl = 2 * std::numbers::pi / x;
        if (wl < high_wl) continue;
        if (wl > low_wl) { x /= s.factor; continue; }
        const double smooth = (old_ctx / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        x = (1 - smooth) * x / s.factor + smooth * x;
      }
      break;
    }
    case RopeScalingType::Yarn: {
      const double d = double(head_dim), base = rope_theta, octx = double(s.original_max_position_embeddings);
      auto corr_dim = [&](double rot) { return d * std::log(octx / (rot * 2 * std::numbers::pi)) / (2 * std::log(base)); };
      double low = std::max(0.0, std::floor(corr_dim(s.beta_fast)));
      double high = std::min(d - 1, std::ceil(corr_dim(s.beta_slow)));
      if (low == high) high += 0.001;
      for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
        const double extrap_mask = 1 - ramp;
        const double interp = f[i] / s.factor, extrap = f[i];
        f[i] = interp * (1 - extrap_mask) + extrap * extrap_mask;
      }
      break;
    }
  }
  return f;
}

double HfConfig::attention_scaling() const {
  if (rope_scaling.type != RopeScalingType::Yarn) return 1.0;
  if (rope_scaling.attention_factor) return *rope_scaling.attention_factor;
  return rope_scaling.factor <= 1 ? 1.0 : 0.1 * std::log(rope_scaling.factor) + 1.0;
}

}  // namespace pdb
