// Multi-head latent attention on the CPU (deepseek2) in llama.cpp's absorbed form (what its deepseek2 graph
// computes). Per token: q = Wq x (or through the q LoRA), split per head into q_nope | q_pe; the cached row
// [rms_norm(c_kv) * kv_a_norm | RoPE(k_pe)] (rounded as the decoder's cache holds it); the absorbed query
// [W_UK_h^T q_nope | RoPE(q_pe)] attends over the rows (keys: the whole row, values: its latent part), then
// W_UV_h per head and Wo. Scores scaled by mscale^2 / sqrt(nope + rope) (numerics/mla_rope.h).
// With lanes the dense products sum in tinyBLAS order; not mirrored yet: the absorbed wk_b/wv_b products (ggml's
// batched mul_mat) and the decoder's 576-wide flash attention, so the rows of layer 1 onwards agree to rounding
// (the tolerance class), not bit for bit, however the decoder runs.
#include <cmath>
#include <memory>

#include <fmt/format.h>

#include "common/parallel.h"
#include "model/cpu_blocks.h"
#include "numerics/decoder_numerics.h"
#include "numerics/mla_rope.h"
#include "numerics/rmsnorm.h"
#include "numerics/rope_ggml.h"

namespace pdb {
namespace {

class MlaAttentionCpu final : public CpuAttention {
 public:
  MlaAttentionCpu(const WeightSource& ws, const HfConfig& c, int64_t layer);
  CpuCacheRows cache_rows(const CpuPass&) const override { return {row_, 0, 0}; }
  void forward(const float* x, int64_t n, int64_t p0, const CpuPass& p, CpuLayerCache& cache, float* out) override;
  bool accepts_lanes(int lanes) const override { return lanes == 4 || lanes == 8 || lanes == 16; }
  bool rope_mirrored() const override { return true; }
  int weight_bits() const override { return 32; }
  void round_weights(const WeightRounding&) override {}  // the checkpoint's own values (the arithmetic is not mirrored yet)

