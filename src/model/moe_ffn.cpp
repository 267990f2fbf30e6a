#include "model/moe_ffn.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/parallel.h"
#include "formats/numeric.h"
#include "numerics/decoder_numerics.h"
#include "numerics/gemm_lanes.h"

namespace pdb {
namespace {

float round_to(float v, int precision) { return precision == 16 ? round_f16(v) : precision == 17 ? round_bf16(v) : v; }

// ggml_compute_forward_argsort, GGML_SORT_ORDER_DESC: std::sort of the indices (not stable; ties
// between exactly equal probabilities are as unordered there as here).
void top_k_desc(const float* p, int64_t n, int64_t k, int32_t* out) {
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [p](int32_t a, int32_t b) { return p[a] > p[b]; });
  std::copy_n(idx.begin(), k, out);
}

}  // namespace

MoeRouting moe_route(const MoeWeights& w, const float* x, int64_t rows, int lanes, int threads) {
  const int64_t E = w.n_expert, K = w.n_used, H = w.hidden;
  std::vector<float> logits(static_cast<size_t>(rows * E));
  // The router is F32 in the GGUF: its input is not rounded, and tinyBLAS sums it like any F32 matmul.
  if (lanes && H % lanes == 0) gemm_lanes(x, w.router.data(), logits.data(), rows, E, H, lanes, threads);
  else
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(E), int(H), 1.0f, x, int(H), w.router.data(), int(H), 0.0f,
                logits.data(), int(E));
  MoeRouting r;
  r.experts.resize(size_t(rows * K));
  r.weights.resize(size_t(rows * K));
  parallel_for(rows, threads, [&](int64_t b, int64_t e) {
    std::vector<float> probs(static_cast<size_t>(E));
    for (int64_t t = b; t < e; ++t) {
      const float* lg = logits.data() + t * E;
      if (lanes) ggmlnum::soft_max_row(lg, probs.data(), E, lanes);
      else {
        const float m = *std::max_element(lg, lg + E);
        double s = 0;
        for (int64_t i = 0; i < E; ++i) s += probs[size_t(i)] = std::exp(lg[i] - m);
        for (auto& p : probs) p = float(p / s);
      }
      int32_t* sel = r.experts.data() + t * K;
      float* wt = r.weights.data() + t * K;
      top_k_desc(probs.data(), E, K, sel);
      for (int64_t j = 0; j < K; ++j) wt[j] = probs[size_t(sel[j])];
      if (w.norm_topk) {  // ggml_sum_rows (double), ggml_clamp, ggml_div
        double s = 0;
        for (int64_t j = 0; j < K; ++j) s += double(wt[j]);
        const float sum = std::max(float(s), 6.103515625e-5f);
        for (int64_t j = 0; j < K; ++j) wt[j] = wt[j] / sum;
      }
      if (w.w_scale != 0.0f && w.w_scale != 1.0f)
        for (int64_t j = 0; j < K; ++j) wt[j] *= w.w_scale;
    }
  });
  return r;
}

void moe_ffn(const MoeWeights& w, const float* x, int64_t rows, int lanes, int act_precision, int threads, float* out) {
  const int64_t K = w.n_used, H = w.hidden, F = w.ff, E = w.n_expert;
  const MoeRouting r = moe_route(w, x, rows, lanes, threads);
  if (lanes) {
    // Per token: each selected expert's gate/up rows, SwiGLU, down rows, times its weight, summed in order.
    auto dot = act_precision == 32 ? ggmlnum::vec_dot_f32 : ggmlnum::vec_dot_f16;
    parallel_for(rows, threads, [&](int64_t b, int64_t e) {
      std::vector<float> xin(static_cast<size_t>(H)), g(static_cast<size_t>(F)), u(static_cast<size_t>(F)), y(static_cast<size_t>(H));
      for (int64_t t = b; t < e; ++t) {
        for (int64_t i = 0; i < H; ++i) xin[size_t(i)] = round_to(x[t * H + i], act_precision);
        float* o = out + t * H;
        for (int64_t j = 0; j < K; ++j) {
          const int32_t ex = r.experts[size_t(t * K + j)];
          const float* wg = w.gate[size_t(ex)].data();
          const float* wu = w.up[size_t(ex)].data();
          const float* wd = w.down[size_t(ex)].data();
          for (int64_t f = 0; f < F; ++f) {
            g[size_t(f)] = dot(xin.data(), wg + f * H, H, lanes);
            u[size_t(f)] = dot(xin.data(), wu + f * H, H, lanes);
          }
          ggmlnum::swiglu(1, F, g.data(), g.data(), u.data(), lanes);
          for (auto& v : g) v = round_to(v, act_precision);
          const float wt = r.weights[size_t(t * K + j)];
          for (int64_t hcol = 0; hcol < H; ++hcol) y[size_t(hcol)] = dot(g.data(), wd + hcol * F, F, lanes) * wt;
          if (j == 0) std::copy(y.begin(), y.end(), o);
          else
            for (int64_t i = 0; i < H; ++i) o[i] = o[i] + y[size_t(i)];
        }
      }
    });
    return;
  }
  // Fast path: gather each expert's tokens, three GEMMs, scatter-add weighted results.
  std::fill(out, out + rows * H, 0.0f);
  std::vector<std::vector<std::pair<int64_t, float>>> assigned(static_cast<size_t>(E));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < K; ++j) assigned[size_t(r.experts[size_t(t * K + j)])].push_back({t, r.weights[size_t(t * K + j)]});
  std::vector<float> xs, g, u, y;
  for (int64_t ex = 0; ex < E; ++ex) {
    const auto& toks = assigned[size_t(ex)];
    const int64_t n = int64_t(toks.size());
    if (!n) continue;
    xs.resize(size_t(n * H));
    for (int64_t i = 0; i < n; ++i) std::copy_n(x + toks[size_t(i)].first * H, H, xs.data() + i * H);
    g.resize(size_t(n * F));
    u.resize(size_t(n * F));
    y.resize(size_t(n * H));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(F), int(H), 1.0f, xs.data(), int(H), w.gate[size_t(ex)].data(), int(H), 0.0f, g.data(), int(F));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(F), int(H), 1.0f, xs.data(), int(H), w.up[size_t(ex)].data(), int(H), 0.0f, u.data(), int(F));
    for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(H), int(F), 1.0f, g.data(), int(F), w.down[size_t(ex)].data(), int(F), 0.0f, y.data(), int(H));
    for (int64_t i = 0; i < n; ++i) {
      const auto [t, wt] = toks[size_t(i)];
      for (int64_t c = 0; c < H; ++c) out[t * H + c] += wt * y[size_t(i * H + c)];
    }
  }
}

}  // namespace pdb
