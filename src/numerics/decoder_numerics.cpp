#include "numerics/decoder_numerics.h"

#include "formats/numeric.h"
#include "numerics/gemm_lanes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace pdb::ggmlnum {
namespace {
inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
constexpr int64_t kTile = 64;  // GGML_FA_TILE_KV
}  // namespace

namespace {
// ggml_v_expf for __m256 (AVX2) and float32x4_t (NEON: the same operations, lane for lane).
float v_expf_avx2(float x) {
  const float r = 0x1.8p23f;
  const float z = std::fma(x, 0x1.715476p+0f, r);
  const float n = z - r;
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  const uint32_t e = bits(z) << 23;
  const float k = from_bits(e + bits(1.0f));
  const bool c = std::fabs(n) > 126.0f;
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                           0x1.ffffecp-1f * b);
  if (!c) return std::fma(j, k, k);
  const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
  const float s1 = from_bits(g + 0x7f000000u);
  const float s2 = from_bits(e - g);
  if (std::fabs(n) > 192.0f) return s1 * s1;
  return std::fma(s2, j, s2) * s1;
}

// ggml_v_expf for __m512: the polynomial keeps its constant 1 and _mm512_scalef_ps multiplies by
// 2^n, rounding once (subnormal results included), which std::ldexp reproduces.
float v_expf_avx512(float x) {
  const float r = 0x1.8p23f;
  const float z = std::fma(x, 0x1.715476p+0f, r);
  const float n = z - r;
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                           std::fma(0x1.ffffecp-1f, b, 1.0f));
  if (std::fabs(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
  return std::ldexp(j, int(n));
}

int checked_lanes(int lanes) { return lanes == 4 || lanes == 16 ? lanes : 8; }
}  // namespace

float v_expf(float x, int lanes) { return checked_lanes(lanes) == 16 ? v_expf_avx512(x) : v_expf_avx2(x); }

float silu(float x, int lanes) {
  const float e = v_expf(0.0f - x, lanes);
  return x / (1.0f + e);
}

void swiglu(int64_t rows, int64_t n, float* y, const float* gate, const float* up, int lanes) {
  lanes = checked_lanes(lanes);
  const int64_t vec_end = n / lanes * lanes;
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * n;
    const float *g = gate + r * n, *u = up + r * n;
    for (int64_t i = 0; i < vec_end; ++i) yr[i] = silu(g[i], lanes) * u[i];
    for (int64_t i = vec_end; i < n; ++i) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];  // ggml_silu_f32
  }
}

namespace {
// GGML_F32_VEC_REDUCE over GGML_F32_ARR = 4 vectors of `lanes` floats held in acc[0 .. 4*lanes).
float reduce_vec_dot(float* acc, int lanes) {
  for (int i = 0; i < 2 * lanes; ++i) acc[i] = acc[i] + acc[i + 2 * lanes];
  for (int i = 0; i < lanes; ++i) acc[i] = acc[i] + acc[i + lanes];
  if (lanes == 8) {  // _mm_add_ps(lo, hi), then two _mm_hadd_ps: neighbour pairs
    for (int i = 0; i < 4; ++i) acc[i] = acc[i] + acc[i + 4];
    return fold_lanes(acc, 4);
  }
  return fold_lanes(acc, lanes);  // _mm512_reduce_add_ps halves; vaddvq_f32 neighbour pairs
}

// The vectorized part of ggml_vec_dot_f32/_f16: elements [0, *np) summed and reduced.
float vec_dot_body(const float* x, const float* y, int64_t n, int lanes, int64_t* np) {
  const int64_t step = 4 * int64_t(lanes);
  *np = n / step * step;
  float acc[64] = {};
  for (int64_t i = 0; i < *np; i += step)
    for (int64_t j = 0; j < step; ++j) acc[j] = std::fma(x[i + j], y[i + j], acc[j]);
  return reduce_vec_dot(acc, lanes);
}
}  // namespace

float vec_dot_f32(const float* x, const float* y, int64_t n, int lanes) {
  int64_t np = 0;
  float sum = vec_dot_body(x, y, n, checked_lanes(lanes), &np);
  for (int64_t i = np; i < n; ++i) sum = std::fma(x[i], y[i], sum);  // `sumf += x[i]*y[i]`, contracted
  return sum;
}

float vec_dot_f16(const float* x, const float* y, int64_t n, int lanes) {
  int64_t np = 0;
  double sum = double(vec_dot_body(x, y, n, checked_lanes(lanes), &np));
  for (int64_t i = np; i < n; ++i) sum += double(x[i] * y[i]);
  return float(sum);
}