 private:
  void queries_and_rows(const float* x, int64_t n, int64_t p0, const CpuPass& p, float* a, float* qabs);
  int64_t hidden_, nh_, nope_, rope_, vd_, kvl_, ql_, qk_, row_;
  float eps_;
  MlaRope mr_;
  std::vector<float> kv_a_norm_;
  std::vector<float> wq_;                    // [n_head*(nope+rope) x hidden] (q_lora_rank 0: Lite)
  std::vector<float> wq_a_, q_a_norm_, wq_b_;  // q_lora_rank > 0
  std::vector<float> wkv_a_;                 // [kv_lora + rope x hidden]
  std::vector<std::vector<float>> k_b_;      // per head [kv_lora x nope]: the absorbed query's weight (W_UK_h^T)
  std::vector<std::vector<float>> v_b_;      // per head [v x kv_lora]: W_UV_h
  std::vector<float> wo_;                    // [hidden x n_head*v]
  // the activations as ggml-cpu quantizes them for each weight's type
  ggmlnum::ActQuant aq_q_a_ = {}, aq_q_b_ = {}, aq_q_ = {}, aq_kv_a_ = {}, aq_o_ = {};
};

MlaAttentionCpu::MlaAttentionCpu(const WeightSource& ws, const HfConfig& c, int64_t layer)
    : hidden_(c.hidden_size), nh_(c.num_heads), nope_(c.qk_nope_head_dim), rope_(c.qk_rope_head_dim), vd_(c.v_head_dim),
      kvl_(c.kv_lora_rank), ql_(c.q_lora_rank), qk_(nope_ + rope_), row_(kvl_ + rope_), eps_(float(c.rms_norm_eps)), mr_(mla_rope(c)) {
  const std::string p = fmt::format("model.layers.{}.self_attn.", layer);
  const int64_t H = hidden_, nh = nh_, nope = nope_, vd = vd_, kvl = kvl_;
  if (ql_) {
    wq_a_ = ws.matrix(p + "q_a_proj.weight", ql_, H);
    q_a_norm_ = ws.vector(p + "q_a_layernorm.weight", ql_);
    wq_b_ = ws.matrix(p + "q_b_proj.weight", nh * qk_, ql_);
  } else {
    wq_ = ws.matrix(p + "q_proj.weight", nh * qk_, H);
  }
  wkv_a_ = ws.matrix(p + "kv_a_proj_with_mqa.weight", row_, H);
  kv_a_norm_ = ws.vector(p + "kv_a_layernorm.weight", kvl);
  const auto kvb = ws.matrix(p + "kv_b_proj.weight", nh * (nope + vd), kvl);
  for (int64_t h = 0; h < nh; ++h) {
    const float* head = kvb.data() + h * (nope + vd) * kvl;
    std::vector<float> kb(static_cast<size_t>(kvl * nope));
    for (int64_t r = 0; r < kvl; ++r)
      for (int64_t i = 0; i < nope; ++i) kb[size_t(r * nope + i)] = head[i * kvl + r];
    k_b_.push_back(std::move(kb));
    v_b_.emplace_back(head + nope * kvl, head + (nope + vd) * kvl);
  }
  wo_ = ws.matrix(p + "o_proj.weight", H, nh * vd);
  auto aq = [&](const char* w) { return ggmlnum::act_quant_for(ws.storage_type(p + w)); };
  aq_q_a_ = ql_ ? aq("q_a_proj.weight") : ggmlnum::ActQuant::none;
  aq_q_b_ = ql_ ? aq("q_b_proj.weight") : ggmlnum::ActQuant::none;
  aq_q_ = ql_ ? ggmlnum::ActQuant::none : aq("q_proj.weight");
  aq_kv_a_ = aq("kv_a_proj_with_mqa.weight");
  aq_o_ = aq("o_proj.weight");
}

// a[n x row]: the cached rows; qabs[n x heads x row]: the absorbed queries [W_UK_h^T q_nope | RoPE(q_pe)].
void MlaAttentionCpu::queries_and_rows(const float* x, int64_t n, int64_t p0, const CpuPass& p, float* a, float* qabs) {
  const int64_t H = hidden_, nh = nh_, nope = nope_, rope = rope_, kvl = kvl_, qk = qk_, row = row_;
  std::vector<float>& q = p.scratch->q;
  q.resize(size_t(n * nh * qk));
  if (ql_) {
    std::vector<float> qa(size_t(n * ql_));
    cpu_matmul(p, x, wq_a_, n, H, ql_, qa.data(), aq_q_a_);
    rmsnorm_rows(qa.data(), q_a_norm_.data(), qa.data(), n, ql_, eps_);
    cpu_matmul(p, qa.data(), wq_b_, n, ql_, nh * qk, q.data(), aq_q_b_);
  } else {
    cpu_matmul(p, x, wq_, n, H, nh * qk, q.data(), aq_q_);
  }
  cpu_matmul(p, x, wkv_a_, n, H, row, a, aq_kv_a_);
  parallel_for(n, p.threads, [&](int64_t b, int64_t e) {
    std::vector<float> rc(static_cast<size_t>(rope));
    for (int64_t r = b; r < e; ++r) {
      float* kr = a + r * row;
      rmsnorm_rows(kr, kv_a_norm_.data(), kr, 1, kvl, eps_);
      ggml_rope_cache(mr_.rope, p0 + r, rc.data());
      ggml_rope_apply(mr_.rope, rc.data(), kr + kvl);
      for (int64_t hh = 0; hh < nh; ++hh) {
        float* qh = q.data() + (r * nh + hh) * qk;
        ggml_rope_apply(mr_.rope, rc.data(), qh + nope);
        float* o = qabs + (r * nh + hh) * row;
        const float* kb = k_b_[size_t(hh)].data();
        for (int64_t i = 0; i < kvl; ++i) {
          float s = 0.0f;
          for (int64_t j = 0; j < nope; ++j) s = std::fma(kb[i * nope + j], qh[j], s);
          o[i] = s;
        }
        std::copy_n(qh + nope, rope, o + kvl);
      }
    }
  });
}

void MlaAttentionCpu::forward(const float* x, int64_t n, int64_t p0, const CpuPass& p, CpuLayerCache& cache, float* out) {
  const int64_t nh = nh_, vd = vd_, kvl = kvl_, row = row_;
  CpuScratch& s = *p.scratch;
  s.k.resize(size_t(n * row));
  std::vector<float> qabs(static_cast<size_t>(n * nh * row));
  queries_and_rows(x, n, p0, p, s.k.data(), qabs.data());
  if (p.kv_round) p.kv_round(s.k.data(), n, row, false);
  std::copy(s.k.begin(), s.k.end(), cache.k.begin() + p0 * row);
  // attention: every head over the same rows (MQA after absorption), keys [0, p0 + r]
  s.att.assign(size_t(n * nh * vd), 0.0f);
  const float* K = cache.k.data();
  parallel_for(n * nh, p.threads, [&](int64_t b, int64_t e) {
    std::vector<float> lat(static_cast<size_t>(kvl));
    for (int64_t idx = b; idx < e; ++idx) {
      const int64_t r = idx / nh, hh = idx % nh;
      ggmlnum::flash_attn_row_kv(qabs.data() + idx * row, K, K, row, p0 + r + 1, row, kvl, mr_.kq_scale, lat.data(), p.lanes ? p.lanes : 8);
      const float* vb = v_b_[size_t(hh)].data();
      float* o = s.att.data() + r * nh * vd + hh * vd;
      for (int64_t d = 0; d < vd; ++d) {
        float acc = 0.0f;
        for (int64_t i = 0; i < kvl; ++i) acc = std::fma(vb[d * kvl + i], lat[size_t(i)], acc);
        o[d] = acc;
      }
    }
  });
  cpu_matmul(p, s.att.data(), wo_, n, nh * vd, hidden_, out, aq_o_);
}

}  // namespace

std::unique_ptr<CpuAttention> make_mla_attention_cpu(const WeightSource& ws, const HfConfig& c, int64_t layer) {
  return std::make_unique<MlaAttentionCpu>(ws, c, layer);
}

}  // namespace pdb
