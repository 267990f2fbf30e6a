// The decoder's GGUF as the prefill engine's model: its config from the GGUF's keys, its weights by their HF names
// through llama.cpp's conversion table (formats/hf_to_gguf.h) read backwards, dequantized bit for bit as ggml does
// (formats/ggml_types.h), llama's Q/K rows put back in HF's order (the engines' faithful path permutes them again).
#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/parallel.h"
#include "common/xxhash_fast.h"
#include "formats/ggml_types.h"
#include "formats/gguf.h"
#include "formats/hf_to_gguf.h"
#include "formats/weight_source.h"

namespace pdb {
namespace {

struct Where {
  std::string gguf_name;
  int permute_heads = 0;  // llama's Q/K: the heads whose rows the converter permuted
  int64_t expert = -1;    // a routed expert's slice of a stacked tensor
};

class GgufWeights final : public WeightSource {
 public:
  GgufWeights(std::unique_ptr<GgufFile> g, const HfConfig& c, std::string path) : g_(std::move(g)), path_(std::move(path)) {
    for (const auto& sp : hf_tensor_specs(c)) {
      if (sp.kv_b_part) (sp.kv_b_part == 1 ? kv_b_[sp.derive_from].first : kv_b_[sp.derive_from].second) = sp.gguf_name;
      if (sp.gguf_name.empty() || sp.kv_b_part) continue;
      if (!sp.hf_name.empty()) where_[sp.hf_name] = Where{sp.gguf_name, sp.permute_heads, -1};
      for (size_t e = 0; e < sp.stack.size(); ++e) where_[sp.stack[e]] = Where{sp.gguf_name, 0, int64_t(e)};
    }
  }
  std::vector<float> matrix(const std::string& name, int64_t rows, int64_t cols) const override {
    if (const auto it = kv_b_.find(name); it != kv_b_.end()) return kv_b_proj(it->second.first, it->second.second, rows, cols);
    const Where& w = find(name);
    const GgufTensorInfo& t = shaped(name, w, rows, cols);
    const size_t rb = ggml_row_bytes(t.type, cols);
    const uint8_t* base = g_->data(t) + (w.expert >= 0 ? size_t(w.expert * rows) * rb : 0);
    std::vector<float> out(static_cast<size_t>(rows * cols));
    parallel_for(rows, int(std::max(1u, std::thread::hardware_concurrency())), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) dequantize_row(t.type, base + size_t(r) * rb, out.data() + r * cols, cols);
    });
    if (w.permute_heads) out = hf_row_order(out, w.permute_heads, rows / w.permute_heads, cols);
    return out;
  }
  std::optional<RawRows> raw_rows(const std::string& name, int64_t rows, int64_t cols) const override {
    if (kv_b_.count(name)) return std::nullopt;
    const Where& w = find(name);
    const GgufTensorInfo& t = shaped(name, w, rows, cols);
    const size_t rb = ggml_row_bytes(t.type, cols);
    const uint8_t* base = g_->data(t) + (w.expert >= 0 ? size_t(w.expert * rows) * rb : 0);
    RawRows out{t.type, std::vector<uint8_t>(base, base + size_t(rows) * rb)};
    if (w.permute_heads) out.bytes = hf_row_order(out.bytes, w.permute_heads, rows / w.permute_heads, int64_t(rb));
    return out;
  }
  std::vector<float> vector(const std::string& name, int64_t n) const override {
    const Where& w = find(name);
    const GgufTensorInfo& t = g_->tensor(w.gguf_name);
    if (t.n_elements() != n) throw std::runtime_error(fmt::format("{} ({}): {} elements, expected {}", name, w.gguf_name, t.n_elements(), n));
    return g_->to_f32(t);
  }
  GgmlType storage_type(const std::string& name) const override {
    return kv_b_.count(name) ? GgmlType::F32 : g_->tensor(find(name).gguf_name).type;
  }
  int weight_bits(const std::string& name) const override {
    const GgmlType t = g_->tensor(find(name).gguf_name).type;
    return t == GgmlType::F16 ? 16 : t == GgmlType::BF16 ? 17 : 32;
  }
  std::string describe() const override { return "GGUF " + path_; }
  std::string type_summary() const override {
    std::map<std::string, int> n;
    for (const auto& t : g_->tensors())
      if (t.ne.size() >= 2) ++n[ggml_type_name(t.type)];
    std::string out;
    for (const auto& [name, count] : n) out += fmt::format("{}{} x {}", out.empty() ? "" : ", ", name, count);
    return out;
  }

