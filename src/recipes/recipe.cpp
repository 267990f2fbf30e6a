#include "recipes/recipe.h"

#if !defined(PDBRIDGE_DECODE_SIDE_ONLY)
#include <cblas.h>
#endif

#include <cmath>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "common/xxhash_fast.h"
#include "formats/gguf.h"
#include "formats/numeric.h"
#include "numerics/decoder_numerics.h"
#include "numerics/gemm_lanes.h"
#include "numerics/rmsnorm.h"

namespace pdb {

std::unique_ptr<Recipe> make_llama_recipe(const GgufFile& g, int threads, int max_layers);
std::unique_ptr<Recipe> make_qwen3_recipe(const GgufFile& g, int threads, int max_layers);
std::unique_ptr<Recipe> make_qwen3moe_recipe(const GgufFile& g, int threads, int max_layers);
std::unique_ptr<Recipe> make_deepseek2_recipe(const GgufFile& g, int threads, int max_layers);

CacheSpec CacheSpec::decoder_default(GgmlType k, GgmlType v, int64_t head_dim) {
  CacheSpec s;
  s.k_type = k;
  s.v_type = v;
  auto quantized = [](GgmlType t) { return t != GgmlType::F32 && t != GgmlType::F16 && t != GgmlType::BF16; };
  s.rot_k = quantized(k) && head_dim % 64 == 0;
  s.rot_v = quantized(v) && head_dim % 64 == 0;
  return s;
}

std::unique_ptr<Recipe> Recipe::load(const std::string& gguf_path, int threads, int max_layers) {
  std::shared_ptr<const GgufFile> g = GgufFile::open(gguf_path);
  const std::string arch = g->architecture();
  std::unique_ptr<Recipe> r;
  if (arch == "llama") r = make_llama_recipe(*g, threads, max_layers);
  else if (arch == "qwen3") r = make_qwen3_recipe(*g, threads, max_layers);
  else if (arch == "qwen3moe") r = make_qwen3moe_recipe(*g, threads, max_layers);
  else if (arch == "deepseek2") r = make_deepseek2_recipe(*g, threads, max_layers);
  else throw std::runtime_error(fmt::format("{}: no recipe for decoder architecture '{}' (llama, qwen3, qwen3moe, deepseek2)", gguf_path, arch));
  const auto* te = g->find_tensor("token_embd.weight");
  if (te && te->ne.size() == 2 && te->ne[0] == r->info_.n_embd && can_dequantize(te->type)) r->gguf_ = g;
  return r;
}

void Recipe::decoder_embedding(const int32_t* tokens, int64_t rows, float* out) const {
  if (!gguf_) throw std::runtime_error("the decoder GGUF's token_embd.weight is missing or unreadable");
  const auto& t = gguf_->tensor("token_embd.weight");
  const int64_t n = info_.n_embd, vocab = t.ne[1];
  const size_t rb = ggml_row_bytes(t.type, n);
  for (int64_t r = 0; r < rows; ++r)
    if (tokens[r] < 0 || tokens[r] >= vocab) throw std::out_of_range(fmt::format("token {} outside the decoder's vocabulary", tokens[r]));
  parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) dequantize_row(t.type, gguf_->data(t) + size_t(tokens[r]) * rb, out + r * n, n);
  });
}

RecipeWeight Recipe::load_weight(const GgufFile& g, const std::string& name, const std::string& bias_name) const {
  const auto& t = g.tensor(name);
  if (t.ne.size() != 2) throw std::runtime_error(name + " is not a matrix");
  RecipeWeight w;
  w.type = t.type;
  w.cols = t.ne[0];
  w.rows = t.ne[1];
  if (!can_dequantize(t.type))
    throw std::runtime_error(fmt::format("{} has type {}, which the recipe cannot read", name, ggml_type_name(t.type)));
  const size_t rb = ggml_row_bytes(t.type, w.cols);
  if (has_q8_path(t.type)) {  // integer path: codes and scales only (a quarter of the f32 copy)
    w.q8 = unpack_q8_blocks(t.type, g.data(t), w.rows, w.cols);
  } else {
    if (ggmlnum::carries_q8_1_sums(t.type)) w.block_min = ggmlnum::q8_1_block_mins(t.type, g.data(t), w.rows, w.cols);
    w.w.resize(size_t(w.rows * w.cols));
    parallel_for(w.rows, threads_, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) dequantize_row(t.type, g.data(t) + r * rb, w.w.data() + r * w.cols, w.cols);
    });
  }
  if (const auto* bt = g.find_tensor(bias_name)) w.bias = g.to_f32(*bt);
  return w;
}

