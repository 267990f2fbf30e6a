// The CPU engine's deepseek2 forward: multi-head latent attention in llama.cpp's absorbed form (what
// its deepseek2 graph computes), the leading dense layers, and the routed + shared experts.
// Per layer and token: x = rms_norm(h) * attn_norm; q = Wq x, split per head into q_nope | q_pe;
// the cached row [rms_norm(c_kv) * kv_a_norm | RoPE(k_pe)] (rounded as the decoder's cache holds it);
// the absorbed query [W_UK_h^T q_nope | RoPE(q_pe)] attends over the rows (keys: the whole row,
// values: its latent part), then W_UV_h per head and Wo. Scores scaled by mscale^2 / sqrt(nope + rope)
// (YaRN with DeepSeek's mscale, as llama.cpp pre-scales kq_scale).
// With `lanes` the dense products sum in tinyBLAS order (batch-independent: chunked == one-shot) and the
// experts as mul_mat_id does; not mirrored yet: the absorbed wk_b/wv_b products (ggml's batched
// mul_mat) and the decoder's 576-wide flash attention, so the rows of layer 1 onwards agree to
// rounding (the tolerance class), not bit for bit, however the decoder runs.
#include <cblas.h>

#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "formats/safetensors.h"
#include "model/cpu_engine_mla.h"
#include "numerics/decoder_numerics.h"
#include "numerics/gemm_lanes.h"
#include "numerics/mla_rope.h"
#include "numerics/rmsnorm.h"
#include "numerics/rope_ggml.h"

namespace pdb {
namespace {

std::vector<float> tensor(const SafetensorsCheckpoint& ck, const std::string& name, std::vector<int64_t> shape) {
  const StTensor& t = ck.get(name);
  if (t.shape != shape) throw std::runtime_error(fmt::format("{}: shape does not match config.json", name));
  return ck.to_f32(name);
}

// lanes 4/8/16: every output summed in one fixed order (batch-independent: chunked == one-shot).
void gemm(const float* x, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, float* y, int lanes, int threads) {
  if (lanes && in % lanes == 0) return gemm_lanes(x, w.data(), y, rows, out, in, lanes, threads);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(out), int(in), 1.0f, x, int(in), w.data(), int(in), 0.0f, y, int(out));
}

void swiglu_mlp(const float* x, const std::vector<float>& wg, const std::vector<float>& wu, const std::vector<float>& wd, int64_t n,
                int64_t H, int64_t F, float* out, int lanes, int threads) {
  std::vector<float> g(static_cast<size_t>(n * F)), u(static_cast<size_t>(n * F));
  gemm(x, wg, n, H, F, g.data(), lanes, threads);
  gemm(x, wu, n, H, F, u.data(), lanes, threads);
  if (lanes) ggmlnum::swiglu(n, F, g.data(), g.data(), u.data(), lanes);
  else for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  gemm(g.data(), wd, n, F, H, out, lanes, threads);
}

}  // namespace

MlaRope mla_rope(const HfConfig& c) {
  const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  MlaRope m;
  GgmlRopeParams& rp = m.rope;
  rp.n_dims = int(c.qk_rope_head_dim);
  rp.freq_base = float(c.rope_theta);
  rp.mode = RopeMode::Norm;
  float kq_scale = 1.0f / std::sqrt(float(qk));
  if (c.rope_scaling.type == RopeScalingType::Yarn) {
    const auto& rs = c.rope_scaling;
    rp.freq_scale = float(1.0 / rs.factor);
    rp.ext_factor = 1.0f;
    rp.n_ctx_orig = int(rs.original_max_position_embeddings);
    const float f = 1.0f / rp.freq_scale;
    rp.attn_factor = 1.0f / (1.0f + 0.1f * logf(f));
    const float log_mul = float(rs.mscale_all_dim);
    const float attn_org = rp.attn_factor * (1.0f + 0.1f * logf(f));
    const float mscale = attn_org * (1.0f + 0.1f * log_mul * logf(f));
    kq_scale = mscale * mscale / std::sqrt(float(qk));
  } else if (c.rope_scaling.type != RopeScalingType::None) {
    throw std::runtime_error("deepseek2: only YaRN (or no) RoPE scaling is supported");
  }
  m.kq_scale = kq_scale;
  return m;
}