 private:
  const Where& find(const std::string& name) const {
    const auto it = where_.find(name);
    if (it == where_.end()) throw std::runtime_error(fmt::format("{}: no GGUF tensor holds it", name));
    return it->second;
  }
  // The tensor holding `name`, its shape checked against the model's and its type one pdbridge decodes.
  const GgufTensorInfo& shaped(const std::string& name, const Where& w, int64_t rows, int64_t cols) const {
    const GgufTensorInfo& t = g_->tensor(w.gguf_name);
    const bool stacked = w.expert >= 0;
    if (t.ne.size() != (stacked ? 3u : 2u) || t.ne[0] != cols || t.ne[1] != rows || (stacked && w.expert >= t.ne[2]))
      throw std::runtime_error(fmt::format("{} ({} in the GGUF): shape does not match the model's ({} x {})", name, w.gguf_name, rows, cols));
    if (!can_dequantize(t.type)) throw std::runtime_error(fmt::format("{} has type {}, which pdbridge cannot decode", w.gguf_name, ggml_type_name(t.type)));
    return t;
  }
  // The inverse of the converter's permutation (hf_to_gguf.h permute_qk_rows): hf_row[h*hd + a*hd/2 + i] = gguf_row[h*hd + 2i + a].
  template <class E>
  static std::vector<E> hf_row_order(const std::vector<E>& gguf, int64_t heads, int64_t hd, int64_t cols) {
    std::vector<E> hf(gguf.size());
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < hd / 2; ++i)
        for (int64_t a = 0; a < 2; ++a)
          std::copy_n(gguf.data() + (h * hd + 2 * i + a) * cols, cols, hf.data() + (h * hd + a * hd / 2 + i) * cols);
    return hf;
  }
  // deepseek2's kv_b_proj [heads x (nope + v) x kv_lora] from the converter's halves: attn_k_b [heads x kv_lora x nope]
  // (each head's K part transposed) and attn_v_b [heads x v x kv_lora].
  std::vector<float> kv_b_proj(const std::string& k_name, const std::string& v_name, int64_t rows, int64_t kvl) const {
    const GgufTensorInfo &kt = g_->tensor(k_name), &vt = g_->tensor(v_name);
    if (kt.ne.size() != 3 || vt.ne.size() != 3 || kt.ne[1] != kvl || vt.ne[0] != kvl || kt.ne[2] != vt.ne[2] ||
        kt.ne[2] * (kt.ne[0] + vt.ne[1]) != rows)
      throw std::runtime_error(fmt::format("{} / {}: shapes do not make kv_b_proj ({} x {})", k_name, v_name, rows, kvl));
    const int64_t heads = kt.ne[2], nope = kt.ne[0], vd = vt.ne[1];
    const auto k = g_->to_f32(kt), v = g_->to_f32(vt);
    std::vector<float> out(static_cast<size_t>(rows * kvl));
    for (int64_t h = 0; h < heads; ++h) {
      float* head = out.data() + h * (nope + vd) * kvl;
      for (int64_t r = 0; r < kvl; ++r)
        for (int64_t i = 0; i < nope; ++i) head[i * kvl + r] = k[size_t((h * kvl + r) * nope + i)];
      std::copy_n(v.data() + h * vd * kvl, vd * kvl, head + nope * kvl);
    }
    return out;
  }
  std::unique_ptr<GgufFile> g_;
  std::string path_;
  std::unordered_map<std::string, Where> where_;
  std::unordered_map<std::string, std::pair<std::string, std::string>> kv_b_;  // kv_b_proj -> (attn_k_b, attn_v_b)
};

}  // namespace

namespace {
// deepseek2's MLA, experts and YaRN as llama.cpp's converter writes them (formats/hf_to_gguf.cpp), in HF's terms.
void read_deepseek2(const GgufFile& g, HfConfig& c) {
  const std::string a = c.arch;
  c.q_lora_rank = g.get_int_opt(a + ".attention.q_lora_rank").value_or(0);
  c.kv_lora_rank = g.get_int(a + ".attention.kv_lora_rank");
  c.qk_rope_head_dim = g.get_int(a + ".rope.dimension_count");
  c.head_dim = g.get_int(a + ".attention.key_length_mla");
  c.qk_nope_head_dim = c.head_dim - c.qk_rope_head_dim;
  c.v_head_dim = g.get_int(a + ".attention.value_length_mla");
  c.num_kv_heads = c.num_heads;  // HF's heads (the GGUF's one KV head is the latent row)
  c.n_shared_experts = g.get_int_opt(a + ".expert_shared_count").value_or(0);
  c.first_k_dense_replace = g.get_int_opt(a + ".leading_dense_block_count").value_or(0);
  c.routed_scaling_factor = g.get_float_opt(a + ".expert_weights_scale").value_or(1.0);
  const GgufValue* norm = g.find(a + ".expert_weights_norm");
  c.norm_topk_prob = norm && norm->u != 0;
  c.n_group = g.get_int_opt(a + ".expert_group_count").value_or(0);
  c.topk_group = g.get_int_opt(a + ".expert_group_used_count").value_or(0);
  const GgufValue* type = g.find(a + ".rope.scaling.type");
  if (!type || type->s == "none") return;
  if (type->s != "yarn") throw std::runtime_error(fmt::format("deepseek2 GGUF: RoPE scaling '{}' is not read yet (YaRN or none)", type->s));
  auto& rs = c.rope_scaling;
  rs.type = RopeScalingType::Yarn;
  rs.factor = g.get_float(a + ".rope.scaling.factor");
  rs.original_max_position_embeddings = g.get_int(a + ".rope.scaling.original_context_length");
  rs.beta_fast = g.get_float_opt(a + ".rope.scaling.yarn_beta_fast").value_or(32.0);
  rs.beta_slow = g.get_float_opt(a + ".rope.scaling.yarn_beta_slow").value_or(1.0);
  // The converter stores float(0.1 * mscale_all_dim) (llama.cpp's yarn_log_multiplier). config.json's value is a short
  // decimal: the f32's shortest decimal form, divided by 0.1, gives it back (0.0707f -> 0.707, where 0.0707f / 0.1 would
  // land an ulp below it as a float and change the score scale).
  const float log_mul = float(g.get_float_opt(a + ".rope.scaling.yarn_log_multiplier").value_or(0.0));
  rs.mscale_all_dim = std::stod(fmt::format("{}", log_mul)) / 0.1;
  rs.mscale = rs.mscale_all_dim;
}
}  // namespace

