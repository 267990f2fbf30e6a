#include "formats/hf_deepseek4.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "formats/ggml_types.h"
#include "formats/gguf.h"
#include "formats/numeric.h"
#include "formats/safetensors.h"

namespace pdb {
using json = nlohmann::json;

int64_t Dsv4HfTensor::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<Dsv4HfTensor> deepseek4_hf_tensors(const Deepseek4Config& c) {
  using S = Dsv4HfTensor::Store;
  const int64_t E = c.hidden, V = c.vocab, D = c.head_dim, H = c.heads, Lq = c.q_lora, G = c.out_groups, R = c.out_lora;
  const int64_t I = c.index_dim, Hi = c.index_heads, NE = c.experts, F = c.expert_ff, FS = c.expert_ff * c.shared_experts;
  const int64_t hc = c.hc_streams, mix = (2 + hc) * hc;
  std::vector<Dsv4HfTensor> t;
  // torch [out, in] is GGUF ne {in, out}: the same memory. Random init N(0, 1/sqrt(in)) keeps every product O(1).
  auto linear = [&](std::string hf, std::string gguf, int64_t out, int64_t in, S store) {
    t.push_back({std::move(hf), {out, in}, std::move(gguf), {in, out}, store, -1, 0.0f, 1.0f / std::sqrt(float(in))});
  };
  auto vec = [&](std::string hf, std::string gguf, int64_t n, float mean, float sd) {
    t.push_back({std::move(hf), {n}, std::move(gguf), {n}, S::F32, -1, mean, sd});
  };
  t.push_back({"embed.weight", {V, E}, "token_embd.weight", {E, V}, S::Bf16, -1, 0.0f, 1.0f});
  vec("norm.weight", "output_norm.weight", E, 1.0f, 0.0f);
  linear("head.weight", "output.weight", V, E, S::Bf16);
  t.push_back({"hc_head_fn", {hc, hc * E}, "output_hc_fn.weight", {hc * E, hc}, S::F32, -1, 0.0f, 1.0f / std::sqrt(float(hc * E))});
  vec("hc_head_base", "output_hc_base.weight", hc, 0.0f, 0.5f);
  vec("hc_head_scale", "output_hc_scale.weight", 1, 1.0f, 0.0f);
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = fmt::format("layers.{}.", l), g = fmt::format("blk.{}.", l);
    const int64_t ratio = c.compress_ratios.at(size_t(l));
    vec(p + "attn_norm.weight", g + "attn_norm.weight", E, 1.0f, 0.0f);
    vec(p + "attn.attn_sink", g + "attn_sinks.weight", H, 0.0f, 0.5f);
    linear(p + "attn.wq_a.weight", g + "attn_q_a.weight", Lq, E, S::Fp8);
    vec(p + "attn.q_norm.weight", g + "attn_q_a_norm.weight", Lq, 1.0f, 0.0f);
    linear(p + "attn.wq_b.weight", g + "attn_q_b.weight", H * D, Lq, S::Fp8);
    linear(p + "attn.wkv.weight", g + "attn_kv.weight", D, E, S::Fp8);
    vec(p + "attn.kv_norm.weight", g + "attn_kv_a_norm.weight", D, 1.0f, 0.0f);
    linear(p + "attn.wo_a.weight", g + "attn_output_a.weight", R * G, H * D / G, S::Fp8);
    linear(p + "attn.wo_b.weight", g + "attn_output_b.weight", E, G * R, S::Fp8);
    for (const char* k : {"attn", "ffn"}) {
      t.push_back({p + fmt::format("hc_{}_fn", k), {mix, hc * E}, g + fmt::format("hc_{}_fn.weight", k), {hc * E, mix}, S::F32, -1, 0.0f,
                   1.0f / std::sqrt(float(hc * E))});
      vec(p + fmt::format("hc_{}_base", k), g + fmt::format("hc_{}_base.weight", k), mix, 0.0f, 0.5f);
      vec(p + fmt::format("hc_{}_scale", k), g + fmt::format("hc_{}_scale.weight", k), 3, 1.0f, 0.0f);
    }
    if (ratio != 0) {
      const int64_t cw = (ratio == 4 ? 2 : 1) * D;
      linear(p + "attn.compressor.wkv.weight", g + "attn_compressor_kv.weight", cw, E, S::Fp8);
      linear(p + "attn.compressor.wgate.weight", g + "attn_compressor_gate.weight", cw, E, S::Fp8);
      t.push_back({p + "attn.compressor.ape", {ratio, cw}, g + "attn_compressor_ape.weight", {cw, ratio}, S::F32, -1, 0.0f, 0.1f});
      vec(p + "attn.compressor.norm.weight", g + "attn_compressor_norm.weight", D, 1.0f, 0.0f);
      if (ratio == 4) {
        linear(p + "attn.indexer.weights_proj.weight", g + "indexer.proj.weight", Hi, E, S::Fp8);
        linear(p + "attn.indexer.wq_b.weight", g + "indexer.attn_q_b.weight", Hi * I, Lq, S::Fp8);
        linear(p + "attn.indexer.compressor.wkv.weight", g + "indexer_compressor_kv.weight", 2 * I, E, S::Fp8);
        linear(p + "attn.indexer.compressor.wgate.weight", g + "indexer_compressor_gate.weight", 2 * I, E, S::Fp8);
        t.push_back({p + "attn.indexer.compressor.ape", {4, 2 * I}, g + "indexer_compressor_ape.weight", {2 * I, 4}, S::F32, -1, 0.0f, 0.1f});
        vec(p + "attn.indexer.compressor.norm.weight", g + "indexer_compressor_norm.weight", I, 1.0f, 0.0f);
      }
    }
    linear(p + "ffn.gate.weight", g + "ffn_gate_inp.weight", NE, E, S::Bf16);
    if (l < c.hash_layers) t.push_back({p + "ffn.gate.tid2eid", {V, c.experts_used}, g + "ffn_gate_tid2eid.weight", {c.experts_used, V}, S::I64});
    else vec(p + "ffn.gate.bias", g + "exp_probs_b.bias", NE, 0.0f, 0.0f);
    vec(p + "ffn_norm.weight", g + "ffn_norm.weight", E, 1.0f, 0.0f);
    for (int64_t e = 0; e < NE; ++e) {
      const std::string q = p + fmt::format("ffn.experts.{}.", e);
      t.push_back({q + "w1.weight", {F, E}, g + "ffn_gate_exps.weight", {E, F, NE}, S::Fp4Expert, e, 0.0f, 1.0f / std::sqrt(float(E))});
      t.push_back({q + "w2.weight", {E, F}, g + "ffn_down_exps.weight", {F, E, NE}, S::Fp4Expert, e, 0.0f, 1.0f / std::sqrt(float(F))});
      t.push_back({q + "w3.weight", {F, E}, g + "ffn_up_exps.weight", {E, F, NE}, S::Fp4Expert, e, 0.0f, 1.0f / std::sqrt(float(E))});
    }
    linear(p + "ffn.shared_experts.w1.weight", g + "ffn_gate_shexp.weight", FS, E, S::Fp8);
    linear(p + "ffn.shared_experts.w2.weight", g + "ffn_down_shexp.weight", E, FS, S::Fp8);
    linear(p + "ffn.shared_experts.w3.weight", g + "ffn_up_shexp.weight", FS, E, S::Fp8);
  }
  return t;
}