void CpuEngine::load_mla(const std::string& hf_dir) {
  const auto& c = cfg_;
  auto ck = SafetensorsCheckpoint::open(hf_dir);
  const int64_t H = c.hidden_size, nh = c.num_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, vd = c.v_head_dim;
  const int64_t kvl = c.kv_lora_rank;
  embed_ = tensor(*ck, "model.embed_tokens.weight", {c.vocab_size, H});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    auto L = std::make_unique<MlaLayer>();
    L->in_norm = tensor(*ck, p + "input_layernorm.weight", {H});
    L->post_norm = tensor(*ck, p + "post_attention_layernorm.weight", {H});
    if (c.q_lora_rank) {
      L->wq_a = tensor(*ck, p + "self_attn.q_a_proj.weight", {c.q_lora_rank, H});
      L->q_a_norm = tensor(*ck, p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank});
      L->wq_b = tensor(*ck, p + "self_attn.q_b_proj.weight", {nh * (nope + rope), c.q_lora_rank});
    } else {
      L->wq = tensor(*ck, p + "self_attn.q_proj.weight", {nh * (nope + rope), H});
    }
    L->wkv_a = tensor(*ck, p + "self_attn.kv_a_proj_with_mqa.weight", {kvl + rope, H});
    L->kv_a_norm = tensor(*ck, p + "self_attn.kv_a_layernorm.weight", {kvl});
    const auto kvb = tensor(*ck, p + "self_attn.kv_b_proj.weight", {nh * (nope + vd), kvl});
    for (int64_t h = 0; h < nh; ++h) {
      const float* head = kvb.data() + h * (nope + vd) * kvl;
      std::vector<float> kb(static_cast<size_t>(kvl * nope));
      for (int64_t r = 0; r < kvl; ++r)
        for (int64_t i = 0; i < nope; ++i) kb[size_t(r * nope + i)] = head[i * kvl + r];
      L->k_b.push_back(std::move(kb));
      L->v_b.emplace_back(head + nope * kvl, head + (nope + vd) * kvl);
    }
    L->wo = tensor(*ck, p + "self_attn.o_proj.weight", {H, nh * vd});
    L->dense = l < c.first_k_dense_replace;
    const std::string mlp = L->dense ? p + "mlp." : p + "mlp.shared_experts.";
    const int64_t F = L->dense ? c.intermediate_size : c.moe_intermediate_size * c.n_shared_experts;
    L->wg = tensor(*ck, mlp + "gate_proj.weight", {F, H});
    L->wu = tensor(*ck, mlp + "up_proj.weight", {F, H});
    L->wd = tensor(*ck, mlp + "down_proj.weight", {H, F});
    if (!L->dense) {
      auto& m = L->moe;
      m.n_expert = c.num_experts; m.n_used = c.num_experts_per_tok; m.hidden = H; m.ff = c.moe_intermediate_size;
      m.norm_topk = c.norm_topk_prob;
      m.w_scale = float(c.routed_scaling_factor);
      m.router = tensor(*ck, p + "mlp.gate.weight", {m.n_expert, H});
      for (int64_t e = 0; e < m.n_expert; ++e) {
        const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
        m.gate.push_back(tensor(*ck, x + "gate_proj.weight", {m.ff, H}));
        m.up.push_back(tensor(*ck, x + "up_proj.weight", {m.ff, H}));
        m.down.push_back(tensor(*ck, x + "down_proj.weight", {H, m.ff}));
      }
    }
    mla_layers_.push_back(std::move(L));
  }
}

