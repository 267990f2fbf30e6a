#include "model/cpu_engine.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "formats/ggml_types.h"
#include "formats/numeric.h"
#include "formats/safetensors.h"
#include "formats/hf_to_gguf.h"
#include "numerics/decoder_numerics.h"
#include "recipes/recipe.h"
#include "numerics/gemm_lanes.h"
#include "model/cpu_engine_mla.h"
#include "model/moe_ffn.h"
#include "numerics/rmsnorm.h"

namespace pdb {

struct CpuEngine::Layer {
  std::vector<float> in_norm, post_norm, q_norm, k_norm;
  std::vector<float> wq, wk, wv, wo, wg, wu, wd;  // HF layout [out x in]; wg/wu/wd empty in MoE layers
  MoeWeights moe;                                 // qwen3moe: the router and the experts
};

namespace {

std::vector<float> load_matrix(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::string& name,
                               int64_t rows, int64_t cols) {
  const StTensor& t = ck.get(name);
  if (t.shape.size() != 2 || t.shape[0] != rows || t.shape[1] != cols)
    throw std::runtime_error(fmt::format("{}: shape does not match config.json ({} x {})", name, rows, cols));
  if (t.dtype == StDtype::F8_E4M3) {
    const std::string sname = name.substr(0, name.size() - 6) + "weight_scale_inv";
    if (!ck.find(sname)) throw std::runtime_error(name + " is FP8 but " + sname + " is missing");
    auto s = ck.to_f32(sname);
    const int64_t sr = (rows + c.fp8_block_rows - 1) / c.fp8_block_rows, sc = (cols + c.fp8_block_cols - 1) / c.fp8_block_cols;
    if (int64_t(s.size()) != sr * sc) throw std::runtime_error(sname + " has the wrong shape for the block size");
    std::vector<float> w(static_cast<size_t>(rows * cols));
    dequantize_block_fp8(t.data, rows, cols, s.data(), c.fp8_block_rows, c.fp8_block_cols, w.data());
    return w;
  }
  return ck.to_f32(name);
}

std::vector<float> load_vector(const SafetensorsCheckpoint& ck, const std::string& name, int64_t n) {
  auto v = ck.to_f32(name);
  if (int64_t(v.size()) != n) throw std::runtime_error(fmt::format("{}: {} elements, expected {}", name, v.size(), n));
  return v;
}

// y[rows x out] = x[rows x in] W^T
void gemm_xwt(const float* x, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, float* y) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(out), int(in), 1.0f, x, int(in), w.data(), int(in), 0.0f, y, int(out));
}

}  // namespace