json deepseek4_hf_config_json(const Deepseek4Config& c, bool official) {
  json j = {{"architectures", {"DeepseekV4ForCausalLM"}}, {"model_type", "deepseek_v4"},
            {"hidden_size", c.hidden}, {"num_hidden_layers", c.layers}, {"num_attention_heads", c.heads}, {"num_key_value_heads", 1},
            {"head_dim", c.head_dim}, {"qk_rope_head_dim", c.rope_dims}, {"q_lora_rank", c.q_lora}, {"o_lora_rank", c.out_lora},
            {"o_groups", c.out_groups}, {"sliding_window", c.window}, {"vocab_size", c.vocab}, {"rms_norm_eps", c.rms_eps},
            {"hidden_act", "silu"}, {"tie_word_embeddings", false}, {"n_routed_experts", c.experts},
            {"num_experts_per_tok", c.experts_used}, {"n_shared_experts", c.shared_experts}, {"moe_intermediate_size", c.expert_ff},
            {"scoring_func", "sqrtsoftplus"}, {"topk_method", "noaux_tc"}, {"norm_topk_prob", true},
            {"routed_scaling_factor", c.expert_scale}, {"swiglu_limit", c.swiglu_clamp}, {"num_hash_layers", c.hash_layers},
            {"hc_mult", c.hc_streams}, {"hc_sinkhorn_iters", c.hc_iterations}, {"hc_eps", c.hc_eps}, {"index_n_heads", c.index_heads},
            {"index_head_dim", c.index_dim}, {"index_topk", c.index_top_k}, {"compress_rope_theta", c.compress_rope_base},
            {"compress_ratios", c.compress_ratios}, {"rope_theta", c.rope_base}, {"max_position_embeddings", c.context},
            {"torch_dtype", official ? "bfloat16" : "float32"}};
  if (c.yarn_factor > 0)
    j["rope_scaling"] = {{"type", "yarn"}, {"factor", c.yarn_factor}, {"original_max_position_embeddings", c.yarn_orig_ctx},
                         {"beta_fast", 32}, {"beta_slow", 1}};
  if (official) {
    j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"scale_fmt", "ue8m0"}, {"weight_block_size", {128, 128}},
                                {"activation_scheme", "dynamic"}};
    j["expert_dtype"] = "fp4";
  }
  return j;
}

