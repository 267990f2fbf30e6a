#include "numerics/deepseek4_blocks.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "formats/numeric.h"
#include "numerics/rmsnorm.h"

namespace pdb {

Dsv4HcMix dsv4_hc_pre(const Dsv4HcWeights& w, const float* x, int64_t E, float rms_eps, float hc_eps, int iters, float* y) {
  const auto& fn = *w.fn;
  const auto& base = *w.base;
  const auto& scale = *w.scale;
  if (int64_t(fn.size()) != 24 * 4 * E || base.size() != 24 || scale.size() != 3) throw std::runtime_error("deepseek4 hc weights have unexpected shapes");
  std::vector<float> flatn(static_cast<size_t>(4 * E));
  rmsnorm_rows(x, nullptr, flatn.data(), 1, 4 * E, rms_eps);
  float m[24];
  for (int o = 0; o < 24; ++o) {
    float s = 0.0f;
    const float* r = fn.data() + int64_t(o) * 4 * E;
    for (int64_t i = 0; i < 4 * E; ++i) s += r[i] * flatn[size_t(i)];
    m[o] = s;
  }
  auto sigmoid = [](float v) { return 1.0f / (1.0f + std::exp(-v)); };
  Dsv4HcMix h;
  for (int i = 0; i < 4; ++i) {
    h.pre[i] = sigmoid(m[i] * scale[0] + base[size_t(i)]) + hc_eps;
    h.post[i] = 2.0f * sigmoid(m[4 + i] * scale[1] + base[size_t(4 + i)]);
  }
  // Sinkhorn: softmax over dst for each src, + eps, then columns (per dst over src), then (iters - 1) x rows + columns
  for (int src = 0; src < 4; ++src) {
    float v[4], mx = -INFINITY, sum = 0.0f;
    for (int dst = 0; dst < 4; ++dst) {
      v[dst] = m[8 + dst + 4 * src] * scale[2] + base[size_t(8 + dst + 4 * src)];
      mx = std::max(mx, v[dst]);
    }
    for (int dst = 0; dst < 4; ++dst) sum += (v[dst] = std::exp(v[dst] - mx));
    for (int dst = 0; dst < 4; ++dst) h.comb[dst][src] = v[dst] / sum + hc_eps;
  }
  auto norm_cols = [&] {
    for (int dst = 0; dst < 4; ++dst) {
      float s = 0.0f;
      for (int src = 0; src < 4; ++src) s += h.comb[dst][src];
      for (int src = 0; src < 4; ++src) h.comb[dst][src] /= s + hc_eps;
    }
  };
  auto norm_rows = [&] {
    for (int src = 0; src < 4; ++src) {
      float s = 0.0f;
      for (int dst = 0; dst < 4; ++dst) s += h.comb[dst][src];
      for (int dst = 0; dst < 4; ++dst) h.comb[dst][src] /= s + hc_eps;
    }
  };
  norm_cols();
  for (int i = 1; i < iters; ++i) {
    norm_rows();
    norm_cols();
  }
  for (int64_t i = 0; i < E; ++i) {
    float s = 0.0f;
    for (int hh = 0; hh < 4; ++hh) s += x[hh * E + i] * h.pre[hh];
    y[i] = s;
  }
  return h;
}

void dsv4_hc_post(const Dsv4HcMix& m, const float* f, const float* x, int64_t E, float* x_next) {
  for (int dst = 0; dst < 4; ++dst)
    for (int64_t i = 0; i < E; ++i) {
      float s = f[i] * m.post[dst];
      for (int src = 0; src < 4; ++src) s += x[src * E + i] * m.comb[dst][src];
      x_next[dst * E + i] = s;
    }
}

GgmlRopeParams dsv4_rope(const Deepseek4Config& c, int64_t ratio) {
  GgmlRopeParams rp;
  rp.n_dims = int(c.rope_dims);
  rp.mode = RopeMode::Norm;
  rp.freq_base = ratio ? c.compress_rope_base : c.rope_base;
  if (ratio && c.yarn_factor > 0.0f) {
    rp.freq_scale = 1.0f / c.yarn_factor;
    rp.ext_factor = 1.0f;
    rp.n_ctx_orig = int(c.yarn_orig_ctx);
    rp.beta_fast = 32.0f;
    rp.beta_slow = 1.0f;
    rp.attn_factor = 1.0f / (1.0f + 0.1f * logf(1.0f / rp.freq_scale));
  }
  return rp;
}

std::vector<int64_t> dsv4_indexer_select(const float* q, const float* w, const float* keys, int64_t heads, int64_t dim, int64_t visible,
                                         int64_t top_k, std::vector<float>* scores_out) {
  std::vector<float> sc(static_cast<size_t>(visible));
  for (int64_t b = 0; b < visible; ++b) {
    float s = 0.0f;
    for (int64_t h = 0; h < heads; ++h) {
      float d = 0.0f;
      for (int64_t i = 0; i < dim; ++i) d += q[h * dim + i] * keys[b * dim + i];
      s += w[h] * std::max(d, 0.0f);
    }
    sc[size_t(b)] = s;
  }
  auto order = dsv4_indexer_top_k(sc.data(), visible, top_k);
  if (scores_out) *scores_out = std::move(sc);
  return order;
}

std::vector<int64_t> dsv4_indexer_top_k(const float* sc, int64_t visible, int64_t top_k) {
  std::vector<int64_t> order(static_cast<size_t>(visible));
  for (int64_t b = 0; b < visible; ++b) order[size_t(b)] = b;
  const size_t k = size_t(std::min(visible, top_k));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sc[size_t(a)] > sc[size_t(b)]; });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

void dsv4_indexer_fp8_rows(const float* x, int64_t rows, int64_t dim, uint8_t* codes, float* scales, float* values) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * dim;
    float amax = 0.0f;
    for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(row[i]));
    float scale = 1.0f;
    if (amax > 0.0f) {
      int e;
      const float m = std::frexp(amax / 448.0f, &e);  // amax / 448 = m 2^e, m in [0.5, 1): ceil(log2) is e, or e - 1 at m = 0.5
      scale = std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
    }
    if (scales) scales[r] = scale;
    for (int64_t i = 0; i < dim; ++i) {
      const uint8_t c = f32_to_fp8_e4m3(row[i] / scale);
      if (codes) codes[r * dim + i] = c;
      if (values) values[r * dim + i] = fp8_e4m3_to_f32(c) * scale;
    }
  }
}

void dsv4_attend(const float* q, const std::vector<const float*>& keys, const float* sinks, int64_t heads, int64_t dim, float scale, float* out) {
  std::vector<float> sc(keys.size());
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * dim;
    float mx = sinks[h];
    for (size_t j = 0; j < keys.size(); ++j) {
      float s = 0.0f;
      for (int64_t i = 0; i < dim; ++i) s += qh[i] * keys[j][i];
      sc[j] = s * scale;
      mx = std::max(mx, sc[j]);
    }
    float den = std::exp(sinks[h] - mx);
    for (auto& s : sc) den += (s = std::exp(s - mx));
    float* oh = out + h * dim;
    std::fill(oh, oh + dim, 0.0f);
    for (size_t j = 0; j < keys.size(); ++j)
      for (int64_t i = 0; i < dim; ++i) oh[i] += sc[j] / den * keys[j][i];
  }
}

}  // namespace pdb
