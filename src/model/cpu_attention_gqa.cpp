// Grouped-query attention on the CPU (llama, qwen3, qwen3moe): Q/K/V products, qwen3's per-head q/k norms, RoPE
// and causal attention over the prompt's K/V, then o_proj. Three arithmetics:
//  - fast (no lanes): HF's rotate_half RoPE and per-head OpenBLAS products;
//  - row-independent (lanes, a RoPE the decoder cannot share): every query sums its keys in one fixed order;
//  - decoder-faithful (lanes): llama.cpp's RoPE recurrence in the GGUF's row order (llama's Q/K rows permuted as
//    the converter does), its tiled flash attention; over a Q8_0 cache, its quantized rows and products.
#include <cblas.h>

#include <cmath>
#include <memory>
#include <stdexcept>
#include <tuple>

#include <fmt/format.h>

#include "common/parallel.h"
#include "formats/ggml_types.h"
#include "formats/hf_to_gguf.h"
#include "model/cpu_blocks.h"
#include "numerics/decoder_numerics.h"
#include "numerics/gemm_lanes.h"
#include "numerics/rmsnorm.h"
#include "numerics/rope_ggml.h"
#include "recipes/recipe.h"

namespace pdb {
namespace {

class GqaAttentionCpu final : public CpuAttention {
 public:
  GqaAttentionCpu(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, int64_t layer);
  CpuCacheRows cache_rows(const CpuPass& p) const override {
    return {kvd_, kvd_, q8_path(p) ? size_t(kvd_ / 32 * 34) : 0};
  }
  void forward(const float* x, int64_t n, int64_t p0, const CpuPass& p, CpuLayerCache& cache, float* out) override;
  bool accepts_lanes(int lanes) const override { return hidden_ % lanes == 0 && qd_ % lanes == 0 && hd_ % lanes == 0; }
  bool rope_mirrored() const override { return faithful_ok_; }
  int weight_bits() const override { return weight_bits_; }
  void round_weights(const WeightRounding& round) override {
    for (auto* w : {&wq_, &wk_, &wv_, &wo_, &wq_perm_, &wk_perm_}) round(*w);
  }

 private:
  bool q8_path(const CpuPass& p) const { return p.faithful && p.cache.q8_0 && hd_ % 32 == 0; }
  void rope(float* q, float* k, int64_t n, int64_t p0, const CpuPass& p) const;
  void attend(const float* q, int64_t n, int64_t p0, const CpuPass& p, const CpuLayerCache& cache, float* att) const;
  int64_t hidden_, hd_, nh_, nkv_, qd_, kvd_, group_;
  float eps_, scale_;
  std::vector<float> q_norm_, k_norm_;
  std::vector<float> wq_, wk_, wv_, wo_;  // HF layout [out x in]
  std::vector<float> wq_perm_, wk_perm_;  // the GGUF's row order (definition.gguf_permutes_qk), else empty
  std::vector<float> inv_freq_;
  float rope_scale_ = 1.0f;
  GgmlRopeParams ggml_rope_;  // the decoder's view of the same RoPE (what llama.cpp derives from the converted GGUF)
  bool faithful_ok_ = true;
  int weight_bits_ = 32;
  ggmlnum::ActQuant aq_[4] = {};  // q, k, v, o: the activations as ggml-cpu quantizes them for each weight's type
  std::vector<float> mins_[4], mq_perm_, mk_perm_;  // Q4_1/Q5_1 weights' block mins (cpu_matmul), q/k in the GGUF's order too
};

GqaAttentionCpu::GqaAttentionCpu(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, int64_t layer)
    : hidden_(c.hidden_size), hd_(c.head_dim), nh_(c.num_heads), nkv_(c.num_kv_heads), qd_(nh_ * hd_), kvd_(nkv_ * hd_),
      group_(nh_ / nkv_), eps_(float(c.rms_norm_eps)), scale_(1.0f / std::sqrt(float(hd_))) {
  const std::string p = fmt::format("model.layers.{}.self_attn.", layer);
  const int64_t H = hidden_;
  wq_ = ws.matrix(p + "q_proj.weight", qd_, H);
  wk_ = ws.matrix(p + "k_proj.weight", kvd_, H);
  wv_ = ws.matrix(p + "v_proj.weight", kvd_, H);
  wo_ = ws.matrix(p + "o_proj.weight", H, qd_);
  for (int i = 0; i < 4; ++i) aq_[i] = ggmlnum::act_quant_for(ws.storage_type(p + std::string("qkvo").substr(size_t(i), 1) + "_proj.weight"));
  mins_[0] = cpu_q8_1_mins(ws, p + "q_proj.weight", qd_, H);
  mins_[1] = cpu_q8_1_mins(ws, p + "k_proj.weight", kvd_, H);
  mins_[2] = cpu_q8_1_mins(ws, p + "v_proj.weight", kvd_, H);
  mins_[3] = cpu_q8_1_mins(ws, p + "o_proj.weight", H, qd_);
  if (d.qk_norm) {
    q_norm_ = ws.vector(p + "q_norm.weight", hd_);
    k_norm_ = ws.vector(p + "k_norm.weight", hd_);
  }
  weight_bits_ = ws.weight_bits(p + "k_proj.weight");
  for (double f : c.inv_freq()) inv_freq_.push_back(float(f));
  rope_scale_ = float(c.attention_scaling());
  auto& r = ggml_rope_;
  r.n_dims = int(hd_);
  r.freq_base = float(c.rope_theta);
  r.mode = d.decoder_rope;
  r.n_ctx_orig = int(c.rope_scaling.original_max_position_embeddings ? c.rope_scaling.original_max_position_embeddings : c.max_position_embeddings);
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
  if (d.gguf_permutes_qk) {  // the converter's row order, so attention sums in the decoder's order
    wq_perm_.resize(wq_.size());
    wk_perm_.resize(wk_.size());
    permute_qk_rows(wq_.data(), wq_perm_.data(), nh_, hd_, H);
    permute_qk_rows(wk_.data(), wk_perm_.data(), nkv_, hd_, H);
    for (auto [mins, perm, heads] : {std::tuple{&mins_[0], &mq_perm_, nh_}, std::tuple{&mins_[1], &mk_perm_, nkv_}})
      if (!mins->empty()) {
        perm->resize(mins->size());
        permute_qk_rows(mins->data(), perm->data(), heads, hd_, H / 32);
      }
  }
}

void GqaAttentionCpu::rope(float* q, float* k, int64_t n, int64_t p0, const CpuPass& p) const {
  const int64_t hd = hd_, nh = nh_, nkv = nkv_, qd = qd_, kvd = kvd_;
  if (p.faithful) {
    parallel_for(n, p.threads, [&](int64_t b, int64_t e) {
      std::vector<float> cache(static_cast<size_t>(hd));
      for (int64_t r = b; r < e; ++r) {
        ggml_rope_cache(ggml_rope_, p0 + r, cache.data());
        for (int64_t hh = 0; hh < nh; ++hh) ggml_rope_apply(ggml_rope_, cache.data(), q + r * qd + hh * hd);
        for (int64_t hh = 0; hh < nkv; ++hh) ggml_rope_apply(ggml_rope_, cache.data(), k + r * kvd + hh * hd);
      }
    });
    return;
  }
  // HF rotate_half RoPE on both q and k
  parallel_for(n, p.threads, [&](int64_t b, int64_t e) {
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
        for (int64_t hh = 0; hh < nh; ++hh) rot(q + r * qd + hh * hd);
        for (int64_t hh = 0; hh < nkv; ++hh) rot(k + r * kvd + hh * hd);
      }
    }
  });
}

