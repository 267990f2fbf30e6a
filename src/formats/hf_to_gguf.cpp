#include "formats/hf_to_gguf.h"

#include <cmath>
#include <cstring>
#include <numbers>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "formats/gguf.h"

namespace pdb {

namespace {

// A SwiGLU MLP: HF <hf>.{gate,up,down}_proj -> GGUF ffn_{gate,up,down}<suffix> (dense: "", shared experts: "_shexp").
void add_swiglu_mlp(const std::string& hf, const std::string& g, const std::string& suffix, int64_t F, int64_t H, std::vector<HfTensorSpec>& s) {
  s.push_back({hf + ".gate_proj.weight", {F, H}, g + "ffn_gate" + suffix + ".weight", 0});
  s.push_back({hf + ".up_proj.weight", {F, H}, g + "ffn_up" + suffix + ".weight", 0});
  s.push_back({hf + ".down_proj.weight", {H, F}, g + "ffn_down" + suffix + ".weight", 0});
}

void add_output(const HfConfig& c, std::vector<HfTensorSpec>& s) {
  s.push_back({"model.norm.weight", {c.hidden_size}, "output_norm.weight", 0});
  if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}, "output.weight", 0});
}

// Routed experts (stacked per projection in the GGUF) and the router, for qwen3moe and deepseek2.
void add_routed_experts(const HfConfig& c, const std::string& p, const std::string& g, std::vector<HfTensorSpec>& s) {
  const int64_t E = c.num_experts, Fe = c.moe_intermediate_size, H = c.hidden_size;
  HfTensorSpec router{p + "mlp.gate.weight", {E, H}, g + "ffn_gate_inp.weight", 0};
  router.keep_f32 = true;
  s.push_back(router);
  HfTensorSpec gate{"", {E, Fe, H}, g + "ffn_gate_exps.weight", 0}, up{"", {E, Fe, H}, g + "ffn_up_exps.weight", 0},
      down{"", {E, H, Fe}, g + "ffn_down_exps.weight", 0};
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
    s.push_back({x + "gate_proj.weight", {Fe, H}, "", 0});
    s.push_back({x + "up_proj.weight", {Fe, H}, "", 0});
    s.push_back({x + "down_proj.weight", {H, Fe}, "", 0});
    gate.stack.push_back(x + "gate_proj.weight");
    up.stack.push_back(x + "up_proj.weight");
    down.stack.push_back(x + "down_proj.weight");
  }
  s.push_back(gate);
  s.push_back(up);
  s.push_back(down);
}

// deepseek2 (DeepSeek-V2-Lite's safetensors names; the GGUF as llama.cpp's converter writes an MLA model).
std::vector<HfTensorSpec> deepseek2_specs(const HfConfig& c) {
  const int64_t H = c.hidden_size, nh = c.num_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const int64_t kvl = c.kv_lora_rank, rope = c.qk_rope_head_dim, nope = c.qk_nope_head_dim, vd = c.v_head_dim;
  std::vector<HfTensorSpec> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, H}, "token_embd.weight", 0});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l), g = fmt::format("blk.{}.", l);
    s.push_back({p + "input_layernorm.weight", {H}, g + "attn_norm.weight", 0});
    if (c.q_lora_rank) {
      s.push_back({p + "self_attn.q_a_proj.weight", {c.q_lora_rank, H}, g + "attn_q_a.weight", 0});
      s.push_back({p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank}, g + "attn_q_a_norm.weight", 0});
      s.push_back({p + "self_attn.q_b_proj.weight", {nh * qk, c.q_lora_rank}, g + "attn_q_b.weight", 0});
    } else {
      s.push_back({p + "self_attn.q_proj.weight", {nh * qk, H}, g + "attn_q.weight", 0});
    }
    s.push_back({p + "self_attn.kv_a_proj_with_mqa.weight", {kvl + rope, H}, g + "attn_kv_a_mqa.weight", 0});
    s.push_back({p + "self_attn.kv_a_layernorm.weight", {kvl}, g + "attn_kv_a_norm.weight", 0});
    const std::string kvb = p + "self_attn.kv_b_proj.weight";
    s.push_back({kvb, {nh * (nope + vd), kvl}, "", 0});
    HfTensorSpec kb{"", {nh, kvl, nope}, g + "attn_k_b.weight", 0}, vb{"", {nh, vd, kvl}, g + "attn_v_b.weight", 0};
    kb.kv_b_part = 1; kb.derive_from = kvb;
    vb.kv_b_part = 2; vb.derive_from = kvb;
    s.push_back(kb);
    s.push_back(vb);
    s.push_back({p + "self_attn.o_proj.weight", {H, nh * vd}, g + "attn_output.weight", 0});
    s.push_back({p + "post_attention_layernorm.weight", {H}, g + "ffn_norm.weight", 0});
    if (l < c.first_k_dense_replace) {
      add_swiglu_mlp(p + "mlp", g, "", c.intermediate_size, H, s);
      continue;
    }
    add_routed_experts(c, p, g, s);
    add_swiglu_mlp(p + "mlp.shared_experts", g, "_shexp", c.moe_intermediate_size * c.n_shared_experts, H, s);  // one MLP
  }
  add_output(c, s);
  return s;
}