RecipeInfo read_recipe_info(const GgufFile& g) {
  RecipeInfo info;
  const std::string a = g.architecture();
  info.arch = a;
  info.n_layer = g.get_int(a + ".block_count");
  info.n_embd = g.get_int(a + ".embedding_length");
  const int64_t n_head = g.get_int(a + ".attention.head_count");
  info.n_head_kv = g.get_int_opt(a + ".attention.head_count_kv").value_or(n_head);
  info.head_dim = g.get_int_opt(a + ".attention.key_length").value_or(info.n_embd / n_head);
  if (a == "deepseek2") {
    // Only the MLA form caches one latent row (llama.cpp: both _mla keys present and non-zero); a
    // legacy deepseek2 GGUF caches full per-head K and V, which no recipe here computes.
    if (!g.get_int_opt(a + ".attention.key_length_mla").value_or(0) || !g.get_int_opt(a + ".attention.value_length_mla").value_or(0))
      throw std::runtime_error("deepseek2 GGUF without the MLA keys (key_length_mla, value_length_mla): convert it with MLA");
    info.kv_lora_rank = g.get_int(a + ".attention.kv_lora_rank");
    if (info.n_head_kv != 1 || g.get_int_opt(a + ".attention.value_length").value_or(0) != info.kv_lora_rank)
      throw std::runtime_error("deepseek2 GGUF: an MLA cache has one KV head and value_length == kv_lora_rank");
  } else if (a == "deepseek4") {
    info.cache_kind = CacheKind::pooled_sections;
    for (const auto& v : g.get(a + ".attention.compress_ratios").arr) info.compress_ratios.push_back(int32_t(v.u));
    info.window = g.get_int(a + ".attention.sliding_window");
    info.index_dim = g.get_int(a + ".attention.indexer.key_length");
    info.index_heads = g.get_int(a + ".attention.indexer.head_count");
    info.hc_count = g.get_int(a + ".hyper_connection.count");
    info.hc_iterations = g.get_int(a + ".hyper_connection.sinkhorn_iterations");
    info.hc_eps = float(g.get_float(a + ".hyper_connection.epsilon"));
    info.compress_rope_base = float(g.get_float(a + ".attention.compress_rope_freq_base"));
  } else if (g.get_int_opt(a + ".attention.value_length").value_or(info.head_dim) != info.head_dim) {
    throw std::runtime_error("decoders with different K and V head sizes are not supported");
  }
  info.norm_eps = float(g.get_float(a + ".attention.layer_norm_rms_epsilon"));
  auto& r = info.rope;
  r.mode = a == "qwen3" || a == "qwen3moe" ? RopeMode::Neox : RopeMode::Norm;
  r.n_dims = int(g.get_int_opt(a + ".rope.dimension_count").value_or(info.head_dim));
  r.freq_base = float(g.get_float_opt(a + ".rope.freq_base").value_or(10000.0));
  const std::string stype = g.find(a + ".rope.scaling.type") ? g.get_string(a + ".rope.scaling.type") : "none";
  const double factor = g.get_float_opt(a + ".rope.scaling.factor").value_or(0.0);
  r.n_ctx_orig = int(g.get_int_opt(a + ".rope.scaling.original_context_length").value_or(g.get_int(a + ".context_length")));
  if (stype == "linear" || stype == "yarn") r.freq_scale = factor > 0 ? float(1.0 / factor) : 1.0f;
  else if (stype != "none") throw std::runtime_error("unsupported rope scaling type " + stype);
  if (stype == "yarn") {
    r.ext_factor = float(g.get_float_opt(a + ".rope.scaling.yarn_ext_factor").value_or(1.0));
    r.attn_factor = float(g.get_float_opt(a + ".rope.scaling.yarn_attn_factor").value_or(1.0));
    r.beta_fast = float(g.get_float_opt(a + ".rope.scaling.yarn_beta_fast").value_or(32.0));
    r.beta_slow = float(g.get_float_opt(a + ".rope.scaling.yarn_beta_slow").value_or(1.0));
    if (a == "deepseek2") {
      // llama_context's YaRN attention factor for deepseek2 (src/llama-context.cpp): with a log
      // multiplier, get_mscale(f, m_all) / get_mscale(f, m_all) = 1, then divided by 1 + 0.1 ln f, which
      // the kernel multiplies back: cos/sin keep magnitude ~1. Only the server's own CLI changes it.
      auto get_mscale = [](float scale, float m) { return scale <= 1.0f ? 1.0f : (0.1f * m * logf(scale) + 1.0f); };
      const float f = 1.0f / r.freq_scale;
      const float log_mul = float(g.get_float_opt(a + ".rope.scaling.yarn_log_multiplier").value_or(0.0)) / 0.1f;
      float attn = log_mul != 0.0f ? get_mscale(f, log_mul) / get_mscale(f, log_mul) : get_mscale(f, 1.0f);
      attn *= 1.0f / (1.0f + 0.1f * logf(f));
      attn *= float(g.get_float_opt(a + ".rope.scaling.attn_factor").value_or(1.0));
      r.attn_factor = attn;
      r.beta_fast = 32.0f;  // deepseek2 does not read the beta keys (llama-hparams defaults)
      r.beta_slow = 1.0f;
    }
  }
  if (const auto* rf = g.find_tensor("rope_freqs.weight")) r.freq_factors = g.to_f32(*rf);
  XXH3_state_t* hs = XXH3_createState();
  XXH3_64bits_reset(hs);
  for (int64_t l = 0; l < info.n_layer; ++l)
    for (const char* t : {"attn_norm.weight", "attn_k.weight", "attn_v.weight", "attn_k_norm.weight", "attn_k.bias", "attn_v.bias",
                          "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight",
                          // deepseek4's cache inputs (recipes/deepseek4.cpp)
                          "attn_kv.weight", "hc_attn_fn.weight", "hc_attn_base.weight", "hc_attn_scale.weight", "attn_compressor_kv.weight",
                          "attn_compressor_gate.weight", "attn_compressor_ape.weight", "attn_compressor_norm.weight",
                          "indexer_compressor_kv.weight", "indexer_compressor_gate.weight", "indexer_compressor_ape.weight",
                          "indexer_compressor_norm.weight"})
      if (const auto* ti = g.find_tensor(fmt::format("blk.{}.{}", l, t))) XXH3_64bits_update(hs, g.data(*ti), ti->n_bytes());
  if (const auto* rf = g.find_tensor("rope_freqs.weight")) XXH3_64bits_update(hs, g.data(*rf), rf->n_bytes());
  info.weights_hash = fmt::format("{:016x}", XXH3_64bits_digest(hs));
  XXH3_freeState(hs);
  return info;
}