void GqaAttentionCpu::forward(const float* x, int64_t n, int64_t p0, const CpuPass& p, CpuLayerCache& cache, float* out) {
  CpuScratch& s = *p.scratch;
  const int64_t H = hidden_, qd = qd_, kvd = kvd_;
  s.q.resize(size_t(n * qd));
  s.k.resize(size_t(n * kvd));
  s.v.resize(size_t(n * kvd));
  const bool permuted = p.faithful && !wq_perm_.empty();
  cpu_matmul(p, x, permuted ? wq_perm_ : wq_, n, H, qd, s.q.data(), aq_[0], permuted ? &mq_perm_ : &mins_[0]);
  cpu_matmul(p, x, permuted ? wk_perm_ : wk_, n, H, kvd, s.k.data(), aq_[1], permuted ? &mk_perm_ : &mins_[1]);
  cpu_matmul(p, x, wv_, n, H, kvd, s.v.data(), aq_[2], &mins_[2]);
  if (!q_norm_.empty()) {
    rmsnorm_rows(s.q.data(), q_norm_.data(), s.q.data(), n * nh_, hd_, eps_);
    rmsnorm_rows(s.k.data(), k_norm_.data(), s.k.data(), n * nkv_, hd_, eps_);
  }
  rope(s.q.data(), s.k.data(), n, p0, p);
  if (q8_path(p)) {
    // what llama.cpp stores: rotated, Q8_0-quantized rows (V kept dequantized, still rotated)
    const size_t q8_row = size_t(kvd / 32 * 34);
    std::vector<uint8_t> tmp(q8_row);
    for (int64_t r = 0; r < n; ++r) {
      float* kr = s.k.data() + r * kvd;
      float* vr = s.v.data() + r * kvd;
      if (p.cache.rot_k) hadamard_rows(kr, kvd, p.cache.k_rot_n);
      if (p.cache.rot_v) hadamard_rows(vr, kvd, p.cache.v_rot_n);
      quantize_row(GgmlType::Q8_0, kr, cache.kq8.data() + size_t(p0 + r) * q8_row, kvd, Q8Rounding::TiesEven);
      quantize_row(GgmlType::Q8_0, vr, tmp.data(), kvd, Q8Rounding::TiesEven);
      dequantize_row(GgmlType::Q8_0, tmp.data(), vr, kvd);
    }
  } else if (p.kv_round) {
    p.kv_round(s.k.data(), n, kvd, false);
    p.kv_round(s.v.data(), n, kvd, true);
  }
  std::copy(s.k.begin(), s.k.end(), cache.k.begin() + p0 * kvd);
  std::copy(s.v.begin(), s.v.end(), cache.v.begin() + p0 * kvd);
  s.att.assign(size_t(n * qd), 0.0f);
  attend(s.q.data(), n, p0, p, cache, s.att.data());
  cpu_matmul(p, s.att.data(), wo_, n, qd, H, out, aq_[3], &mins_[3]);
}