// kv_b_proj [n_head x (nope + v) x kv_lora] -> attn_k_b [n_head x kv_lora x nope] (transposed per
// head) or attn_v_b [n_head x v x kv_lora].
void split_kv_b(const HfConfig& c, int part, const float* kvb, float* out) {
  const int64_t nh = c.num_heads, nope = c.qk_nope_head_dim, vd = c.v_head_dim, kvl = c.kv_lora_rank;
  for (int64_t h = 0; h < nh; ++h) {
    const float* head = kvb + h * (nope + vd) * kvl;
    if (part == 1)
      for (int64_t r = 0; r < kvl; ++r)
        for (int64_t i = 0; i < nope; ++i) out[(h * kvl + r) * nope + i] = head[i * kvl + r];
    else
      std::copy(head + nope * kvl, head + (nope + vd) * kvl, out + h * vd * kvl);
  }
}

}  // namespace

std::vector<HfTensorSpec> hf_tensor_specs(const HfConfig& c) {
  if (c.arch == "deepseek2") return deepseek2_specs(c);
  const int64_t H = c.hidden_size, F = c.intermediate_size, hd = c.head_dim;
  const int64_t q_dim = c.num_heads * hd, kv_dim = c.num_kv_heads * hd;
  const bool llama = c.arch == "llama";
  std::vector<HfTensorSpec> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, H}, "token_embd.weight", 0});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l), g = fmt::format("blk.{}.", l);
    s.push_back({p + "input_layernorm.weight", {H}, g + "attn_norm.weight", 0});
    s.push_back({p + "self_attn.q_proj.weight", {q_dim, H}, g + "attn_q.weight", llama ? int(c.num_heads) : 0});
    s.push_back({p + "self_attn.k_proj.weight", {kv_dim, H}, g + "attn_k.weight", llama ? int(c.num_kv_heads) : 0});
    s.push_back({p + "self_attn.v_proj.weight", {kv_dim, H}, g + "attn_v.weight", 0});
    s.push_back({p + "self_attn.o_proj.weight", {H, q_dim}, g + "attn_output.weight", 0});
    if (!llama) {
      s.push_back({p + "self_attn.q_norm.weight", {hd}, g + "attn_q_norm.weight", 0});
      s.push_back({p + "self_attn.k_norm.weight", {hd}, g + "attn_k_norm.weight", 0});
    }
    s.push_back({p + "post_attention_layernorm.weight", {H}, g + "ffn_norm.weight", 0});
    if (c.moe()) {  // Qwen3MoE: every layer routed, no shared expert
      add_routed_experts(c, p, g, s);
      continue;
    }
    add_swiglu_mlp(p + "mlp", g, "", F, H, s);
  }
  add_output(c, s);
  return s;
}

void permute_qk_rows(const float* hf, float* gguf, int64_t n_heads, int64_t hd, int64_t cols) {
  for (int64_t h = 0; h < n_heads; ++h)
    for (int64_t i = 0; i < hd / 2; ++i)
      for (int a = 0; a < 2; ++a) {
        const float* src = hf + (h * hd + a * hd / 2 + i) * cols;
        float* dst = gguf + (h * hd + 2 * i + a) * cols;
        std::copy(src, src + cols, dst);
      }
}