Deepseek4Config deepseek4_config_from_hf(const json& j) {
  auto need = [&](const char* k) -> const json& {
    if (!j.contains(k) || j[k].is_null()) throw std::runtime_error(fmt::format("config.json: '{}' is required for deepseek_v4", k));
    return j[k];
  };
  auto i64 = [&](const char* k) { return need(k).get<int64_t>(); };
  auto f = [&](const char* k) { return need(k).get<float>(); };
  if (j.value("model_type", "") != "deepseek_v4") throw std::runtime_error("config.json: model_type is not deepseek_v4");
  Deepseek4Config c;
  c.hidden = i64("hidden_size");
  c.layers = i64("num_hidden_layers");
  c.heads = i64("num_attention_heads");
  if (j.value("num_key_value_heads", int64_t(1)) != 1) throw std::runtime_error("config.json: deepseek_v4 has one KV head");
  c.head_dim = i64("head_dim");
  c.rope_dims = i64("qk_rope_head_dim");
  c.q_lora = i64("q_lora_rank");
  c.out_lora = i64("o_lora_rank");
  c.out_groups = i64("o_groups");
  c.window = i64("sliding_window");
  c.vocab = i64("vocab_size");
  c.rms_eps = f("rms_norm_eps");
  c.experts = i64("n_routed_experts");
  c.experts_used = i64("num_experts_per_tok");
  c.shared_experts = i64("n_shared_experts");
  c.expert_ff = i64("moe_intermediate_size");
  if (j.value("scoring_func", "") != "sqrtsoftplus") throw std::runtime_error("config.json: scoring_func must be sqrtsoftplus");
  c.expert_scale = f("routed_scaling_factor");
  c.swiglu_clamp = f("swiglu_limit");
  c.hash_layers = i64("num_hash_layers");
  c.hc_streams = i64("hc_mult");
  c.hc_iterations = i64("hc_sinkhorn_iters");
  c.hc_eps = f("hc_eps");
  c.index_heads = i64("index_n_heads");
  c.index_dim = i64("index_head_dim");
  c.index_top_k = i64("index_topk");
  c.compress_rope_base = f("compress_rope_theta");
  c.rope_base = j.value("rope_theta", 10000.0f);
  c.context = i64("max_position_embeddings");
  const auto& cr = need("compress_ratios");
  if (!cr.is_array() || int64_t(cr.size()) < c.layers) throw std::runtime_error("config.json: compress_ratios needs an entry per layer");
  for (int64_t l = 0; l < c.layers; ++l) {  // the entries past num_hidden_layers are the MTP layer's / padding
    const int32_t r = cr[size_t(l)].get<int32_t>();
    if (r != 0 && r != 4 && r != 128) throw std::runtime_error(fmt::format("config.json: compress_ratios[{}] = {} (0, 4 or 128)", l, r));
    c.compress_ratios.push_back(r);
  }
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) {
    const auto& rs = j["rope_scaling"];
    const std::string type = rs.value("type", rs.value("rope_type", ""));
    if (type == "yarn") {
      c.yarn_factor = rs.at("factor").get<float>();
      c.yarn_orig_ctx = rs.at("original_max_position_embeddings").get<int64_t>();
      if (rs.value("beta_fast", 32.0) != 32.0 || rs.value("beta_slow", 1.0) != 1.0)
        throw std::runtime_error("config.json: rope_scaling beta_fast/beta_slow other than 32/1 (llama.cpp's deepseek4 uses its defaults)");
    } else if (!type.empty() && type != "default") {
      throw std::runtime_error("config.json: rope_scaling type " + type + " (deepseek_v4 scales with yarn)");
    }
  }
  return c;
}

