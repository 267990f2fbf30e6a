#include "numerics/rope_ggml.h"

#include <algorithm>
#include <cmath>

namespace pdb {
namespace {

float corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
  return n_dims * logf(n_ctx_orig / (n_rot * 2 * float(M_PI))) / (2 * logf(base));
}

float yarn_ramp(float low, float high, int64_t i0) {
  const float y = (i0 / 2 - low) / std::max(0.001f, high - low);
  return 1 - std::min(1.0f, std::max(0.0f, y));
}

}  // namespace

void ggml_rope_cache(const GgmlRopeParams& p, int64_t pos, float* cache) {
  const float theta_scale = powf(p.freq_base, -2.0f / float(p.n_dims));
  float corr[2] = {0, 0};
  if (p.ext_factor != 0.0f) {
    corr[0] = std::max(0.0f, floorf(corr_dim(p.n_dims, p.n_ctx_orig, p.beta_fast, p.freq_base)));
    corr[1] = std::min(float(p.n_dims - 1), ceilf(corr_dim(p.n_dims, p.n_ctx_orig, p.beta_slow, p.freq_base)));
  }
  float theta = float(pos);
  for (int64_t i0 = 0; i0 < p.n_dims; i0 += 2) {
    const float ff = p.freq_factors.empty() ? 1.0f : p.freq_factors[size_t(i0 / 2)];
    const float theta_extrap = theta / ff;
    const float theta_interp = p.freq_scale * theta_extrap;
    float th = theta_interp;
    float mscale = p.attn_factor;
    if (p.ext_factor != 0.0f) {
      const float ramp_mix = yarn_ramp(corr[0], corr[1], i0) * p.ext_factor;
      th = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix;
      mscale *= 1.0f + 0.1f * logf(1.0f / p.freq_scale);
    }
    cache[i0 + 0] = cosf(th) * mscale;
    cache[i0 + 1] = sinf(th) * mscale;
    theta *= theta_scale;
  }
}

void ggml_rope_apply(const GgmlRopeParams& p, const float* cache, float* x) {
  const int64_t n = p.n_dims;
  for (int64_t i0 = 0; i0 < n; i0 += 2) {
    const float c = cache[i0], s = cache[i0 + 1];
    float *a, *b;
    if (p.mode == RopeMode::Norm) { a = x + i0; b = x + i0 + 1; }
    else { a = x + i0 / 2; b = x + i0 / 2 + n / 2; }
    const float x0 = *a, x1 = *b;
    *a = x0 * c - x1 * s;
    *b = x0 * s + x1 * c;
  }
}

}  // namespace pdb