std::string vocab_name_for_arch(const std::string& arch) {
  if (arch == "llama") return "ggml-vocab-llama-bpe.gguf";
  if (arch == "qwen3" || arch == "qwen3moe") return "ggml-vocab-qwen2.gguf";
  if (arch == "deepseek2" || arch == "deepseek4") return "ggml-vocab-llama-bpe.gguf";  // a byte-level BPE vocab of our own models
  throw std::invalid_argument("no vocab for arch " + arch);
}

int64_t vocab_size_of(const std::string& vocab_gguf) {
  auto v = GgufFile::open(vocab_gguf);
  const GgufValue& toks = v->get("tokenizer.ggml.tokens");
  if (toks.type != GgufType::ARRAY) throw std::runtime_error(vocab_gguf + ": tokenizer.ggml.tokens is not an array");
  return int64_t(toks.arr.size());
}

namespace {
// Chat templates for vocab files that carry none: the model family's own format, so llama-server's
// /apply-template renders what a user of that family expects.
const char* kLlama3Template =
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";
const char* kChatmlTemplate =
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
}  // namespace

std::vector<float> llama3_rope_factors(const HfConfig& c) {
  // as convert_hf_to_gguf.py's llama3 branch computes it (a config read from a GGUF carries the GGUF's own)
  const auto& rs = c.rope_scaling;
  if (!rs.freq_factors.empty()) return rs.freq_factors;
  std::vector<float> factors;
  for (int64_t i = 0; i < c.head_dim / 2; ++i) {
    const double freq = 1.0 / std::pow(c.rope_theta, double(2 * i) / double(c.head_dim));
    const double wl = 2 * std::numbers::pi / freq;
    const double octx = double(rs.original_max_position_embeddings);
    const double low_wl = octx / rs.low_freq_factor, high_wl = octx / rs.high_freq_factor;
    double f;
    if (wl < high_wl) f = 1;
    else if (wl > low_wl) f = rs.factor;
    else {
      const double smooth = (octx / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
      f = 1 / ((1 - smooth) / rs.factor + smooth);
    }
    factors.push_back(float(f));
  }
  return factors;
}

namespace {

// The shapes every architecture writes; llama_ftype: ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q8_0 7, MOSTLY_BF16 32.
void set_model_keys(GgufWriter& w, const HfConfig& c, const GgufConvertOptions& o) {
  const std::string& a = c.arch;
  w.set("general.architecture", GgufValue::of_str(a));
  w.set("general.name", GgufValue::of_str(o.name.empty() ? "pdbridge-model" : o.name));
  w.set("general.file_type", GgufValue::of_u32(o.type == GgmlType::F32 ? 0 : o.type == GgmlType::F16 ? 1 : o.type == GgmlType::Q8_0 ? 7 : 32));
  w.set(a + ".block_count", GgufValue::of_u32(uint32_t(c.num_layers)));
  w.set(a + ".context_length", GgufValue::of_u32(uint32_t(c.max_position_embeddings)));
  w.set(a + ".embedding_length", GgufValue::of_u32(uint32_t(c.hidden_size)));
  w.set(a + ".feed_forward_length", GgufValue::of_u32(uint32_t(c.intermediate_size)));
  w.set(a + ".attention.head_count", GgufValue::of_u32(uint32_t(c.num_heads)));
  w.set(a + ".attention.head_count_kv", GgufValue::of_u32(uint32_t(c.num_kv_heads)));
  w.set(a + ".rope.freq_base", GgufValue::of_f32(float(c.rope_theta)));
  w.set(a + ".attention.layer_norm_rms_epsilon", GgufValue::of_f32(float(c.rms_norm_eps)));
  w.set(a + ".attention.key_length", GgufValue::of_u32(uint32_t(c.head_dim)));
  w.set(a + ".attention.value_length", GgufValue::of_u32(uint32_t(c.head_dim)));
  w.set(a + ".rope.dimension_count", GgufValue::of_u32(uint32_t(c.head_dim)));
  w.set(a + ".vocab_size", GgufValue::of_u32(uint32_t(c.vocab_size)));
  if (c.moe()) {
    w.set(a + ".expert_count", GgufValue::of_u32(uint32_t(c.num_experts)));
    w.set(a + ".expert_used_count", GgufValue::of_u32(uint32_t(c.num_experts_per_tok)));
    w.set(a + ".expert_feed_forward_length", GgufValue::of_u32(uint32_t(c.moe_intermediate_size)));
  }
}

// MLA as llama.cpp reads it (src/models/deepseek2.cpp): one KV head whose K row is the latent plus the roped part and
// whose V is the latent; the per-head score/value widths in the _mla keys.
void set_deepseek2_keys(GgufWriter& w, const HfConfig& c) {
  const std::string& a = c.arch;
  w.set(a + ".attention.head_count_kv", GgufValue::of_u32(1));
  w.set(a + ".attention.key_length", GgufValue::of_u32(uint32_t(c.kv_lora_rank + c.qk_rope_head_dim)));
  w.set(a + ".attention.value_length", GgufValue::of_u32(uint32_t(c.kv_lora_rank)));
  w.set(a + ".attention.key_length_mla", GgufValue::of_u32(uint32_t(c.qk_nope_head_dim + c.qk_rope_head_dim)));
  w.set(a + ".attention.value_length_mla", GgufValue::of_u32(uint32_t(c.v_head_dim)));
  w.set(a + ".rope.dimension_count", GgufValue::of_u32(uint32_t(c.qk_rope_head_dim)));
  // Always written (llama.cpp's converter omits it for a null q_lora_rank, which only loads at 26/27 layers).
  w.set(a + ".attention.q_lora_rank", GgufValue::of_u32(uint32_t(c.q_lora_rank)));
  w.set(a + ".attention.kv_lora_rank", GgufValue::of_u32(uint32_t(c.kv_lora_rank)));
  w.set(a + ".leading_dense_block_count", GgufValue::of_u32(uint32_t(c.first_k_dense_replace)));
  w.set(a + ".expert_shared_count", GgufValue::of_u32(uint32_t(c.n_shared_experts)));
  w.set(a + ".expert_weights_scale", GgufValue::of_f32(float(c.routed_scaling_factor)));
  w.set(a + ".expert_weights_norm", GgufValue::of_bool(c.norm_topk_prob));
  w.set(a + ".expert_gating_func", GgufValue::of_u32(1));  // softmax
  if (c.n_group) w.set(a + ".expert_group_count", GgufValue::of_u32(uint32_t(c.n_group)));
  if (c.topk_group) w.set(a + ".expert_group_used_count", GgufValue::of_u32(uint32_t(c.topk_group)));
  if (c.rope_scaling.type == RopeScalingType::Yarn && c.rope_scaling.mscale_all_dim)
    w.set(a + ".rope.scaling.yarn_log_multiplier", GgufValue::of_f32(float(0.1 * c.rope_scaling.mscale_all_dim)));
}

void set_rope_scaling_keys(GgufWriter& w, const HfConfig& c) {
  const std::string& a = c.arch;
  const auto& rs = c.rope_scaling;
  if (rs.type == RopeScalingType::Linear) {
    w.set(a + ".rope.scaling.type", GgufValue::of_str("linear"));
    w.set(a + ".rope.scaling.factor", GgufValue::of_f32(float(rs.factor)));
  } else if (rs.type == RopeScalingType::Yarn) {
    w.set(a + ".rope.scaling.type", GgufValue::of_str("yarn"));
    w.set(a + ".rope.scaling.factor", GgufValue::of_f32(float(rs.factor)));
    w.set(a + ".rope.scaling.original_context_length", GgufValue::of_u32(uint32_t(rs.original_max_position_embeddings)));
    w.set(a + ".rope.scaling.yarn_beta_fast", GgufValue::of_f32(float(rs.beta_fast)));
    w.set(a + ".rope.scaling.yarn_beta_slow", GgufValue::of_f32(float(rs.beta_slow)));
    if (rs.attention_factor) w.set(a + ".rope.scaling.yarn_attn_factor", GgufValue::of_f32(float(*rs.attention_factor)));
  }
}

// The vocabulary GGUF's tokenizer keys, and a chat template where it has none.
void copy_tokenizer(GgufWriter& w, const HfConfig& c, const GgufConvertOptions& o) {
  auto vocab = GgufFile::open(o.vocab_gguf);
  bool has_template = false;
  int64_t n_vocab = 0;
  for (const auto& [k, v] : vocab->kv()) {
    if (k.rfind("tokenizer.", 0) != 0) continue;
    if (k == "tokenizer.chat_template") has_template = true;
    if (k == "tokenizer.ggml.tokens") n_vocab = int64_t(v.arr.size());
    w.set(k, v);
  }
  if (n_vocab != c.vocab_size)
    throw std::runtime_error(fmt::format("vocab {} has {} tokens but the model has vocab_size {}", o.vocab_gguf, n_vocab, c.vocab_size));
  if (!has_template) w.set("tokenizer.chat_template", GgufValue::of_str(c.arch == "llama" ? kLlama3Template : kChatmlTemplate));
}

// One tensor's f32 values as the GGUF holds them: MLA's kv_b halves split, MoE experts stacked, q/k heads permuted.
void gguf_tensor_values(const HfConfig& c, const HfTensorSpec& sp, const HfWeightSource& src, std::vector<float>& f) {
  if (sp.kv_b_part) {
    std::vector<float> kvb(static_cast<size_t>(c.num_heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank));
    src(sp.derive_from, kvb.data());
    split_kv_b(c, sp.kv_b_part, kvb.data(), f.data());
  } else if (sp.stack.empty()) {
    src(sp.hf_name, f.data());
  } else {
    for (size_t e = 0; e < sp.stack.size(); ++e) src(sp.stack[e], f.data() + e * (f.size() / sp.stack.size()));
  }
  if (sp.permute_heads) {
    std::vector<float> p(f.size());
    permute_qk_rows(f.data(), p.data(), sp.permute_heads, c.head_dim, sp.shape[1]);
    f.swap(p);
  }
}

void add_weight_tensors(GgufWriter& w, const HfConfig& c, const HfWeightSource& src, const GgufConvertOptions& o) {
  if (c.rope_scaling.type == RopeScalingType::Llama3) {
    std::vector<float> factors = llama3_rope_factors(c);
    std::vector<uint8_t> bytes(factors.size() * 4);
    std::memcpy(bytes.data(), factors.data(), bytes.size());
    w.add_tensor_bytes("rope_freqs.weight", GgmlType::F32, {int64_t(factors.size())}, std::move(bytes));
  }
  for (const auto& sp : hf_tensor_specs(c)) {
    if (sp.gguf_name.empty()) continue;
    const bool is_matrix = sp.shape.size() >= 2 && !sp.keep_f32;
    const GgmlType t = is_matrix ? o.type : GgmlType::F32;
    std::vector<int64_t> ne(sp.shape.rbegin(), sp.shape.rend());
    w.add_tensor(sp.gguf_name, t, ne, [sp, t, &src, threads = o.threads, &c](uint8_t* dst, size_t nbytes) {
      int64_t n = 1;
      for (auto d : sp.shape) n *= d;
      std::vector<float> f(static_cast<size_t>(n));
      gguf_tensor_values(c, sp, src, f);
      const int64_t cols = sp.shape.back(), rows = n / cols;
      const size_t row_bytes = ggml_row_bytes(t, cols);
      if (row_bytes * size_t(rows) != nbytes) throw std::logic_error("GGUF tensor size mismatch for " + sp.gguf_name);
      parallel_for(rows, threads, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) quantize_row(t, f.data() + r * cols, dst + r * row_bytes, cols);
      });
    });
  }
}

}  // namespace

void write_decoder_gguf(const HfConfig& c, const HfWeightSource& src, const GgufConvertOptions& o, const std::string& path) {
  if (o.type != GgmlType::F32 && o.type != GgmlType::F16 && o.type != GgmlType::BF16 && o.type != GgmlType::Q8_0)
    throw std::invalid_argument("write_decoder_gguf writes f32, f16, bf16 or q8_0; use llama-quantize for other types");
  GgufWriter w;
  set_model_keys(w, c, o);
  if (c.arch == "deepseek2") set_deepseek2_keys(w, c);
  set_rope_scaling_keys(w, c);
  copy_tokenizer(w, c, o);
  add_weight_tensors(w, c, src, o);
  w.write(path);
}

}  // namespace pdb