std::vector<std::string> gguf_weight_differences(const GgufFile& a, const GgufFile& b, size_t max) {
  std::vector<std::string> out;
  std::error_code ec;
  if (std::filesystem::equivalent(a.path(), b.path(), ec)) return out;
  auto note = [&](std::string s) { if (out.size() < max) out.push_back(std::move(s)); };
  for (const auto& t : a.tensors()) {
    const GgufTensorInfo* u = b.find_tensor(t.name);
    if (!u) { note(fmt::format("{} is in {} but not in {}", t.name, a.path(), b.path())); continue; }
    if (u->type != t.type || u->ne != t.ne) {
      note(fmt::format("{}: {} [{}] in {} vs {} [{}] in {}", t.name, ggml_type_name(t.type), fmt::join(t.ne, ","), a.path(), ggml_type_name(u->type),
                       fmt::join(u->ne, ","), b.path()));
      continue;
    }
    if (XXH3_64bits(a.data(t), t.n_bytes()) != XXH3_64bits(b.data(*u), u->n_bytes())) note(fmt::format("{}: other weights in {} than in {}", t.name, a.path(), b.path()));
  }
  for (const auto& t : b.tensors())
    if (!a.find_tensor(t.name)) note(fmt::format("{} is in {} but not in {}", t.name, b.path(), a.path()));
  return out;
}

bool is_gguf_path(const std::string& path) { return path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0; }

HfConfig hf_config_from_gguf(const GgufFile& g) {
  const std::string a = g.architecture();
  if (a != "llama" && a != "qwen3" && a != "qwen3moe" && a != "deepseek2")
    throw std::runtime_error(fmt::format("a {} GGUF is not read as the prefill model yet (llama, qwen3, qwen3moe, deepseek2): give its HF checkpoint", a));
  HfConfig c;
  c.arch = a;
  c.num_layers = g.get_int(a + ".block_count");
  c.hidden_size = g.get_int(a + ".embedding_length");
  c.intermediate_size = g.get_int_opt(a + ".feed_forward_length").value_or(0);
  c.num_heads = g.get_int(a + ".attention.head_count");
  c.num_kv_heads = g.get_int_opt(a + ".attention.head_count_kv").value_or(c.num_heads);
  c.head_dim = g.get_int_opt(a + ".attention.key_length").value_or(c.hidden_size / c.num_heads);
  c.max_position_embeddings = g.get_int(a + ".context_length");
  c.rms_norm_eps = g.get_float(a + ".attention.layer_norm_rms_epsilon");
  c.rope_theta = g.get_float_opt(a + ".rope.freq_base").value_or(10000.0);
  const auto& embd = g.tensor("token_embd.weight");
  if (embd.ne.size() != 2 || embd.ne[0] != c.hidden_size) throw std::runtime_error("token_embd.weight does not match embedding_length");
  c.vocab_size = embd.ne[1];
  if (a == "deepseek2") {
    read_deepseek2(g, c);
  } else if (g.find(a + ".rope.scaling.type")) {
    throw std::runtime_error("a GGUF with RoPE scaling (rope.scaling.*) is not read as the prefill model yet: give its HF checkpoint");
  } else if (const auto* rf = g.find_tensor("rope_freqs.weight")) {  // llama3's scaling, as the decoder applies it
    c.rope_scaling.type = RopeScalingType::Llama3;
    c.rope_scaling.freq_factors = g.to_f32(*rf);
    c.rope_scaling.original_max_position_embeddings = c.max_position_embeddings;
  }
  if (const auto e = g.get_int_opt(a + ".expert_count"); e && *e > 0) {
    c.num_experts = *e;
    c.num_experts_per_tok = g.get_int(a + ".expert_used_count");
    c.moe_intermediate_size = g.get_int(a + ".expert_feed_forward_length");
  }
  c.torch_dtype = "gguf";
  return c;
}

HfConfig model_config(const std::string& model) {
  if (!is_gguf_path(model)) return HfConfig::load(model);
  auto g = GgufFile::open(model);
  return hf_config_from_gguf(*g);
}

GgufModel gguf_weights(const std::string& path) {
  auto g = GgufFile::open(path);
  GgufModel m;
  m.config = hf_config_from_gguf(*g);
  m.weights = std::make_unique<GgufWeights>(std::move(g), m.config, path);
  return m;
}

}  // namespace pdb
