#include "model/cpu_engine_dsv4.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "formats/gguf.h"
#include "formats/hf_deepseek4.h"
#include "formats/numeric.h"
#include "numerics/deepseek4_blocks.h"
#include "numerics/rmsnorm.h"
#include "recipes/recipe.h"
#include "numerics/rope_ggml.h"

namespace pdb {

struct Deepseek4CpuEngine::Layer {
  int64_t ratio = 0;
  std::vector<float> hc_attn_fn, hc_attn_base, hc_attn_scale, hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
  std::vector<float> wq_a, q_a_norm, wq_b, sinks, wo_a, wo_b;
  std::vector<float> idx_proj, idx_q_b;
  std::vector<float> ffn_norm, gate_inp, probs_bias, gate_exps, up_exps, down_exps, gate_sh, up_sh, down_sh;
  std::vector<int32_t> tid2eid;
};

namespace {

void project(const std::vector<float>& w, const float* x, int64_t in, int64_t out, float* y) {
  for (int64_t o = 0; o < out; ++o) {
    float s = 0.0f;
    const float* wr = w.data() + o * in;
    for (int64_t i = 0; i < in; ++i) s += wr[i] * x[i];
    y[o] = s;
  }
}

float swiglu_clamp(float g, float u, float L) {
  if (L > 1e-6f) {
    g = std::min(g, L);
    u = std::max(-L, std::min(u, L));
  }
  return g / (1.0f + std::exp(-g)) * u;
}

}  // namespace

Deepseek4Weights Deepseek4Weights::from_gguf(std::shared_ptr<const GgufFile> g) {
  Deepseek4Weights w;
  w.f32 = [g](const std::string& n) { return g->to_f32(g->tensor(n)); };
  w.i32 = [g](const std::string& n) {
    const auto& ti = g->tensor(n);
    if (ti.type != GgmlType::I32) throw std::runtime_error(n + " is not I32");
    const auto* d = reinterpret_cast<const int32_t*>(g->data(ti));
    return std::vector<int32_t>(d, d + ti.n_elements());
  };
  w.mxfp4 = [g](const std::string& n, std::vector<uint8_t>& out) {
    const auto& ti = g->tensor(n);
    if (ti.type != GgmlType::MXFP4) return false;
    out.assign(g->data(ti), g->data(ti) + ggml_row_bytes(GgmlType::MXFP4, ti.ne[0]) * size_t(ti.n_elements() / ti.ne[0]));
    return true;
  };
  w.describe = "f32 values of a GGUF's weights";
  return w;
}

Deepseek4Weights Deepseek4Weights::from_checkpoint(std::shared_ptr<const Deepseek4Checkpoint> ck) {
  Deepseek4Weights w;
  w.f32 = [ck](const std::string& n) { return ck->gguf_f32(n); };
  w.i32 = [ck](const std::string& n) { return ck->gguf_i32(n); };
  w.mxfp4 = [ck](const std::string& n, std::vector<uint8_t>& out) {
    if (GgmlType(ck->gguf_converted_type(n)) != GgmlType::MXFP4) return false;
    out = ck->gguf_converted(n).bytes;
    return true;
  };
  w.describe = ck->official_layout() ? "the HF checkpoint's FP8 / FP4 weights, dequantized to f32" : "the HF checkpoint's f32 weights";
  return w;
}

Deepseek4CpuEngine::Deepseek4CpuEngine(const Deepseek4Recipe& recipe, const Deepseek4Weights* weights) : recipe_(recipe) {
  const auto& c = recipe.config();
  const Deepseek4Weights own = weights ? Deepseek4Weights{} : Deepseek4Weights::from_gguf(std::shared_ptr<const GgufFile>(&recipe.gguf(), [](const GgufFile*) {}));
  const Deepseek4Weights& W = weights ? *weights : own;
  auto t = [&](const std::string& n) { return W.f32(n); };
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    auto L = std::make_unique<Layer>();
    L->ratio = c.compress_ratios.at(size_t(l));
    L->hc_attn_fn = t(p + "hc_attn_fn.weight");
    L->hc_attn_base = t(p + "hc_attn_base.weight");
    L->hc_attn_scale = t(p + "hc_attn_scale.weight");
    L->hc_ffn_fn = t(p + "hc_ffn_fn.weight");
    L->hc_ffn_base = t(p + "hc_ffn_base.weight");
    L->hc_ffn_scale = t(p + "hc_ffn_scale.weight");
    L->wq_a = t(p + "attn_q_a.weight");
    L->q_a_norm = t(p + "attn_q_a_norm.weight");
    L->wq_b = t(p + "attn_q_b.weight");
    L->sinks = t(p + "attn_sinks.weight");
    L->wo_a = t(p + "attn_output_a.weight");
    L->wo_b = t(p + "attn_output_b.weight");
    if (L->ratio == 4) {
      L->idx_proj = t(p + "indexer.proj.weight");
      L->idx_q_b = t(p + "indexer.attn_q_b.weight");
    }
    L->ffn_norm = t(p + "ffn_norm.weight");
    L->gate_inp = t(p + "ffn_gate_inp.weight");
    if (l < c.hash_layers) {
      L->tid2eid = W.i32(p + "ffn_gate_tid2eid.weight");
      if (int64_t(L->tid2eid.size()) != c.experts_used * c.vocab) throw std::runtime_error(p + "ffn_gate_tid2eid: not k ids per token");
    } else {
      L->probs_bias = t(p + "exp_probs_b.bias");
    }
    L->gate_exps = t(p + "ffn_gate_exps.weight");
    L->up_exps = t(p + "ffn_up_exps.weight");
    L->down_exps = t(p + "ffn_down_exps.weight");
    L->gate_sh = t(p + "ffn_gate_shexp.weight");
    L->up_sh = t(p + "ffn_up_shexp.weight");
    L->down_sh = t(p + "ffn_down_shexp.weight");
    layers_.push_back(std::move(L));
  }
}