int64_t CpuEngine::prefill_mla(const std::vector<int32_t>& tokens, int64_t chunk, int lanes, const LayerHook& hook,
                               const std::function<bool()>& cancelled, const KvRounding& kv_round) {
  const auto& c = cfg_;
  if (lanes != 4 && lanes != 8 && lanes != 16) lanes = 0;
  const int64_t T = int64_t(tokens.size()), H = c.hidden_size, nh = c.num_heads;
  const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, vd = c.v_head_dim, kvl = c.kv_lora_rank;
  const int64_t qk = nope + rope, row = kvl + rope;
  const float eps = float(c.rms_norm_eps);
  if (chunk <= 0) chunk = 512;
  check_tokens(tokens);
  const MlaRope mr = mla_rope(c);
  const GgmlRopeParams& rp = mr.rope;
  const float kq_scale = mr.kq_scale;
  std::vector<std::vector<float>> cache(size_t(c.num_layers));  // the decoder's rows, [T x row] per layer
  for (auto& k : cache) k.resize(size_t(T * row));
  std::vector<float> h, x, q, a, att, o, y;
  for (int64_t p0 = 0; p0 < T; p0 += chunk) {
    const int64_t n = std::min(chunk, T - p0);
    embed_chunk(tokens, p0, n, h);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      if (cancelled && cancelled()) return p0;
      const MlaLayer& L = *mla_layers_[size_t(l)];
      hook(int(l), h.data(), n, p0);
      x.resize(size_t(n * H));
      rmsnorm_rows(h.data(), L.in_norm.data(), x.data(), n, H, eps);
      q.resize(size_t(n * nh * qk));
      if (c.q_lora_rank) {
        std::vector<float> qa(size_t(n * c.q_lora_rank));
        gemm(x.data(), L.wq_a, n, H, c.q_lora_rank, qa.data(), lanes, threads_);
        rmsnorm_rows(qa.data(), L.q_a_norm.data(), qa.data(), n, c.q_lora_rank, eps);
        gemm(qa.data(), L.wq_b, n, c.q_lora_rank, nh * qk, q.data(), lanes, threads_);
      } else {
        gemm(x.data(), L.wq, n, H, nh * qk, q.data(), lanes, threads_);
      }
      a.resize(size_t(n * row));
      gemm(x.data(), L.wkv_a, n, H, row, a.data(), lanes, threads_);
      // The cached rows, and the absorbed queries [W_UK_h^T q_nope | RoPE(q_pe)] per head.
      std::vector<float> qabs(static_cast<size_t>(n * nh * row));
      parallel_for(n, threads_, [&](int64_t b, int64_t e) {
        std::vector<float> rc(static_cast<size_t>(rope));
        for (int64_t r = b; r < e; ++r) {
          float* kr = a.data() + r * row;
          rmsnorm_rows(kr, L.kv_a_norm.data(), kr, 1, kvl, eps);
          ggml_rope_cache(rp, p0 + r, rc.data());
          ggml_rope_apply(rp, rc.data(), kr + kvl);
          for (int64_t hh = 0; hh < nh; ++hh) {
            float* qh = q.data() + (r * nh + hh) * qk;
            ggml_rope_apply(rp, rc.data(), qh + nope);
            float* out = qabs.data() + (r * nh + hh) * row;
            const float* kb = L.k_b[size_t(hh)].data();
            for (int64_t i = 0; i < kvl; ++i) {
              float s = 0.0f;
              for (int64_t j = 0; j < nope; ++j) s = std::fma(kb[i * nope + j], qh[j], s);
              out[i] = s;
            }
            std::copy_n(qh + nope, rope, out + kvl);
          }
        }
      });
      if (kv_round) kv_round(a.data(), n, row, false);
      std::copy(a.begin(), a.end(), cache[size_t(l)].begin() + p0 * row);
      // attention: every head over the same rows (MQA after absorption), keys [0, p0 + r]
      att.assign(size_t(n * nh * vd), 0.0f);
      const float* K = cache[size_t(l)].data();
      parallel_for(n * nh, threads_, [&](int64_t b, int64_t e) {
        std::vector<float> lat(static_cast<size_t>(kvl));
        for (int64_t idx = b; idx < e; ++idx) {
          const int64_t r = idx / nh, hh = idx % nh;
          ggmlnum::flash_attn_row_kv(qabs.data() + idx * row, K, K, row, p0 + r + 1, row, kvl, kq_scale, lat.data(), lanes ? lanes : 8);
          const float* vb = L.v_b[size_t(hh)].data();
          float* out = att.data() + r * nh * vd + hh * vd;
          for (int64_t d = 0; d < vd; ++d) {
            float s = 0.0f;
            for (int64_t i = 0; i < kvl; ++i) s = std::fma(vb[d * kvl + i], lat[size_t(i)], s);
            out[d] = s;
          }
        }
      });
      o.resize(size_t(n * H));
      gemm(att.data(), L.wo, n, nh * vd, H, o.data(), lanes, threads_);
      for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
      rmsnorm_rows(h.data(), L.post_norm.data(), x.data(), n, H, eps);
      const int64_t F = L.dense ? c.intermediate_size : c.moe_intermediate_size * c.n_shared_experts;
      swiglu_mlp(x.data(), L.wg, L.wu, L.wd, n, H, F, o.data(), lanes, threads_);  // dense FFN, or the shared experts
      if (!L.dense) {
        y.resize(size_t(n * H));
        moe_ffn(L.moe, x.data(), n, lanes, 32, threads_, y.data());
        for (size_t i = 0; i < o.size(); ++i) o[i] = y[i] + o[i];  // moe_out + shexp
      }
      for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
    }
  }
  return T;
}

}  // namespace pdb