void soft_max_row(const float* x, float* y, int64_t n, int lanes) {
  lanes = checked_lanes(lanes);
  float max = -INFINITY;
  for (int64_t i = 0; i < n; ++i) max = std::max(max, x[i]);
  double sum = 0;
  int64_t i = 0;
  float v[16];
  for (; i + lanes <= n; i += lanes) {
    for (int l = 0; l < lanes; ++l) v[l] = y[i + l] = v_expf(x[i + l] - max, lanes);
    sum += double(fold_lanes(v, lanes));
  }
  for (; i < n; ++i) {
    const float e = expf(x[i] - max);
    sum += double(e);
    y[i] = e;
  }
  const float inv = float(1.0 / sum);
  for (int64_t k = 0; k < n; ++k) y[k] *= inv;
}

void flash_attn_row(const float* q, const float* k, const float* v, int64_t stride, int64_t n_valid, int64_t hd, float scale,
                    float* out, int lanes) {
  flash_attn_row_kv(q, k, v, stride, n_valid, hd, hd, scale, out, lanes);
}

void flash_attn_row_kv(const float* q, const float* k, const float* v, int64_t stride, int64_t n_valid, int64_t hd, int64_t dv,
                       float scale, float* out, int lanes) {
  lanes = checked_lanes(lanes);
  float M = -INFINITY, S = 0.0f;
  std::vector<float> acc(static_cast<size_t>(dv), 0.0f);
  float p[kTile];
  for (int64_t t0 = 0; t0 < n_valid; t0 += kTile) {
    const int64_t nt = std::min(kTile, n_valid - t0);
    float tile_max = -INFINITY;
    for (int64_t j = 0; j < nt; ++j) {
      const float* kr = k + (t0 + j) * stride;
      float s = 0.0f;
      for (int64_t d = 0; d < hd; ++d) s = std::fma(q[d], kr[d], s);
      p[j] = s * scale;
      tile_max = std::max(tile_max, p[j]);
    }
    const float Mnew = std::fmax(M, tile_max);
    if (Mnew > M) {
      const float ms = expf(M - Mnew);
      for (int64_t d = 0; d < dv; ++d) acc[size_t(d)] *= ms;
      S *= ms;
    }
    M = Mnew;
    // ggml_vec_soft_max_f32 over the 64-wide tile: masked entries (past the causal limit) are exp(-inf) = 0
    double sum = 0;
    for (int64_t g0 = 0; g0 < kTile; g0 += lanes) {
      float e[16];
      for (int i = 0; i < lanes; ++i) {
        const int64_t j = g0 + i;
        e[i] = j < nt ? v_expf(p[j] - M, lanes) : 0.0f;
        if (j < nt) p[j] = e[i];
      }
      sum += double(fold_lanes(e, lanes));  // the ISA's horizontal sum (halves on x86, neighbours on NEON)
    }
    S = float(double(S) + sum);
    for (int64_t j = 0; j < nt; ++j) {
      const float* vr = v + (t0 + j) * stride;
      for (int64_t d = 0; d < dv; ++d) acc[size_t(d)] = std::fma(p[j], vr[d], acc[size_t(d)]);
    }
  }
  const float inv = S == 0.0f ? 0.0f : 1.0f / S;
  for (int64_t d = 0; d < dv; ++d) out[d] = acc[size_t(d)] * inv;
}

}  // namespace pdb::ggmlnum