nlohmann::json recipe_geometry(const RecipeInfo& i) {
  const auto& r = i.rope;
  nlohmann::json j = {{"arch", i.arch}, {"n_layer", i.n_layer}, {"n_embd", i.n_embd}, {"n_head_kv", i.n_head_kv}, {"head_dim", i.head_dim},
          {"norm_eps", i.norm_eps}, {"rope_mode", r.mode == RopeMode::Neox ? "neox" : "norm"}, {"rope_n_dims", r.n_dims},
          {"rope_freq_base", r.freq_base}, {"rope_freq_scale", r.freq_scale}, {"rope_ext_factor", r.ext_factor},
          {"rope_attn_factor", r.attn_factor}, {"rope_beta_fast", r.beta_fast}, {"rope_beta_slow", r.beta_slow},
          {"rope_n_ctx_orig", r.n_ctx_orig}, {"rope_freq_factors", r.freq_factors}, {"weights_hash", i.weights_hash}};
  if (i.mla()) j["kv_lora_rank"] = i.kv_lora_rank;  // absent for the others: their fingerprints stay as they were
  if (!i.compress_ratios.empty())
    j["dsv4"] = {{"compress_ratios", i.compress_ratios}, {"window", i.window}, {"index_dim", i.index_dim}, {"index_heads", i.index_heads},
                 {"hc_count", i.hc_count}, {"hc_iterations", i.hc_iterations}, {"hc_eps", i.hc_eps}, {"compress_rope_base", i.compress_rope_base}};
  return j;
}

std::string recipe_fingerprint(const RecipeInfo& info) {
  const std::string s = "pdbridge-recipe-v1:" + recipe_geometry(info).dump();
  return fmt::format("{:016x}", XXH3_64bits(s.data(), s.size()));
}

void Recipe::load_common(const GgufFile& g, const std::string& a, int max_layers, bool kv_projections) {
  info_ = read_recipe_info(g);
  if (info_.arch != a) throw std::logic_error("recipe/arch mismatch");
  loaded_layers_ = max_layers > 0 ? std::min<int64_t>(max_layers, info_.n_layer) : info_.n_layer;
  attn_norm_all_.resize(size_t(info_.n_layer * info_.n_embd));
  for (int64_t l = 0; l < loaded_layers_; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    auto n = g.to_f32(g.tensor(p + "attn_norm.weight"));
    if (int64_t(n.size()) != info_.n_embd) throw std::runtime_error(p + "attn_norm.weight has the wrong size");
    std::copy(n.begin(), n.end(), attn_norm_all_.begin() + l * info_.n_embd);
    if (!kv_projections) continue;
    wk_.push_back(load_weight(g, p + "attn_k.weight", p + "attn_k.bias"));
    wv_.push_back(load_weight(g, p + "attn_v.weight", p + "attn_v.bias"));
  }
  if (!kv_projections) return;
  if (wk_[0].rows != info_.n_embd_kv() || wk_[0].cols != info_.n_embd) throw std::runtime_error("attn_k has unexpected shape");
}