CpuEngine::CpuEngine(const std::string& hf_dir, int threads) : cfg_(HfConfig::load(hf_dir)), threads_(threads) {
  if (cfg_.mla()) {
    load_mla(hf_dir);
    return;
  }
  openblas_set_num_threads(threads);
  auto ck = SafetensorsCheckpoint::open(hf_dir);
  const auto& c = cfg_;
  const int64_t H = c.hidden_size, F = c.intermediate_size, hd = c.head_dim;
  embed_ = load_matrix(*ck, c, "model.embed_tokens.weight", c.vocab_size, H);
  const StDtype wdt = ck->get("model.layers.0.self_attn.k_proj.weight").dtype;
  act_precision_ = wdt == StDtype::F16 ? 16 : wdt == StDtype::BF16 ? 17 : 32;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    auto L = std::make_unique<Layer>();
    L->in_norm = load_vector(*ck, p + "input_layernorm.weight", H);
    L->post_norm = load_vector(*ck, p + "post_attention_layernorm.weight", H);
    L->wq = load_matrix(*ck, c, p + "self_attn.q_proj.weight", c.num_heads * hd, H);
    L->wk = load_matrix(*ck, c, p + "self_attn.k_proj.weight", c.num_kv_heads * hd, H);
    L->wv = load_matrix(*ck, c, p + "self_attn.v_proj.weight", c.num_kv_heads * hd, H);
    L->wo = load_matrix(*ck, c, p + "self_attn.o_proj.weight", H, c.num_heads * hd);
    if (c.moe()) {
      auto& m = L->moe;
      m.n_expert = c.num_experts; m.n_used = c.num_experts_per_tok; m.hidden = H; m.ff = c.moe_intermediate_size;
      m.norm_topk = true;  // llama.cpp's qwen3moe, whatever norm_topk_prob says
      m.router = load_matrix(*ck, c, p + "mlp.gate.weight", m.n_expert, H);
      for (int64_t e = 0; e < m.n_expert; ++e) {
        const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
        m.gate.push_back(load_matrix(*ck, c, x + "gate_proj.weight", m.ff, H));
        m.up.push_back(load_matrix(*ck, c, x + "up_proj.weight", m.ff, H));
        m.down.push_back(load_matrix(*ck, c, x + "down_proj.weight", H, m.ff));
      }
    } else {
      L->wg = load_matrix(*ck, c, p + "mlp.gate_proj.weight", F, H);
      L->wu = load_matrix(*ck, c, p + "mlp.up_proj.weight", F, H);
      L->wd = load_matrix(*ck, c, p + "mlp.down_proj.weight", H, F);
    }
    if (c.qk_norm()) {
      L->q_norm = load_vector(*ck, p + "self_attn.q_norm.weight", hd);
      L->k_norm = load_vector(*ck, p + "self_attn.k_norm.weight", hd);
    }
    layers_.push_back(std::move(L));
  }
  for (double f : c.inv_freq()) inv_freq_.push_back(float(f));
  rope_scale_ = float(c.attention_scaling());
  // The decoder's view of the same RoPE (what llama.cpp derives from the converted GGUF).
  auto& r = ggml_rope_;
  r.n_dims = int(hd);
  r.freq_base = float(c.rope_theta);
  r.mode = c.qk_norm() ? RopeMode::Neox : RopeMode::Norm;
  r.n_ctx_orig = int(c.rope_scaling.original_max_position_embeddings ? c.rope_scaling.original_max_position_embeddings : c.max_position_embeddings);
  faithful_ok_ = true;
  switch (c.rope_scaling.type) {
    case RopeScalingType::None: break;
    case RopeScalingType::Linear: r.freq_scale = float(1.0 / c.rope_scaling.factor); break;
    case RopeScalingType::Yarn:
      r.freq_scale = float(1.0 / c.rope_scaling.factor);
      r.ext_factor = 1.0f;
      r.beta_fast = float(c.rope_scaling.beta_fast);
      r.beta_slow = float(c.rope_scaling.beta_slow);
      if (c.rope_scaling.attention_factor) faithful_ok_ = false;  // llama.cpp folds it differently
      break;
    case RopeScalingType::Llama3: r.freq_factors = llama3_rope_factors(c); break;
  }
  if (c.arch == "llama")
    for (auto& L : layers_) {  // the converter's row order, so attention sums in the decoder's order
      std::vector<float> q(L->wq.size()), k(L->wk.size());
      permute_qk_rows(L->wq.data(), q.data(), c.num_heads, hd, H);
      permute_qk_rows(L->wk.data(), k.data(), c.num_kv_heads, hd, H);
      wq_perm_.push_back(std::move(q));
      wk_perm_.push_back(std::move(k));
    }
}

CpuEngine::~CpuEngine() = default;

void CpuEngine::check_tokens(const std::vector<int32_t>& tokens) const {
  for (int32_t t : tokens)
    if (t < 0 || t >= cfg_.vocab_size) throw std::invalid_argument(fmt::format("token id {} outside the vocabulary ({})", t, cfg_.vocab_size));
}

void CpuEngine::embed_chunk(const std::vector<int32_t>& tokens, int64_t p0, int64_t n, std::vector<float>& h) const {
  const int64_t H = cfg_.hidden_size;
  h.resize(size_t(n * H));
  for (int64_t r = 0; r < n; ++r) std::copy_n(embed_.data() + int64_t(tokens[size_t(p0 + r)]) * H, H, h.data() + r * H);
}

void CpuEngine::round_weights_to(int bits) {
  if (bits != 16 && bits != 17) throw std::invalid_argument("round_weights_to: 16 (f16) or 17 (bf16)");
  if (cfg_.mla()) return;  // the MLA forward multiplies the checkpoint's own values (its arithmetic is not mirrored yet)
  auto round = [&](std::vector<float>& w) {
    parallel_for(int64_t(w.size()), threads_, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) w[size_t(i)] = bits == 16 ? round_f16(w[size_t(i)]) : round_bf16(w[size_t(i)]);
    });
  };
  round(embed_);
  for (auto& L : layers_) {
    for (auto* w : {&L->wq, &L->wk, &L->wv, &L->wo, &L->wg, &L->wu, &L->wd}) round(*w);
    round(L->moe.router);  // an F32 tensor in the GGUF, holding the checkpoint's (rounded) values
    for (auto* set : {&L->moe.gate, &L->moe.up, &L->moe.down})
      for (auto& w : *set) round(w);
  }
  for (auto& w : wq_perm_) round(w);
  for (auto& w : wk_perm_) round(w);
}