namespace pdb::ggmlnum {

float vec_dot_q8_0(const uint8_t* x, const uint8_t* y, int64_t n) {
  float acc[8] = {};
  for (int64_t b = 0; b < n / 32; ++b) {
    const uint8_t* xb = x + b * 34;
    const uint8_t* yb = y + b * 34;
    uint16_t dx, dy;
    std::memcpy(&dx, xb, 2);
    std::memcpy(&dy, yb, 2);
    const float d = fp16_to_f32(dx) * fp16_to_f32(dy);
    for (int l = 0; l < 8; ++l) {
      int32_t s = 0;
      for (int t = 0; t < 4; ++t) s += int32_t(int8_t(xb[2 + 4 * l + t])) * int32_t(int8_t(yb[2 + 4 * l + t]));
      acc[l] = std::fma(d, float(s), acc[l]);
    }
  }
  const float r0 = acc[4] + acc[0], r1 = acc[5] + acc[1], r2 = acc[6] + acc[2], r3 = acc[7] + acc[3];
  return (r0 + r2) + (r1 + r3);
}

void flash_attn_row_q8(const uint8_t* q_q8, const uint8_t* k_q8, int64_t k_stride, const float* v, int64_t v_stride, int64_t n_valid,
                       int64_t hd, float scale, float* out) {
  float S = 0.0f, M = -INFINITY;
  std::vector<float> acc(static_cast<size_t>(hd), 0.0f);
  for (int64_t ic = 0; ic < n_valid; ++ic) {
    float s = vec_dot_q8_0(k_q8 + ic * k_stride, q_q8, hd);
    s = s * scale;
    const float Mold = M;
    float ms = 1.0f, vs = 1.0f;
    if (s > M) {
      M = s;
      ms = expf(Mold - M);
      for (int64_t d = 0; d < hd; ++d) acc[size_t(d)] *= ms;
    } else {
      vs = expf(s - M);
    }
    const float* vr = v + ic * v_stride;
    for (int64_t d = 0; d < hd; ++d) acc[size_t(d)] = std::fma(vr[d], vs, acc[size_t(d)]);
    S = S * ms + vs;
  }
  const float inv = S == 0.0f ? 0.0f : 1.0f / S;
  for (int64_t d = 0; d < hd; ++d) out[d] = acc[size_t(d)] * inv;
}

ActQuant act_quant_for(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::Q8_0: case GgmlType::IQ4_NL:
    case GgmlType::MXFP4: return ActQuant::q8_0;
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q4_K: case GgmlType::Q5_K: case GgmlType::Q6_K: case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XXS: case GgmlType::IQ2_XS: case GgmlType::IQ2_S: case GgmlType::IQ3_XXS: case GgmlType::IQ3_S: case GgmlType::IQ1_S:
    case GgmlType::IQ1_M: return ActQuant::q8_k;
    default: return ActQuant::none;
  }
}

namespace {
void round_q8_0(float* x, int64_t n) {
  for (int64_t b = 0; b + 32 <= n; b += 32) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    const float d = round_f16(amax / 127.0f), id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; ++j) x[b + j] = d * std::nearbyint(x[b + j] * id);
  }
}

void round_q8_k(float* x, int64_t n) {
  for (int64_t b = 0; b + 256 <= n; b += 256) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; ++j)
      if (std::fabs(x[b + j]) > amax) { amax = std::fabs(x[b + j]); max = x[b + j]; }
    if (amax == 0.0f) continue;
    const float iscale = -127.0f / max, d = 1.0f / iscale;
    // ggml's nearest_int(iscale * x) rounds the f32 product half to even. Not written as its `+ 12582912.f`: this
    // file is compiled with FMA contraction (for ggml-cpu's), which would fuse that add into the product and round
    // the exact value instead (ggml-base is built without FMA: the ties at half the largest value, common in bf16 rows,
    // differ).
    for (int j = 0; j < 256; ++j) x[b + j] = d * float(std::min(127, int(std::nearbyint(iscale * x[b + j]))));
  }
}
}  // namespace

void round_through(ActQuant q, float* x, int64_t rows, int64_t cols) {
  const int64_t block = q == ActQuant::q8_0 ? 32 : 256;
  if (q == ActQuant::none || cols % block) return;
  for (int64_t r = 0; r < rows; ++r) q == ActQuant::q8_0 ? round_q8_0(x + r * cols, cols) : round_q8_k(x + r * cols, cols);
}

bool carries_q8_1_sums(GgmlType t) { return t == GgmlType::Q4_1 || t == GgmlType::Q5_1; }

void q8_1_sum_corrections(const float* x, int64_t rows, int64_t cols, float* c) {
  const int64_t nb = cols / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * cols + b * 32;
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) sum += int(std::nearbyint(v[j] * id));
      const float s = float(sum);
      c[r * nb + b] = round_f16(d * s) - round_f16(d) * s;
    }
}

std::vector<float> q8_1_block_mins(GgmlType t, const uint8_t* blocks, int64_t rows, int64_t cols) {
  if (!carries_q8_1_sums(t)) throw std::invalid_argument("q8_1_block_mins: Q4_1 or Q5_1");
  const int64_t nb = rows * (cols / 32);
  const size_t bytes = traits(t).type_size;
  std::vector<float> m(static_cast<size_t>(nb));
  for (int64_t i = 0; i < nb; ++i) {
    uint16_t h;
    std::memcpy(&h, blocks + size_t(i) * bytes + 2, 2);
    m[size_t(i)] = fp16_to_f32(h);
  }
  return m;
}

}  // namespace pdb::ggmlnum