void Recipe::attn_input(int layer, const float* h, int64_t rows, float* x) const {
  const float* w = attn_norm_all_.data() + layer * info_.n_embd;
  parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
    rmsnorm_rows(h + b * info_.n_embd, w, x + b * info_.n_embd, e - b, info_.n_embd, info_.norm_eps);
  });
}

int host_simd_width() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return 16;
  if (__builtin_cpu_supports("avx2") || __builtin_cpu_supports("avx")) return 8;
  return 0;
#elif defined(__aarch64__)
  return 4;
#else
  return 0;
#endif
}

float dot_lanes(const float* a, const float* b, int64_t k, int kn) {
  float acc[16] = {};
  for (int64_t l = 0; l < k; l += kn)
    for (int i = 0; i < kn; ++i) acc[i] = std::fma(a[l + i], b[l + i], acc[i]);
  return fold_lanes(acc, kn);
}

static void add_bias(const RecipeWeight& w, int64_t rows, float* y) {
  if (!w.bias.empty())
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < w.rows; ++o) y[r * w.rows + o] += w.bias[o];
}

void Recipe::project(const RecipeWeight& w, const float* x, int64_t rows, int simd_width, float* y) const {
  // The decoder does not multiply the f32 activation with a reduced-precision weight: it first
  // converts the activation to the weight's dot type. Do the same, then an f32 GEMM (Q8_0/Q4_0:
  // integer block sums, as ggml-cpu).
  std::vector<float> xa, q8_1_corrections;
  const float* xs = x;
  const int64_t K = w.cols;
  auto convert = [&](auto fn) {
    xa.resize(size_t(rows * K));
    parallel_for(rows, threads_, [&](int64_t b, int64_t e) { for (int64_t r = b; r < e; ++r) fn(x + r * K, xa.data() + r * K); });
    xs = xa.data();
  };
  switch (w.type) {
    case GgmlType::F32: break;
    case GgmlType::F16: convert([K](const float* s, float* d) { for (int64_t i = 0; i < K; ++i) d[i] = round_f16(s[i]); }); break;
    case GgmlType::BF16: convert([K](const float* s, float* d) { for (int64_t i = 0; i < K; ++i) d[i] = round_bf16(s[i]); }); break;
    default:
      if (!w.q8.q.empty()) {  // Q8_0/Q4_0: ggml-cpu's integer block sums (the GPU recipe's order too)
        parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
          std::vector<int8_t> qx(size_t((e - b) * K));
          std::vector<float> dx(size_t((e - b) * K / 32));
          quantize_rows_q8(x + b * K, e - b, K, qx.data(), dx.data());
          q8_block_gemm(qx.data(), dx.data(), w.q8, e - b, y + b * w.rows);
        });
        add_bias(w, rows, y);
        return;
      }
      // other block weights: the activation as ggml-cpu quantizes it for the weight's dot type (Q8_0, or Q8_K for
      // the K-quants and IQ types), then an f32 GEMM
      if (K % 32 != 0) throw std::runtime_error("quantized weight with a row not a multiple of 32");
      if (!w.block_min.empty()) {  // Q4_1/Q5_1: the min's term as ggml-cpu's Q8_1 block sums make it, added after
        q8_1_corrections.resize(size_t(rows * (K / 32)));
        parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
          ggmlnum::q8_1_sum_corrections(x + b * K, e - b, K, q8_1_corrections.data() + b * (K / 32));
        });
      }
      convert([K, aq = ggmlnum::act_quant_for(w.type)](const float* s, float* d) {
        std::copy_n(s, K, d);
        ggmlnum::round_through(aq, d, 1, K);
      });
  }
  const bool lanes = (simd_width == 4 || simd_width == 8 || simd_width == 16) && K % simd_width == 0 &&
                     (w.type == GgmlType::F32 || w.type == GgmlType::F16 || w.type == GgmlType::BF16);
  if (lanes) {
    parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t o = 0; o < w.rows; ++o) y[r * w.rows + o] = dot_lanes(w.w.data() + o * K, xs + r * K, K, simd_width);
    });
  } else {
#if defined(PDBRIDGE_DECODE_SIDE_ONLY)
    // the decode side has no BLAS: the front door's calibration multiplies one probe's rows (its summation order is
    // neither OpenBLAS's nor ggml's, as OpenBLAS's already differs between CPUs: quantized weights class by the probe)
    parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t o = 0; o < w.rows; ++o) {
          const float *a = w.w.data() + o * K, *x = xs + r * K;
          float acc = 0;
          for (int64_t i = 0; i < K; ++i) acc = std::fma(a[i], x[i], acc);
          y[r * w.rows + o] = acc;
        }
    });
