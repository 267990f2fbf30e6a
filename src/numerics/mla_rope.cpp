#include "numerics/mla_rope.h"

#include <cmath>
#include <stdexcept>

namespace pdb {

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

}  // namespace pdb