std::unique_ptr<Deepseek4Checkpoint> Deepseek4Checkpoint::open(const std::string& dir) {
  std::unique_ptr<Deepseek4Checkpoint> ck(new Deepseek4Checkpoint());
  ck->dir_ = dir;
  std::ifstream f(dir + "/config.json");
  if (!f) throw std::runtime_error("cannot open " + dir + "/config.json");
  json j;
  try { j = json::parse(f); } catch (const std::exception& e) { throw std::runtime_error(dir + "/config.json: " + e.what()); }
  ck->c_ = deepseek4_config_from_hf(j);
  ck->official_ = j.contains("quantization_config");
  ck->table_ = deepseek4_hf_tensors(ck->c_);
  ck->st_ = SafetensorsCheckpoint::open(dir);
  for (const auto& t : ck->table_) {
    const StTensor& s = ck->st_->get(t.hf);
    std::vector<int64_t> want = t.shape;
    if (s.dtype == StDtype::I8 && t.store == Dsv4HfTensor::Store::Fp4Expert) want.back() /= 2;
    if (s.shape != want) throw std::runtime_error(fmt::format("{}: {} has shape [{}], the config makes it [{}]", dir, t.hf, fmt::join(s.shape, ","), fmt::join(want, ",")));
  }
  return ck;
}

Deepseek4Checkpoint::~Deepseek4Checkpoint() = default;

std::vector<const Dsv4HfTensor*> Deepseek4Checkpoint::sources(const std::string& gguf) const {
  std::vector<const Dsv4HfTensor*> out;
  for (const auto& t : table_)
    if (t.gguf == gguf) out.push_back(&t);
  if (out.empty()) throw std::runtime_error("deepseek4 checkpoint: no tensor becomes " + gguf);
  return out;
}

std::vector<std::string> Deepseek4Checkpoint::gguf_names() const {
  std::vector<std::string> out;
  std::set<std::string> seen;  // the routed experts' three stacked tensors interleave in the checkpoint
  for (const auto& t : table_)
    if (seen.insert(t.gguf).second) out.push_back(t.gguf);
  return out;
}

namespace {
constexpr float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
}

std::vector<float> Deepseek4Checkpoint::hf_f32(const Dsv4HfTensor& t) const {
  const StTensor& s = st_->get(t.hf);
  const int64_t n = t.elements();
  std::vector<float> out(static_cast<size_t>(n));
  if (s.dtype == StDtype::F8_E4M3) {  // block-FP8 with its ue8m0 scales
    const StTensor& sc = st_->get(t.hf.substr(0, t.hf.size() - std::string("weight").size()) + "scale");
    const int64_t rows = t.shape[0], cols = t.shape[1], br = (rows + 127) / 128, bc = (cols + 127) / 128;
    if (sc.n_elements() != br * bc) throw std::runtime_error(t.hf + ": its scale is not one per 128x128 block");
    std::vector<float> scale(static_cast<size_t>(br * bc));
    for (int64_t i = 0; i < br * bc; ++i) scale[size_t(i)] = sc.dtype == StDtype::F8_E8M0 || sc.dtype == StDtype::U8 ? e8m0_to_f32(sc.data[i]) : 0.0f;
    if (sc.dtype != StDtype::F8_E8M0 && sc.dtype != StDtype::U8) scale = st_->to_f32(sc.name);
    dequantize_block_fp8(s.data, rows, cols, scale.data(), 128, 128, out.data());
  } else if (s.dtype == StDtype::I8 && t.store == Dsv4HfTensor::Store::Fp4Expert) {  // e2m1 pairs, ue8m0 per 32
    const StTensor& sc = st_->get(t.hf.substr(0, t.hf.size() - std::string("weight").size()) + "scale");
    if (sc.n_elements() != n / 32) throw std::runtime_error(t.hf + ": its scale is not one per 32 values");
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t b = s.data[i / 2];
      out[size_t(i)] = kE2m1[i % 2 ? b >> 4 : b & 0x0F] * e8m0_to_f32(sc.data[i / 32]);
    }
  } else {
    out = st_->to_f32(t.hf);
  }
  return out;
}