#else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(w.rows), int(K), 1.0f, xs, int(K), w.w.data(), int(K), 0.0f, y, int(w.rows));
#endif
  }
  if (!q8_1_corrections.empty()) {  // y[r][o] += sum over blocks of m[o][b] * c[r][b] (ggml-cpu adds the mins' sum last)
    const int64_t nb = K / 32;
    parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        for (int64_t o = 0; o < w.rows; ++o) {
          const float *m = w.block_min.data() + o * nb, *c = q8_1_corrections.data() + r * nb;
          float acc = 0.0f;
          for (int64_t k = 0; k < nb; ++k) acc += m[k] * c[k];
          y[r * w.rows + o] += acc;
        }
    });
  }
  add_bias(w, rows, y);
}

void Recipe::kv_f32(int layer, const float* h, int64_t rows, int64_t pos0, int simd, float* k, float* v) const {
  const int64_t E = info_.n_embd, C = info_.n_embd_kv(), hd = info_.head_dim;
  std::vector<float> x(static_cast<size_t>(rows * E));
  attn_input(layer, h, rows, x.data());
  project(wk_[size_t(layer)], x.data(), rows, simd, k);
  project(wv_[size_t(layer)], x.data(), rows, simd, v);
  parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
    std::vector<float> cache(static_cast<size_t>(hd));
    for (int64_t r = b; r < e; ++r) {
      ggml_rope_cache(info_.rope, pos0 + r, cache.data());
      for (int64_t head = 0; head < info_.n_head_kv; ++head) {
        float* kh = k + r * C + head * hd;
        k_head_before_rope(layer, kh);
        ggml_rope_apply(info_.rope, cache.data(), kh);
      }
    }
  });
}

void Recipe::kv_rows(int layer, const float* h, int64_t rows, int64_t pos0, const CacheSpec& spec,
                     std::vector<uint8_t>& k_out, std::vector<uint8_t>& v_out) const {
  if (layer < 0 || layer >= loaded_layers_) throw std::out_of_range(fmt::format("recipe layer {} not loaded", layer));
  const int64_t C = info_.n_embd_kv();
  std::vector<float> k(static_cast<size_t>(rows * C)), v(size_t(rows * C));
  kv_f32(layer, h, rows, pos0, spec.simd_width, k.data(), v.data());
  if (spec.rot_k) hadamard_rows(k.data(), rows * C, k_rotation_size(info_.head_dim));
  if (spec.rot_v) hadamard_rows(v.data(), rows * C, kVRotationSize);
  k_out.resize(ggml_row_bytes(spec.k_type, C) * size_t(rows));
  v_out.resize(ggml_row_bytes(spec.v_type, C) * size_t(rows));
  rows_to_cache_type(spec.k_type, k.data(), rows, C, k_out.data());
  rows_to_cache_type(spec.v_type, v.data(), rows, C, v_out.data());
}

int64_t k_rotation_size(int64_t head_dim) {
  int64_t n = 64;
  do { n *= 2; } while (head_dim % n == 0);
  return n / 2;
}

void hadamard_rows(float* x, int64_t n_total, int64_t n) {
  const float scale = 1.0f / sqrtf(float(n));
  for (int64_t base = 0; base + n <= n_total; base += n) {
    float* r = x + base;
    for (int64_t j = 0; j < n; ++j) r[j] = r[j] * scale;
    for (int64_t len = 1; len < n; len <<= 1)
      for (int64_t i = 0; i < n; i += 2 * len)
        for (int64_t j = 0; j < len; ++j) {
          const float u = r[i + j], v = r[i + len + j];
          r[i + j] = u + v;
          r[i + len + j] = u - v;
        }
  }
}

void rows_to_cache_type(GgmlType t, const float* x, int64_t rows, int64_t cols, uint8_t* out) {
  const size_t rb = ggml_row_bytes(t, cols);
  for (int64_t r = 0; r < rows; ++r) quantize_row(t, x + r * cols, out + r * rb, cols, Q8Rounding::TiesEven);
}

}  // namespace pdb