// causal attention, keys [0, p0 + n)
void GqaAttentionCpu::attend(const float* q, int64_t n, int64_t p0, const CpuPass& p, const CpuLayerCache& cache, float* att) const {
  const int64_t hd = hd_, nh = nh_, qd = qd_, kvd = kvd_, group = group_, nk = p0 + n;
  const float scale = scale_;
  const float* K = cache.k.data();
  const float* V = cache.v.data();
  if (q8_path(p)) {
    const size_t q8_row = size_t(kvd / 32 * 34);
    parallel_for(n * nh, p.threads, [&](int64_t b, int64_t e) {
      std::vector<float> qh(static_cast<size_t>(hd));
      std::vector<uint8_t> qq(size_t(hd / 32 * 34));
      for (int64_t idx = b; idx < e; ++idx) {
        const int64_t r = idx / nh, hh = idx % nh, kvh = hh / group;
        std::copy_n(q + r * qd + hh * hd, hd, qh.data());
        if (p.cache.rot_k) hadamard_rows(qh.data(), hd, p.cache.k_rot_n);
        quantize_row(GgmlType::Q8_0, qh.data(), qq.data(), hd, Q8Rounding::TiesEven);
        float* o = att + r * qd + hh * hd;
        ggmlnum::flash_attn_row_q8(qq.data(), cache.kq8.data() + size_t(kvh * hd / 32 * 34), int64_t(q8_row), V + kvh * hd, kvd, p0 + r + 1,
                                   hd, scale, o);
        if (p.cache.rot_v) hadamard_rows(o, hd, p.cache.v_rot_n);
      }
    });
  } else if (p.faithful) {
    parallel_for(n * nh, p.threads, [&](int64_t b, int64_t e) {
      for (int64_t idx = b; idx < e; ++idx) {
        const int64_t r = idx / nh, hh = idx % nh, kvh = hh / group;
        ggmlnum::flash_attn_row(q + r * qd + hh * hd, K + kvh * hd, V + kvh * hd, kvd, p0 + r + 1, hd, scale, att + r * qd + hh * hd, p.lanes);
      }
    });
  } else if (p.lanes) {
    // Row-independent attention: every query sums its keys in one fixed order.
    parallel_for(n * nh, p.threads, [&](int64_t b, int64_t e) {
      std::vector<float> sc(static_cast<size_t>(nk));
      for (int64_t idx = b; idx < e; ++idx) {
        const int64_t r = idx / nh, hh = idx % nh, kvh = hh / group, lim = p0 + r + 1;
        const float* qr = q + r * qd + hh * hd;
        float m = -INFINITY;
        for (int64_t j = 0; j < lim; ++j) {
          sc[size_t(j)] = dot_lanes(qr, K + j * kvd + kvh * hd, hd, p.lanes) * scale;
          m = std::max(m, sc[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j < lim; ++j) { sc[size_t(j)] = std::exp(sc[size_t(j)] - m); sum += sc[size_t(j)]; }
        const float inv = float(1.0 / sum);
        float* o = att + r * qd + hh * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = 0.0f;
        for (int64_t j = 0; j < lim; ++j) {
          const float pr = sc[size_t(j)] * inv;
          const float* vr = V + j * kvd + kvh * hd;
          for (int64_t d = 0; d < hd; ++d) o[d] = std::fma(pr, vr[d], o[d]);
        }
      }
    });
  } else {  // heads in sequence: OpenBLAS parallelizes each GEMM
    std::vector<float> s(static_cast<size_t>(n * nk));
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t kvh = hh / group;
      // s[n x nk] = Q_h K_h^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(nk), int(hd), scale, q + hh * hd, int(qd), K + kvh * hd, int(kvd), 0.0f,
                  s.data(), int(nk));
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
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(hd), int(nk), 1.0f, s.data(), int(nk), V + kvh * hd, int(kvd), 0.0f,
                  att + hh * hd, int(qd));
    }
  }
}

}  // namespace

std::unique_ptr<CpuAttention> make_gqa_attention_cpu(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, int64_t layer) {
  return std::make_unique<GqaAttentionCpu>(d, ws, c, layer);
}

}  // namespace pdb