std::vector<float> Deepseek4Checkpoint::gguf_f32(const std::string& gguf) const {
  const auto src = sources(gguf);
  if (src[0]->store == Dsv4HfTensor::Store::I64) throw std::runtime_error(gguf + " holds expert ids, not values");
  std::vector<float> out;
  for (const auto* t : src) {  // routed experts: expert 0's matrix, then 1's, ... (ne {in, out, n_expert})
    auto v = hf_f32(*t);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

std::vector<int32_t> Deepseek4Checkpoint::gguf_i32(const std::string& gguf) const {
  const auto src = sources(gguf);
  const StTensor& s = st_->get(src[0]->hf);
  std::vector<int32_t> out(static_cast<size_t>(src[0]->elements()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (s.dtype == StDtype::I64) { int64_t v; std::memcpy(&v, s.data + 8 * i, 8); out[i] = int32_t(v); }
    else if (s.dtype == StDtype::I32) std::memcpy(&out[i], s.data + 4 * i, 4);
    else throw std::runtime_error(src[0]->hf + ": expert ids must be I64 or I32");
  }
  return out;
}

uint32_t Deepseek4Checkpoint::gguf_converted_type(const std::string& gguf) const {
  const Dsv4HfTensor& t0 = *sources(gguf)[0];
  const StDtype dt = st_->get(t0.hf).dtype;
  if (t0.store == Dsv4HfTensor::Store::I64) return uint32_t(GgmlType::I32);
  if (dt == StDtype::I8 && t0.store == Dsv4HfTensor::Store::Fp4Expert) return uint32_t(GgmlType::MXFP4);  // repacked, bit for bit
  if (dt == StDtype::F8_E4M3) return uint32_t(GgmlType::Q8_0);                     // conversion/deepseek.py forces block-FP8 to Q8_0
  if (dt == StDtype::BF16 && t0.shape.size() >= 2) return uint32_t(GgmlType::BF16);  // bf16 matrices stay bf16, vectors go to f32
  return uint32_t(GgmlType::F32);
}

Deepseek4Checkpoint::Converted Deepseek4Checkpoint::gguf_converted(const std::string& gguf) const {
  const auto src = sources(gguf);
  const Dsv4HfTensor& t0 = *src[0];
  Converted out;
  out.type = gguf_converted_type(gguf);
  if (GgmlType(out.type) == GgmlType::I32) {
    const auto ids = gguf_i32(gguf);
    out.bytes.resize(ids.size() * 4);
    std::memcpy(out.bytes.data(), ids.data(), out.bytes.size());
    return out;
  }
  if (GgmlType(out.type) == GgmlType::MXFP4) {
    for (const auto* t : src) {
      const StTensor& w = st_->get(t->hf);
      const StTensor& sc = st_->get(t->hf.substr(0, t->hf.size() - std::string("weight").size()) + "scale");
      const int64_t n = t->elements();
      for (int64_t b = 0; b < n / 32; ++b) {
        uint8_t blk[17];
        blk[0] = sc.data[b];  // ue8m0 = ggml's E8M0 (whose value table is e2m1 doubled, with a half scale)
        for (int j = 0; j < 16; ++j) {
          auto code = [&](int64_t i) { const uint8_t x = w.data[(32 * b + i) / 2]; return uint8_t(i % 2 ? x >> 4 : x & 0x0F); };
          blk[1 + j] = uint8_t(code(j) | (code(j + 16) << 4));
        }
        out.bytes.insert(out.bytes.end(), blk, blk + 17);
      }
    }
    return out;
  }
  const auto v = gguf_f32(gguf);
  const GgmlType type = GgmlType(out.type);
  const int64_t row = t0.gguf_ne[0], rows = int64_t(v.size()) / row;
  const size_t rb = ggml_row_bytes(type, row);
  out.bytes.resize(rb * size_t(rows));
  for (int64_t r = 0; r < rows; ++r) quantize_row(type, v.data() + r * row, out.bytes.data() + size_t(r) * rb, row);
  return out;
}

void write_deepseek4_gguf(const Deepseek4Checkpoint& ck, const std::string& vocab_gguf, const std::string& path, const std::string& name) {
  const Deepseek4Config& c = ck.config();
  const std::string a = "deepseek4";
  GgufWriter w;
  w.set("general.architecture", GgufValue::of_str(a));
  w.set("general.name", GgufValue::of_str(name));
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
  if (c.yarn_factor > 0) {
    w.set(a + ".rope.scaling.type", GgufValue::of_str("yarn"));
    f32("rope.scaling.factor", c.yarn_factor);
    u32("rope.scaling.original_context_length", c.yarn_orig_ctx);
  }
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
  std::map<std::string, std::vector<int64_t>> ne;
  for (const auto& t : deepseek4_hf_tensors(c)) ne.emplace(t.gguf, t.gguf_ne);
  for (const auto& n : ck.gguf_names()) {
    // converted when the writer reaches it: one tensor in memory at a time
    w.add_tensor(n, GgmlType(ck.gguf_converted_type(n)), ne.at(n), [&ck, n](uint8_t* dst, size_t bytes) {
      const auto c2 = ck.gguf_converted(n);
      if (c2.bytes.size() != bytes) throw std::runtime_error(n + ": converted size changed");
      std::memcpy(dst, c2.bytes.data(), bytes);
    });
  }
  w.write(path);
}

}  // namespace pdb
