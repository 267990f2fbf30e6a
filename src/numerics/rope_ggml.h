// RoPE exactly as ggml-cpu computes it (ops.cpp: ggml_rope_cache_init / rope_yarn / rotate_pairs):
// theta starts at float(pos) and is multiplied by powf(base, -2/n_dims) once per pair, divided by
// the per-pair freq factor, YaRN-ramped, and cos/sin scaled by mscale.
#pragma once
#include <cstdint>
#include <vector>

namespace pdb {

enum class RopeMode { Norm, Neox };  // Norm: pairs (2i, 2i+1); Neox: pairs (i, i + n_dims/2)

struct GgmlRopeParams {
  int n_dims = 0;
  float freq_base = 10000.0f;
  float freq_scale = 1.0f;  // 1/factor for linear and yarn
  float ext_factor = 0.0f;  // 1 for yarn
  float attn_factor = 1.0f;
  float beta_fast = 32.0f, beta_slow = 1.0f;
  int n_ctx_orig = 0;
  std::vector<float> freq_factors;  // rope_freqs.weight (llama3), empty if none
  RopeMode mode = RopeMode::Norm;
};

// cos/sin cache for one position: cache[2i] = cos, cache[2i+1] = sin, for i < n_dims/2.
void ggml_rope_cache(const GgmlRopeParams& p, int64_t pos, float* cache);
// Rotates one head in place (n_dims <= head_dim; channels past n_dims are left as they are).
void ggml_rope_apply(const GgmlRopeParams& p, const float* cache, float* head);

}  // namespace pdb