int64_t CpuEngine::prefill(const std::vector<int32_t>& tokens, int64_t chunk, int lanes, const LayerHook& hook,
                           const std::function<bool()>& cancelled, const KvRounding& kv_round, const DecoderCacheSpec& cache,
                           ResumePoint resume, std::shared_ptr<EngineState>* keep) {
  if (cfg_.mla()) {
    if (resume.tokens > 0 || keep) throw std::invalid_argument("the deepseek2 forward does not resume from a prefix state");
    return prefill_mla(tokens, chunk, lanes, hook, cancelled, kv_round);
  }
  const auto& c = cfg_;
  const int64_t T = int64_t(tokens.size()), H = c.hidden_size, F = c.intermediate_size, hd = c.head_dim;
  const int64_t nh = c.num_heads, nkv = c.num_kv_heads, qd = nh * hd, kvd = nkv * hd, group = nh / nkv;
  const float eps = float(c.rms_norm_eps), scale = 1.0f / std::sqrt(float(hd));
  if (chunk <= 0) chunk = 512;
  check_tokens(tokens);
  // The engine's own K/V for the whole prompt (f32), per layer.
  std::vector<std::vector<float>> kcache(size_t(c.num_layers)), vcache(size_t(c.num_layers));
  const size_t q8_row = size_t(kvd / 32 * 34);
  const bool q8_path = lanes && faithful_ok_ && cache.q8_0 && hd % 32 == 0;
  std::vector<std::vector<uint8_t>> kq8(q8_path ? size_t(c.num_layers) : 0);
  for (auto& kq : kq8) kq.resize(size_t(T) * q8_row);
  for (auto& k : kcache) k.resize(size_t(T * kvd));
  for (auto& v : vcache) v.resize(size_t(T * kvd));
  const int64_t start = resume.tokens;
  if (start > 0) {
    const auto* st = dynamic_cast<const CpuEngineState*>(resume.state);
    if (!st || st->kv_dim != kvd || int64_t(st->k.size()) != c.num_layers || st->tokens < start || start > T ||
        st->kq8.empty() != kq8.empty())
      throw std::invalid_argument("the resume state is not this engine's for this cache spec");
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::copy_n(st->k[size_t(l)].begin(), start * kvd, kcache[size_t(l)].begin());
      std::copy_n(st->v[size_t(l)].begin(), start * kvd, vcache[size_t(l)].begin());
      if (!kq8.empty()) std::copy_n(st->kq8[size_t(l)].begin(), size_t(start) * q8_row, kq8[size_t(l)].begin());
    }
  }
  // The state of the positions processed so far, handed over however the forward ends.
  int64_t processed = start;
  struct Keep {
    std::shared_ptr<EngineState>* out;
    std::function<void()> f;
    ~Keep() { if (out) f(); }
  } keep_on_exit{keep, [&] {
    auto st = std::make_shared<CpuEngineState>();
    st->tokens = processed;
    st->kv_dim = kvd;
    for (auto* src : {&kcache, &vcache}) {
      auto& dst = src == &kcache ? st->k : st->v;
      dst = std::move(*src);
      for (auto& x : dst) { x.resize(size_t(processed * kvd)); if (processed < T) x.shrink_to_fit(); }
    }
    st->kq8 = std::move(kq8);
    for (auto& x : st->kq8) { x.resize(size_t(processed) * q8_row); if (processed < T) x.shrink_to_fit(); }
    *keep = std::move(st);
  }};
  if (lanes && (H % lanes || (!c.moe() && F % lanes) || qd % lanes || hd % lanes)) lanes = 0;
  std::vector<float> xr;
  auto gemm = [&](const float* xx, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, float* y) {
    if (act_precision_ != 32) {
      xr.assign(xx, xx + rows * in);
      for (auto& e : xr) e = act_precision_ == 16 ? round_f16(e) : round_bf16(e);
      xx = xr.data();
    }
    if (lanes) gemm_lanes(xx, w.data(), y, rows, out, in, lanes, threads_);
    else gemm_xwt(xx, w, rows, in, out, y);
  };
  std::vector<float> h, x, q, k, v, att, o, g, u;
  for (int64_t p0 = start; p0 < T; p0 += chunk) {
    const int64_t n = std::min(chunk, T - p0);
    embed_chunk(tokens, p0, n, h);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      if (cancelled && cancelled()) return p0;
      const Layer& L = *layers_[size_t(l)];
      hook(int(l), h.data(), n, p0);
      x.resize(size_t(n * H));
      rmsnorm_rows(h.data(), L.in_norm.data(), x.data(), n, H, eps);
      q.resize(size_t(n * qd));
      k.resize(size_t(n * kvd));
      v.resize(size_t(n * kvd));
      const bool faithful = lanes && faithful_ok_;
      const bool permuted = faithful && c.arch == "llama";
      gemm(x.data(), permuted ? wq_perm_[size_t(l)] : L.wq, n, H, qd, q.data());
      gemm(x.data(), permuted ? wk_perm_[size_t(l)] : L.wk, n, H, kvd, k.data());
      gemm(x.data(), L.wv, n, H, kvd, v.data());
      if (c.qk_norm()) {
        rmsnorm_rows(q.data(), L.q_norm.data(), q.data(), n * nh, hd, eps);
        rmsnorm_rows(k.data(), L.k_norm.data(), k.data(), n * nkv, hd, eps);
      }
      if (faithful) {
        parallel_for(n, threads_, [&](int64_t b, int64_t e) {
          std::vector<float> cache(static_cast<size_t>(hd));
          for (int64_t r = b; r < e; ++r) {
            ggml_rope_cache(ggml_rope_, p0 + r, cache.data());
            for (int64_t hh = 0; hh < nh; ++hh) ggml_rope_apply(ggml_rope_, cache.data(), q.data() + r * qd + hh * hd);
            for (int64_t hh = 0; hh < nkv; ++hh) ggml_rope_apply(ggml_rope_, cache.data(), k.data() + r * kvd + hh * hd);
          }
        });
      } else
      // HF rotate_half RoPE on both q and k
      parallel_for(n, threads_, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const float pos = float(p0 + r);
          for (int64_t i = 0; i < hd / 2; ++i) {
            const float ang = pos * inv_freq_[size_t(i)];
            const float cs = std::cos(ang) * rope_scale_, sn = std::sin(ang) * rope_scale_;
            auto rot = [&](float* head) {
              const float a = head[i], bb = head[i + hd / 2];
              head[i] = a * cs - bb * sn;
              head[i + hd / 2] = bb * cs + a * sn;
            };
            for (int64_t hh = 0; hh < nh; ++hh) rot(q.data() + r * qd + hh * hd);
            for (int64_t hh = 0; hh < nkv; ++hh) rot(k.data() + r * kvd + hh * hd);
          }
        }
      });
      if (q8_path) {
        // what llama.cpp stores: rotated, Q8_0-quantized rows (V kept dequantized, still rotated)
        std::vector<uint8_t> tmp(q8_row);
        for (int64_t r = 0; r < n; ++r) {
          float* kr = k.data() + r * kvd;
          float* vr = v.data() + r * kvd;
          if (cache.rot_k) hadamard_rows(kr, kvd, cache.k_rot_n);
          if (cache.rot_v) hadamard_rows(vr, kvd, cache.v_rot_n);
          quantize_row(GgmlType::Q8_0, kr, kq8[size_t(l)].data() + size_t(p0 + r) * q8_row, kvd, Q8Rounding::TiesEven);
          quantize_row(GgmlType::Q8_0, vr, tmp.data(), kvd, Q8Rounding::TiesEven);
          dequantize_row(GgmlType::Q8_0, tmp.data(), vr, kvd);
        }
      } else if (kv_round) {
        kv_round(k.data(), n, kvd, false);
        kv_round(v.data(), n, kvd, true);
      }
      std::copy(k.begin(), k.end(), kcache[size_t(l)].begin() + p0 * kvd);
      std::copy(v.begin(), v.end(), vcache[size_t(l)].begin() + p0 * kvd);
      // causal attention, one head at a time, keys [0, p0 + n)
      const int64_t nk = p0 + n;
      att.assign(size_t(n * qd), 0.0f);
      const float* K = kcache[size_t(l)].data();
      const float* V = vcache[size_t(l)].data();
      if (q8_path) {
        parallel_for(n * nh, threads_, [&](int64_t b, int64_t e) {
          std::vector<float> qh(static_cast<size_t>(hd));
          std::vector<uint8_t> qq(size_t(hd / 32 * 34));
          for (int64_t idx = b; idx < e; ++idx) {
            const int64_t r = idx / nh, hh = idx % nh, kvh = hh / group;
            std::copy_n(q.data() + r * qd + hh * hd, hd, qh.data());
            if (cache.rot_k) hadamard_rows(qh.data(), hd, cache.k_rot_n);
            quantize_row(GgmlType::Q8_0, qh.data(), qq.data(), hd, Q8Rounding::TiesEven);
            float* out = att.data() + r * qd + hh * hd;
            ggmlnum::flash_attn_row_q8(qq.data(), kq8[size_t(l)].data() + size_t(kvh * hd / 32 * 34), int64_t(q8_row), V + kvh * hd, kvd,
                                       p0 + r + 1, hd, scale, out);
            if (cache.rot_v) hadamard_rows(out, hd, cache.v_rot_n);
          }
        });
      } else if (faithful) {
        parallel_for(n * nh, threads_, [&](int64_t b, int64_t e) {
          for (int64_t idx = b; idx < e; ++idx) {
            const int64_t r = idx / nh, hh = idx % nh, kvh = hh / group;
            ggmlnum::flash_attn_row(q.data() + r * qd + hh * hd, K + kvh * hd, V + kvh * hd, kvd, p0 + r + 1, hd, scale,
                                    att.data() + r * qd + hh * hd, lanes);
          }
        });
      } else if (lanes) {
        // Row-independent attention: every query sums its keys in one fixed order.
        parallel_for(n * nh, threads_, [&](int64_t b, int64_t e) {
          std::vector<float> sc(static_cast<size_t>(nk));
          for (int64_t idx = b; idx < e; ++idx) {
            const int64_t r = idx / nh, hh = idx % nh, kvh = hh / group, lim = p0 + r + 1;
            const float* qr = q.data() + r * qd + hh * hd;
            float m = -INFINITY;
            for (int64_t j = 0; j < lim; ++j) {
              sc[size_t(j)] = dot_lanes(qr, K + j * kvd + kvh * hd, hd, lanes) * scale;
              m = std::max(m, sc[size_t(j)]);
            }
            double sum = 0;
            for (int64_t j = 0; j < lim; ++j) { sc[size_t(j)] = std::exp(sc[size_t(j)] - m); sum += sc[size_t(j)]; }
            const float inv = float(1.0 / sum);
            float* out = att.data() + r * qd + hh * hd;
            for (int64_t d = 0; d < hd; ++d) out[d] = 0.0f;
            for (int64_t j = 0; j < lim; ++j) {
              const float p = sc[size_t(j)] * inv;
              const float* vr = V + j * kvd + kvh * hd;
              for (int64_t d = 0; d < hd; ++d) out[d] = std::fma(p, vr[d], out[d]);
            }
          }
        });
      } else {  // heads in sequence: OpenBLAS parallelizes each GEMM
        const int64_t hb = 0, he = nh;
        std::vector<float> s(static_cast<size_t>(n * nk));
        for (int64_t hh = hb; hh < he; ++hh) {
          const int64_t kvh = hh / group;
          // s[n x nk] = Q_h K_h^T
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(nk), int(hd), scale, q.data() + hh * hd, int(qd),
                      K + kvh * hd, int(kvd), 0.0f, s.data(), int(nk));
          for (int64_t r = 0; r < n; ++r) {
            float* sr = s.data() + r * nk;
            const int64_t lim = p0 + r + 1;
            float m = -INFINITY;
            for (int64_t j = 0; j < lim; ++j) m = std::max(m, sr[j]);
            double sum = 0;
            for (int64_t j = 0; j < lim; ++j) { sr[j] = std::exp(sr[j] - m); sum += sr[j]; }
            const float inv = float(1.0 / sum);
            for (int64_t j = 0; j < lim; ++j) sr[j] *= inv;
            for (int64_t j = lim; j < nk; ++j) sr[j] = 0.0f;
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(hd), int(nk), 1.0f, s.data(), int(nk),
                      V + kvh * hd, int(kvd), 0.0f, att.data() + hh * hd, int(qd));
        }
      }
      o.resize(size_t(n * H));
      gemm(att.data(), L.wo, n, qd, H, o.data());
      for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
      rmsnorm_rows(h.data(), L.post_norm.data(), x.data(), n, H, eps);
      if (c.moe()) {
        moe_ffn(L.moe, x.data(), n, faithful ? lanes : 0, act_precision_, threads_, o.data());
        for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
        continue;
      }
      g.resize(size_t(n * F));
      u.resize(size_t(n * F));
      gemm(x.data(), L.wg, n, H, F, g.data());
      gemm(x.data(), L.wu, n, H, F, u.data());
      if (faithful) ggmlnum::swiglu(n, F, g.data(), g.data(), u.data(), lanes);
      else for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      gemm(g.data(), L.wd, n, F, H, o.data());
      for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
    }
    processed = p0 + n;
  }
  return T;
}

}  // namespace pdb
