#include "numerics/reference_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "formats/numeric.h"

namespace pdb::ref {

void causal_attention(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, std::vector<float>& out,
                      int64_t n_q, int64_t pos0, int H, int KV, int D, int64_t cap, float scale, int DV) {
  if (DV == 0) DV = D;
  out.assign(size_t(n_q * H * DV), 0.0f);
  std::vector<double> s;
  for (int64_t i = 0; i < n_q; ++i)
    for (int h = 0; h < H; ++h) {
      const int kvh = h / (H / KV);
      const int64_t n_keys = pos0 + i + 1;
      s.assign(size_t(n_keys), 0.0);
      double mx = -1e300;
      for (int64_t j = 0; j < n_keys; ++j) {
        double d = 0;
        for (int c = 0; c < D; ++c) d += double(q[size_t((i * H + h) * D + c)]) * double(k[size_t((kvh * cap + j) * D + c)]);
        s[size_t(j)] = d * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double sum = 0;
      for (auto& x : s) { x = std::exp(x - mx); sum += x; }
      for (int c = 0; c < DV; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < n_keys; ++j) acc += s[size_t(j)] * double(v[size_t((kvh * cap + j) * DV + c)]);
        out[size_t((i * H + h) * DV + c)] = float(acc / sum);
      }
    }
}

void qkv_rope_to_cache(const std::vector<float>& qkv, std::vector<float>& q_out, std::vector<float>& k_cache, std::vector<float>& v_cache,
                       int64_t rows, int64_t pos0, int H, int KV, int D, const std::vector<float>& inv_freq, float attn_scale,
                       const float* q_norm, const float* k_norm, float eps, int64_t cap) {
  const int heads = H + 2 * KV;
  q_out.resize(size_t(rows * H * D));
  std::vector<float> x(static_cast<size_t>(D));
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h) {
      for (int c = 0; c < D; ++c) x[size_t(c)] = qkv[size_t((r * heads + h) * D + c)];
      const int64_t pos = pos0 + r;
      if (h >= H + KV) {
        for (int c = 0; c < D; ++c) v_cache[size_t((int64_t(h - H - KV) * cap + pos) * D + c)] = x[size_t(c)];
        continue;
      }
      const bool is_q = h < H;
      if (const float* nw = is_q ? q_norm : k_norm) {
        double ss = 0;
        for (float e : x) ss += double(e) * e;
        const double sc = 1.0 / std::sqrt(ss / D + eps);
        for (int c = 0; c < D; ++c) x[size_t(c)] = float(x[size_t(c)] * sc * nw[c]);
      }
      float* dst = is_q ? &q_out[size_t((r * H + h) * D)] : &k_cache[size_t((int64_t(h - H) * cap + pos) * D)];
      for (int c = 0; c < D / 2; ++c) {
        const double ang = double(float(pos) * inv_freq[size_t(c)]);
        const double cs = std::cos(ang) * attn_scale, sn = std::sin(ang) * attn_scale;
        const double x0 = x[size_t(c)], x1 = x[size_t(c + D / 2)];
        dst[c] = float(x0 * cs - x1 * sn);
        dst[c + D / 2] = float(x1 * cs + x0 * sn);
      }
    }
}

void swiglu_rows(const std::vector<float>& gu, std::vector<float>& out, int64_t rows, int64_t ff) {
  out.resize(size_t(rows * ff));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < ff; ++i) {
      const double g = gu[size_t(r * 2 * ff + i)], u = gu[size_t(r * 2 * ff + ff + i)];
      out[size_t(r * ff + i)] = float(g / (1.0 + std::exp(-g)) * u);
    }
}

void matmul_xwt(const std::vector<float>& x, const std::vector<float>& w, std::vector<float>& y, int64_t rows, int64_t in, int64_t out) {
  y.assign(size_t(rows * out), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < in; ++i) acc += double(x[size_t(r * in + i)]) * double(w[size_t(o * in + i)]);
      y[size_t(r * out + o)] = float(acc);
    }
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void quantize_rows_fp8(const std::vector<float>& x, int64_t rows, int64_t k, std::vector<uint8_t>& q, std::vector<float>& scales) {
  const int64_t kb_n = k / 128;
  q.assign(size_t(rows * k), 0);
  scales.assign(size_t(rows * kb_n), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < kb_n; ++kb) {
      const float* xb = x.data() + r * k + kb * 128;
      float amax = 0.0f;
      for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
      for (int i = 0; i < 128; ++i) q[size_t(r * k + kb * 128 + i)] = f32_to_fp8_e4m3(xb[i] / scale);
      scales[size_t(r * kb_n + kb)] = scale;
    }
}

}  // namespace pdb::ref
