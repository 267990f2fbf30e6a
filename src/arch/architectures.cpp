// The architecture table: every architecture the prefill side runs, its engine (the prefill backend it makes on each
// device), whether the CUDA engine splits it over GPUs, and how its model's config is checked against the decoder's
// GGUF. The prefill server and the benchmarks make their backend here and never ask which architecture runs.
#include "arch/architectures.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#include "arch/backends.h"
#include "common/tuning.h"
#include "formats/deepseek4_config.h"
#include "formats/hf_config.h"
#include "formats/hf_deepseek4.h"
#include "formats/weight_source.h"
#include "model/cpu_engine.h"
#include "recipes/deepseek4.h"

namespace pdb {
namespace {

// An HF checkpoint's config.json against the decoder GGUF: layers, heads, head size, norm eps, every RoPE parameter;
// MoE: the experts; MLA: the latent row.
std::vector<std::string> hf_config_mismatches(const std::string& hf_dir, const GgufFile& gguf, const RecipeInfo& ri) {
  const GgufFile* g = &gguf;
  std::vector<std::string> out;
  const HfConfig hc = model_config(hf_dir);  // an HF checkpoint's config.json, or the prefill model's GGUF keys
  auto differ = [&](const std::string& what, double hf, double dec, double tol) {
    if (std::fabs(hf - dec) > tol * std::max(1.0, std::fabs(hf))) out.push_back(fmt::format("{}: config.json {} vs GGUF {}", what, hf, dec));
  };
  if (hc.arch != ri.arch) out.push_back(fmt::format("architecture: config.json {} vs GGUF {}", hc.arch, ri.arch));
  if (is_gguf_path(hf_dir)) {  // a GGUF as the model: the same weights as the recipe's file, tensor by tensor
    for (auto& d : gguf_weight_differences(*GgufFile::open(hf_dir), gguf)) out.push_back(std::move(d));
  }
  differ("layers", double(hc.num_layers), double(ri.n_layer), 0);
  differ("hidden size", double(hc.hidden_size), double(ri.n_embd), 0);
  if (hc.mla()) {  // the decoder caches one latent row: kv_lora_rank + rope dims, one "head"
    differ("kv_lora_rank", double(hc.kv_lora_rank), double(ri.kv_lora_rank), 0);
    differ("qk_rope_head_dim", double(hc.qk_rope_head_dim), double(ri.rope.n_dims), 0);
    differ("cache row width", double(hc.kv_lora_rank + hc.qk_rope_head_dim), double(ri.head_dim), 0);
  } else {
    differ("kv heads", double(hc.num_kv_heads), double(ri.n_head_kv), 0);
    differ("head dim", double(hc.head_dim), double(ri.head_dim), 0);
  }
  differ("rms_norm_eps", hc.rms_norm_eps, ri.norm_eps, 1e-6);
  differ("rope_theta", hc.rope_theta, ri.rope.freq_base, 1e-6);
  if (hc.moe()) {  // the experts never reach the cache, but an engine routing differently computes another model
    const std::string a = ri.arch;
    differ("num_experts", double(hc.num_experts), double(g->get_int_opt(a + ".expert_count").value_or(0)), 0);
    differ("num_experts_per_tok", double(hc.num_experts_per_tok), double(g->get_int_opt(a + ".expert_used_count").value_or(0)), 0);
    differ("moe_intermediate_size", double(hc.moe_intermediate_size), double(g->get_int_opt(a + ".expert_feed_forward_length").value_or(0)), 0);
  }
  const auto& rs = hc.rope_scaling;
  const auto& r = ri.rope;
  const bool gguf_linear_or_yarn = r.freq_scale != 1.0f;
  if (rs.type == RopeScalingType::Linear || rs.type == RopeScalingType::Yarn) {
    differ("rope_scaling.factor", rs.factor, 1.0 / r.freq_scale, 1e-5);
    if ((rs.type == RopeScalingType::Yarn) != (r.ext_factor != 0.0f)) out.push_back("rope_scaling type: yarn on one side only");
    if (rs.type == RopeScalingType::Yarn) differ("rope_scaling.original_max_position_embeddings", double(rs.original_max_position_embeddings), double(r.n_ctx_orig), 0);
  } else if (gguf_linear_or_yarn) {
    out.push_back(fmt::format("rope scaling: config.json has {} but the GGUF scales frequencies by {}", rope_scaling_name(rs.type), r.freq_scale));
  }
  if (rs.type == RopeScalingType::Llama3) {
    if (r.freq_factors.empty()) out.push_back("rope_scaling llama3 in config.json but the GGUF has no rope_freqs");
    else {
      // the GGUF's factors are the divisors of theta; HF's inv_freq = base^(-2i/d) / factor_i
      const auto inv = hc.inv_freq();
      for (size_t i = 0; i < inv.size() && i < r.freq_factors.size(); ++i) {
        const double base_f = 1.0 / std::pow(hc.rope_theta, double(2 * i) / double(hc.head_dim));
        if (std::fabs(base_f / inv[i] - r.freq_factors[i]) > 1e-3 * r.freq_factors[i]) {
          out.push_back(fmt::format("rope_freqs[{}]: config.json implies {} vs GGUF {}", i, base_f / inv[i], r.freq_factors[i]));
          break;
        }
      }
    }
  } else if (!r.freq_factors.empty()) {
    out.push_back("the GGUF has rope_freqs (llama3 scaling) but config.json does not scale");
  }
  return out;
}

// DeepSeek-V4: every field of the model (config.json's, or another GGUF's keys) against the decoder GGUF's.
std::vector<std::string> deepseek4_config_mismatches(const std::string& model, const GgufFile& g, const RecipeInfo&) {
  const Deepseek4Config dec = deepseek4_config_from_gguf(g);
  const Deepseek4Config eng = std::filesystem::is_directory(model) ? Deepseek4Checkpoint::open(model)->config()
                                                                   : deepseek4_config_from_gguf(*GgufFile::open(model));
  std::vector<std::string> out;
  for (const auto& d : deepseek4_config_differences(eng, dec)) out.push_back(fmt::format("{} (model vs GGUF)", d));
  return out;
}

// llama, qwen3, qwen3moe, deepseek2: the HF checkpoint's forward (model/cpu_engine, model/cuda_engine) with the
// decoder's K/V recipe on its per-layer hook.
std::unique_ptr<PrefillBackend> checkpoint_backend(const BackendOptions& o) {
  if (o.kv_rows == "engine") kv_rows_from_engine(o, ProductNumerics::bf16, RecipeInfo{});  // refused before anything loads
  const ProductNumerics numerics = resolve_numerics(o);
  std::shared_ptr<const Recipe> recipe = Recipe::load(o.recipe, o.threads);
  const bool engine_rows = kv_rows_from_engine(o, numerics, recipe->info());
  if (o.device == "cuda")
    return make_cuda_backend(o.model, recipe, o.threads, o.chunk, o.kv_dtype == "fp8", o.tp, o.tp_one_gpu, o.max_gpu_mem_gib, engine_rows, numerics);
  return make_cpu_backend(std::make_shared<CpuEngine>(o.model, o.threads), recipe, o.faithful);
}

// DeepSeek-V4: its own engines, the recipe's pooled sections inside them.
std::unique_ptr<PrefillBackend> deepseek4_backend(const BackendOptions& o) {
  if (o.kv_rows == "engine") throw std::invalid_argument("--kv-rows engine: DeepSeek-V4 caches pooled sections only its recipe computes");
  if (o.numerics != "bf16" && o.numerics != "auto")
    throw std::invalid_argument("--numerics: the DeepSeek-V4 engine has its own products (its recipe's arithmetic)");
  return o.device == "cuda" ? make_cuda_dsv4_backend(o.recipe, o.model) : make_cpu_dsv4_backend(o.recipe, o.model);
}

const Architecture kArchitectures[] = {
    {"llama", true, checkpoint_backend, hf_config_mismatches},
    {"qwen3", true, checkpoint_backend, hf_config_mismatches},
    {"qwen3moe", true, checkpoint_backend, hf_config_mismatches},
    {"deepseek2", false, checkpoint_backend, hf_config_mismatches},
    {"deepseek4", false, deepseek4_backend, deepseek4_config_mismatches},
};

}  // namespace

// --kv-rows auto: the engine's rows where they are the recipe's own arithmetic, so that the recipe would only make the
// same products again: the engine runs the decoder's GGUF itself (the same file) with half products, and every layer's
// weights of the cached rows are F16 (q, k and v by heads; MLA's kv_a, its latent and k_pe), whose activations every
// ggml backend rounds to half as the recipe and the engine do. The rows then differ from the recipe's at most in the
// products' summation order (CudaParity.EngineKvRowsFromTheDecodersGguf asks layer 0 >= 99% identical and every layer
// within 2e-3 rel RMS on llama-tiny-h16 and deepseek2-small's F16 GGUF; passed on an H100 in session 47). Anything else:
// the recipe's.
static bool engine_rows_are_the_recipes(const BackendOptions& o, ProductNumerics numerics, const RecipeInfo& info) {
  if (o.device != "cuda" || numerics != ProductNumerics::half || !is_gguf_path(o.model) || o.model != o.recipe) return false;
  // MLA's half kv_a product gives the recipe's rows but measured no faster (session 47: its second kv_a product costs about
  // what the recipe's rows saved); auto leaves MLA to the recipe unless asked, --kv-rows engine takes it
  if (info.mla() && Tuning::from_env().mla_auto_rows != "1") return false;
  const auto gguf = GgufFile::open(o.model);
  int qkv = 0, kv_a = 0;
  for (const auto& t : gguf->tensors()) {
    if (t.name.rfind("blk.", 0) != 0) continue;
    const bool proj = t.name.find(".attn_q.weight") != std::string::npos || t.name.find(".attn_k.weight") != std::string::npos ||
                      t.name.find(".attn_v.weight") != std::string::npos;
    const bool latent = t.name.find(".attn_kv_a_mqa.weight") != std::string::npos;
    if (t.name.find(".attn_qkv.") != std::string::npos || ((info.mla() ? latent : proj) && t.type != GgmlType::F16)) return false;
    qkv += proj;
    kv_a += latent;
  }
  return info.mla() ? kv_a == info.n_layer : qkv > 0 && qkv % 3 == 0;
}

// --kv-rows: the engine's own K/V are the decoder's rows only when its weights are the decoder's: the same GGUF, or
// one whose tensors equal it (type, shape, hash).
bool kv_rows_from_engine(const BackendOptions& o, ProductNumerics numerics, const RecipeInfo& info) {
  if (o.kv_rows == "auto") return engine_rows_are_the_recipes(o, numerics, info);
  if (o.kv_rows == "decoder") return false;
  if (o.kv_rows != "engine") throw std::invalid_argument(fmt::format("--kv-rows {}: auto, decoder or engine", o.kv_rows));
  if (o.device != "cuda") throw std::invalid_argument("--kv-rows engine is for --device cuda (the CPU engine's rows are the recipe's arithmetic already)");
  if (!is_gguf_path(o.model))
    throw std::invalid_argument("--kv-rows engine needs --model to be the decoder's GGUF: a checkpoint's K/V are not the decoder's rows");
  if (o.model != o.recipe) {
    const auto diff = gguf_weight_differences(*GgufFile::open(o.model), *GgufFile::open(o.recipe));
    if (!diff.empty()) throw std::invalid_argument(fmt::format("--kv-rows engine: the model's weights are not the decoder's ({})", diff[0]));
  }
  return true;
}

// --numerics auto: the mode that measured closest to the decoders for this GGUF's weights (docs/RESULTS.md, "Numerics
// that follow the decoder"): half products for float layer weights (F16/F32: the decoder's own values, 4x lower
// KL than bf16's), bf16 for quantized ones (no mode came closer on the K-quants people run, and bf16 is the fastest).
static ProductNumerics auto_numerics(const BackendOptions& o) {
  if (o.device != "cuda" || !is_gguf_path(o.model)) return ProductNumerics::bf16;
  const auto gguf = GgufFile::open(o.model);  // held: a temporary's tensors() would dangle in the loop
  for (const auto& t : gguf->tensors())
    if (t.name.rfind("blk.", 0) == 0 && t.ne.size() >= 2 && t.type != GgmlType::F16 && t.type != GgmlType::F32) return ProductNumerics::bf16;
  return ProductNumerics::half;
}

// --numerics: the decoder's arithmetic classes are for an engine that runs the decoder's GGUF on the GPU.
ProductNumerics resolve_numerics(const BackendOptions& o) {
  if (o.numerics == "auto") return auto_numerics(o);
  const ProductNumerics n = parse_product_numerics(o.numerics);
  if (n == ProductNumerics::bf16) return n;
  if (o.device != "cuda") throw std::invalid_argument(fmt::format("--numerics {} is for --device cuda (the CPU engine's faithful mode is the decoder's arithmetic)", o.numerics));
  if (!is_gguf_path(o.model)) throw std::invalid_argument(fmt::format("--numerics {} needs --model to be the decoder's GGUF", o.numerics));
  return n;
}

const Architecture& architecture(const std::string& name) {
  for (const auto& a : kArchitectures)
    if (name == a.name) return a;
  std::string known;
  for (const auto& a : kArchitectures) known += std::string(known.empty() ? "" : ", ") + a.name;
  throw std::invalid_argument(fmt::format("architecture {} is not one pdbridge prefills ({})", name, known));
}

std::string tensor_parallel_architectures() {
  std::string s;
  for (const auto& a : kArchitectures)
    if (a.tensor_parallel) s += std::string(s.empty() ? "" : ", ") + a.name;
  return s;
}

}  // namespace pdb