Deepseek4CpuEngine::~Deepseek4CpuEngine() = default;

void Deepseek4CpuEngine::forward(const std::vector<int32_t>& tokens, GgmlType k_type, const Hook& hook) const {
  prefill(tokens, int64_t(tokens.size()), k_type, [&](int layer, const float* x, int64_t, int64_t rows, const Deepseek4LayerSections&) {
    hook(layer, x, rows);
    return true;
  });
}

int64_t Deepseek4CpuEngine::prefill(const std::vector<int32_t>& tokens, int64_t chunk, GgmlType k_type_, const ChunkHook& hook,
                                    const std::function<bool()>& stop) const {
  const auto& c = recipe_.config();
  const int64_t T = int64_t(tokens.size()), E = c.hidden, D = c.head_dim, H = c.heads, r = c.rope_dims, W = c.window;
  const int64_t I = c.index_dim, Hi = c.index_heads, Lq = c.q_lora, G = c.out_groups, R = c.out_lora, ogd = H * D / G;
  const int64_t NE = c.experts, K = c.experts_used, F = c.expert_ff, FS = c.expert_ff * c.shared_experts;
  const float eps = c.rms_eps;
  if (chunk <= 0) chunk = T;
  const bool quantized = k_type_ != GgmlType::F32 && k_type_ != GgmlType::F16 && k_type_ != GgmlType::BF16;
  // rows as the decoder attends over them: its cache type's values; quantized rows live rotated and are read
  // against a rotated query, which equals the un-rotated dot product: un-rotate them here instead
  auto as_stored = [&](std::vector<float>& rows, int64_t width, bool rotated) {
    if (rows.empty() || k_type_ == GgmlType::F32) return;
    const int64_t n = int64_t(rows.size()) / width;
    const size_t rb = ggml_row_bytes(k_type_, width);
    std::vector<uint8_t> enc(rb * size_t(n));
    rows_to_cache_type(k_type_, rows.data(), n, width, enc.data());
    for (int64_t i = 0; i < n; ++i) dequantize_row(k_type_, enc.data() + size_t(i) * rb, rows.data() + i * width, width);
    if (rotated && k_rotation_size(width)) hadamard_rows(rows.data(), int64_t(rows.size()), k_rotation_size(width));
  };
  // What each layer's attention reads across chunks: the raw rows of the last W positions, every compressed
  // row and every indexer row so far (as stored), and the recipe's compressor carries.
  struct Cache {
    int64_t win_first = 0;
    std::vector<float> win, pool, lid;
    std::vector<float> lid8;  // the indexer rows' e4m3 values (fp8_indexer_)
  };
  std::vector<Cache> caches(size_t(c.layers));
  Deepseek4Carry carry;
  int64_t done = 0;
  for (int64_t p0 = 0; p0 < T; p0 += chunk) {
    const int64_t n = std::min(chunk, T - p0);
    const std::vector<int32_t> chunk_tokens(tokens.begin() + p0, tokens.begin() + p0 + n);
    std::vector<float> x = recipe_.layer0_input(chunk_tokens), xa(x.size());
    for (int64_t l = 0; l < c.layers; ++l) {
      if (stop && stop()) return done;
      const Layer& L = *layers_[size_t(l)];
      std::vector<float> cur;
      auto S = recipe_.sections_chunk(int(l), x.data(), p0, n, T, k_type_, carry, /*all_raw_rows=*/true, &cur);
      if (!hook(int(l), x.data(), p0, n, S)) return done;
      if (l == c.layers - 1) break;  // the last layer's output feeds only the logits
      Cache& kc = caches[size_t(l)];
      as_stored(S.window, D, quantized);
      as_stored(S.pool, D, quantized);
      as_stored(S.lid, I, false);  // the indexer's rows stay rotated: the query is rotated to match below
      kc.win.insert(kc.win.end(), S.window.begin(), S.window.end());
      kc.pool.insert(kc.pool.end(), S.pool.begin(), S.pool.end());
      kc.lid.insert(kc.lid.end(), S.lid.begin(), S.lid.end());
      if (fp8_indexer_) {
        std::vector<float> v(S.lid.size());
        for (size_t i = 0; i < v.size(); ++i) v[i] = round_bf16(S.lid[i]);
        dsv4_indexer_fp8_rows(v.data(), int64_t(v.size()) / I, I, nullptr, nullptr, v.data());
        kc.lid8.insert(kc.lid8.end(), v.begin(), v.end());
      }
      const float* lid_rows = fp8_indexer_ ? kc.lid8.data() : kc.lid.data();
      const float* win = kc.win.data();
      const int64_t win_first = kc.win_first;
      const GgmlRopeParams rp = dsv4_rope(c, L.ratio);
      const float scale = 1.0f / std::sqrt(float(D));
      parallel_for(n, 4, [&](int64_t b0, int64_t b1) {
        std::vector<float> qr(static_cast<size_t>(Lq)), q(size_t(H * D)), cs(static_cast<size_t>(r)), out(size_t(H * D)), oa(size_t(G * R)), ao(static_cast<size_t>(E));
        std::vector<float> iq(size_t(Hi * I)), iw(static_cast<size_t>(Hi));
        std::vector<const float*> keys;
        Dsv4HcMix mix;
        std::vector<float> pre(static_cast<size_t>(E));
        for (int64_t tc = b0; tc < b1; ++tc) {
          const int64_t t = p0 + tc;  // the token's position in the prompt
          mix = dsv4_hc_pre({&L.hc_attn_fn, &L.hc_attn_base, &L.hc_attn_scale}, x.data() + tc * 4 * E, E, eps, c.hc_eps, int(c.hc_iterations), pre.data());
          const float* ct = cur.data() + tc * E;
          project(L.wq_a, ct, E, Lq, qr.data());
          rmsnorm_rows(qr.data(), L.q_a_norm.data(), qr.data(), 1, Lq, eps);
          project(L.wq_b, qr.data(), Lq, H * D, q.data());
          ggml_rope_cache(rp, t, cs.data());
          for (int64_t h = 0; h < H; ++h) {
            rmsnorm_rows(q.data() + h * D, nullptr, q.data() + h * D, 1, D, eps);
            ggml_rope_apply(rp, cs.data(), q.data() + h * D + (D - r));
          }
          // the keys this query sees: its window, then the visible compressed rows (CSA: the indexer's top-k)
          keys.clear();
          for (int64_t j = std::max<int64_t>(0, t - W + 1); j <= t; ++j) keys.push_back(win + (j - win_first) * D);
          const int64_t visible = L.ratio ? (t + 1) / L.ratio : 0;
          if (L.ratio == 128) {
            for (int64_t b = 0; b < visible; ++b) keys.push_back(kc.pool.data() + b * D);
          } else if (L.ratio == 4 && visible > 0) {
            project(L.idx_q_b, qr.data(), Lq, Hi * I, iq.data());
            for (int64_t h = 0; h < Hi; ++h) ggml_rope_apply(rp, cs.data(), iq.data() + h * I + (I - r));
            hadamard_rows(iq.data(), Hi * I, k_rotation_size(I));
            if (fp8_indexer_) dsv4_indexer_fp8_rows(iq.data(), Hi, I, nullptr, nullptr, iq.data());
            project(L.idx_proj, ct, E, Hi, iw.data());
            for (auto& v : iw) v *= 1.0f / std::sqrt(float(I * Hi));
            std::vector<std::pair<float, int64_t>> score;
            for (int64_t b = 0; b < visible; ++b) {
              float s = 0.0f;
              for (int64_t h = 0; h < Hi; ++h) {
                float d = 0.0f;
                for (int64_t i = 0; i < I; ++i) d += iq[size_t(h * I + i)] * lid_rows[b * I + i];
                s += iw[size_t(h)] * std::max(d, 0.0f);
              }
              score.push_back({s, b});
            }
            const size_t k = std::min<size_t>(score.size(), size_t(c.index_top_k));
            std::partial_sort(score.begin(), score.begin() + std::ptrdiff_t(k), score.end(), [](auto& a, auto& b) { return a.first > b.first; });
            for (size_t i = 0; i < k; ++i) keys.push_back(kc.pool.data() + score[i].second * D);
          }
          dsv4_attend(q.data(), keys, L.sinks.data(), H, D, scale, out.data());
          for (int64_t h = 0; h < H; ++h) {
            float* oh = out.data() + h * D;
            for (int64_t i0 = 0; i0 < r; i0 += 2) {  // de-rope at the query's position
              float* a = oh + (D - r) + i0;
              const float cv = cs[size_t(i0)], sv = cs[size_t(i0 + 1)], x0 = a[0], x1 = a[1];
              a[0] = x0 * cv + x1 * sv;
              a[1] = -x0 * sv + x1 * cv;
            }
          }
          for (int64_t g = 0; g < G; ++g)
            for (int64_t rr = 0; rr < R; ++rr) {
              float s = 0.0f;
              const float* w = L.wo_a.data() + ogd * (rr + R * g);
              for (int64_t i = 0; i < ogd; ++i) s += w[i] * out[size_t(g * ogd + i)];
              oa[size_t(rr + R * g)] = s;
            }
          project(L.wo_b, oa.data(), G * R, E, ao.data());
          dsv4_hc_post(mix, ao.data(), x.data() + tc * 4 * E, E, xa.data() + tc * 4 * E);
        }
      });
      // the FFN: hyper-connection pre-mix, ffn_norm, the routed experts and the shared one, post-mix
      parallel_for(n, 4, [&](int64_t b0, int64_t b1) {
        std::vector<float> hpre(static_cast<size_t>(E)), hn(static_cast<size_t>(E)), logit(static_cast<size_t>(NE)), gbuf(size_t(std::max(F, FS))), ubuf(gbuf.size()), y(static_cast<size_t>(E)),
            eo(static_cast<size_t>(E));
        for (int64_t tc = b0; tc < b1; ++tc) {
          const int32_t tok = chunk_tokens[size_t(tc)];
          const Dsv4HcMix mix = dsv4_hc_pre({&L.hc_ffn_fn, &L.hc_ffn_base, &L.hc_ffn_scale}, xa.data() + tc * 4 * E, E, eps, c.hc_eps,
                                            int(c.hc_iterations), hpre.data());
          rmsnorm_rows(hpre.data(), L.ffn_norm.data(), hn.data(), 1, E, eps);
          project(L.gate_inp, hn.data(), E, NE, logit.data());
          std::vector<float> prob(static_cast<size_t>(NE));
          for (int64_t e = 0; e < NE; ++e) {
            const float v = logit[size_t(e)];
            prob[size_t(e)] = std::sqrt(v > 20.0f ? v : std::log1p(std::exp(v)));
          }
          std::vector<int32_t> sel;
          if (!L.tid2eid.empty()) {
            sel.assign(L.tid2eid.begin() + int64_t(tok) * K, L.tid2eid.begin() + (int64_t(tok) + 1) * K);
          } else {
            std::vector<int32_t> order(static_cast<size_t>(NE));
            std::iota(order.begin(), order.end(), 0);
            std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
              return prob[size_t(a)] + L.probs_bias[size_t(a)] > prob[size_t(b)] + L.probs_bias[size_t(b)];
            });
            sel.assign(order.begin(), order.begin() + K);
          }
          float wsum = 0.0f;
          for (int32_t e : sel) wsum += prob[size_t(e)];
          std::fill(y.begin(), y.end(), 0.0f);
          for (int32_t e : sel) {
            float w = prob[size_t(e)] / std::max(wsum, 6.103515625e-5f);
            if (c.expert_scale != 0.0f && c.expert_scale != 1.0f) w *= c.expert_scale;
            for (int64_t f = 0; f < F; ++f) {
              float gs = 0.0f, us = 0.0f;
              const float* gw = L.gate_exps.data() + E * (f + F * e);
              const float* uw = L.up_exps.data() + E * (f + F * e);
              for (int64_t i = 0; i < E; ++i) { gs += gw[i] * hn[size_t(i)]; us += uw[i] * hn[size_t(i)]; }
              gbuf[size_t(f)] = swiglu_clamp(gs, us, c.swiglu_clamp);
            }
            for (int64_t o = 0; o < E; ++o) {
              float s = 0.0f;
              const float* dw = L.down_exps.data() + F * (o + E * e);
              for (int64_t f = 0; f < F; ++f) s += dw[f] * gbuf[size_t(f)];
              y[size_t(o)] += w * s;
            }
          }
          project(L.gate_sh, hn.data(), E, FS, gbuf.data());
          project(L.up_sh, hn.data(), E, FS, ubuf.data());
          for (int64_t f = 0; f < FS; ++f) gbuf[size_t(f)] = swiglu_clamp(gbuf[size_t(f)], ubuf[size_t(f)], c.swiglu_clamp);
          project(L.down_sh, gbuf.data(), FS, E, eo.data());
          for (int64_t o = 0; o < E; ++o) y[size_t(o)] += eo[size_t(o)];
          dsv4_hc_post(mix, y.data(), xa.data() + tc * 4 * E, E, x.data() + tc * 4 * E);
        }
      });
      // the next chunk's queries reach back at most W-1 positions
      const int64_t keep = std::min<int64_t>(W, p0 + n - kc.win_first);
      kc.win.erase(kc.win.begin(), kc.win.end() - keep * D);
      kc.win_first = p0 + n - keep;
    }
    done = p0 + n;
  }
  return done;
}

}  // namespace pdb
