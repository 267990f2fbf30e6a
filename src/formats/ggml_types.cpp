#include "formats/ggml_types.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "formats/numeric.h"

namespace pdb {
namespace {

constexpr int QK = 32;     // Q4_0 / Q8_0 / MXFP4 block
constexpr int QK_K = 256;  // K-quant super-block

struct Entry { uint32_t id; GgmlTypeTraits t; };
constexpr Entry kTypes[] = {
    {0, {"f32", 1, 4}},        {1, {"f16", 1, 2}},        {2, {"q4_0", 32, 18}},     {3, {"q4_1", 32, 20}},
    {6, {"q5_0", 32, 22}},     {7, {"q5_1", 32, 24}},     {8, {"q8_0", 32, 34}},     {9, {"q8_1", 32, 36}},
    {10, {"q2_K", 256, 84}},   {11, {"q3_K", 256, 110}},  {12, {"q4_K", 256, 144}},  {13, {"q5_K", 256, 176}},
    {14, {"q6_K", 256, 210}},  {15, {"q8_K", 256, 292}},  {16, {"iq2_xxs", 256, 66}}, {17, {"iq2_xs", 256, 74}},
    {18, {"iq3_xxs", 256, 98}}, {19, {"iq1_s", 256, 50}}, {20, {"iq4_nl", 32, 18}},  {21, {"iq3_s", 256, 110}},
    {22, {"iq2_s", 256, 82}},  {23, {"iq4_xs", 256, 136}}, {24, {"i8", 1, 1}},       {25, {"i16", 1, 2}},
    {26, {"i32", 1, 4}},       {27, {"i64", 1, 8}},       {28, {"f64", 1, 8}},       {29, {"iq1_m", 256, 56}},
    {30, {"bf16", 1, 2}},      {34, {"tq1_0", 256, 54}},  {35, {"tq2_0", 256, 66}},  {39, {"mxfp4", 32, 17}},
    {40, {"nvfp4", 64, 36}},   {41, {"q1_0", 128, 18}},   {42, {"q2_0", 64, 18}},
};

// IQ4_NL / IQ4_XS code values (ggml's kvalues_iq4nl: a non-linear 4-bit grid).
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// E2M1 values doubled, as ggml's kvalues_mxfp4 (the E8M0 "half" scale compensates).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline void wr16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// ggml_e8m0_to_fp32_half: 2^(e-128), with the two denormal cases spelled out.
inline float e8m0_half(uint8_t e) {
  uint32_t bits = e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23);
  return bits_f32(bits);
}

void check_blocks(GgmlType t, int64_t n) {
  const auto& tr = traits(t);
  if (n % tr.block_size != 0)
    throw std::invalid_argument(fmt::format("{}: {} elements is not a multiple of the block size {}",
                                            tr.name, n, tr.block_size));
}

void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m);

// Q4_K / Q5_K: the scale and min of sub-blocks j and j + 1 (their 64 weights), times the super-block's d and dmin.
struct KScales { float d1, m1, d2, m2; };
KScales k4_scales(const uint8_t* scales, int j, float d, float dmin) {
  uint8_t sc, m;
  KScales k;
  get_scale_min_k4(j + 0, scales, &sc, &m);
  k.d1 = d * sc;
  k.m1 = dmin * m;
  get_scale_min_k4(j + 1, scales, &sc, &m);
  k.d2 = d * sc;
  k.m2 = dmin * m;
  return k;
}

void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

// The decoders below follow ggml-quants.c's dequantize_row_* op for op. Where ggml writes `a * b + c` its compiler may
// fuse the two (an FMA target, -ffp-contract=fast) or not: the same bits either way, since every such product is
// exact in float (an f16 scale of 11 significant bits times a 6-bit sub-scale times a code of at most 5 bits).

void dequantize_q4_1(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK; ++b, src += 20, y += QK) {
    const float d = fp16_to_f32(rd16(src)), m = fp16_to_f32(rd16(src + 2));
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = float(src[4 + j] & 0x0F) * d + m;
      y[j + QK / 2] = float(src[4 + j] >> 4) * d + m;
    }
  }
}

// Q5_0: d, 32 high bits, 16 bytes of low nibbles; codes - 16. Q5_1: d, m, the same bits; codes * d + m.
void dequantize_q5(const uint8_t* src, float* y, int64_t n, bool with_min) {
  const int bytes = with_min ? 24 : 22, off = with_min ? 4 : 2;
  for (int64_t b = 0; b < n / QK; ++b, src += bytes, y += QK) {
    const float d = fp16_to_f32(rd16(src)), m = with_min ? fp16_to_f32(rd16(src + 2)) : 0.0f;
    uint32_t qh;
    std::memcpy(&qh, src + off, 4);
    const uint8_t* qs = src + off + 4;
    for (int j = 0; j < QK / 2; ++j) {
      const uint8_t xh0 = uint8_t(((qh >> (j + 0)) << 4) & 0x10), xh1 = uint8_t((qh >> (j + 12)) & 0x10);
      const int x0 = (qs[j] & 0x0F) | xh0, x1 = (qs[j] >> 4) | xh1;
      if (with_min) {
        y[j] = float(x0) * d + m;
        y[j + QK / 2] = float(x1) * d + m;
      } else {
        y[j] = float(x0 - 16) * d;
        y[j + QK / 2] = float(x1 - 16) * d;
      }
    }
  }
}

// block_q2_K: scales[16] (4-bit scale | 4-bit min), qs[64] (2-bit codes), d, dmin.
void dequantize_q2_k(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 84) {
    const uint8_t* scales = src;
    const uint8_t* q = src + 16;
    const float d = fp16_to_f32(rd16(src + 80)), dmin = fp16_to_f32(rd16(src + 82));
    int is = 0;
    for (int n128 = 0; n128 < QK_K; n128 += 128) {
      int shift = 0;
      for (int j = 0; j < 4; ++j) {
        for (int half = 0; half < 2; ++half) {
          const uint8_t sc = scales[is++];
          const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
          for (int l = 0; l < 16; ++l) *y++ = dl * float(int8_t((q[l + 16 * half] >> shift) & 3)) - ml;
        }
        shift += 2;
      }
      q += 32;
    }
  }
}

// block_q3_K: hmask[32] (the codes' high bits), qs[64] (low 2 bits), scales[12] (16 6-bit scales), d.
void dequantize_q3_k(const uint8_t* src, float* y, int64_t n) {
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  for (int64_t b = 0; b < n / QK_K; ++b, src += 110) {
    const uint8_t* hm = src;
    const uint8_t* q = src + 32;
    const float d_all = fp16_to_f32(rd16(src + 108));
    uint32_t aux[4];
    std::memcpy(aux, src + 96, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    int8_t scales[16];
    std::memcpy(scales, aux, 16);
    int is = 0;
    uint8_t m = 1;
    for (int n128 = 0; n128 < QK_K; n128 += 128) {
      int shift = 0;
      for (int j = 0; j < 4; ++j) {
        for (int half = 0; half < 2; ++half) {
          const float dl = d_all * float(scales[is++] - 32);
          for (int l = 0; l < 16; ++l) {
            const int i = l + 16 * half;
            *y++ = dl * float(int8_t((q[i] >> shift) & 3) - ((hm[i] & m) ? 0 : 4));
          }
        }
        shift += 2;
        m = uint8_t(m << 1);
      }
      q += 32;
    }
  }
}

// block_q5_K: d, dmin, scales[12] (8 6-bit scale/min pairs), qh[32] (the codes' fifth bits), qs[128].
void dequantize_q5_k(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 176) {
    const float d = fp16_to_f32(rd16(src)), dmin = fp16_to_f32(rd16(src + 2));
    const uint8_t* scales = src + 4;
    const uint8_t* qh = src + 16;
    const uint8_t* ql = src + 48;
    int is = 0;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < QK_K; j += 64) {
      const KScales k = k4_scales(scales, is, d, dmin);
      for (int l = 0; l < 32; ++l) *y++ = k.d1 * float((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - k.m1;
      for (int l = 0; l < 32; ++l) *y++ = k.d2 * float((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - k.m2;
      ql += 32;
      is += 2;
      u1 = uint8_t(u1 << 2);
      u2 = uint8_t(u2 << 2);
    }
  }
}

void dequantize_iq4_nl(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK; ++b, src += 18, y += QK) {
    const float d = fp16_to_f32(rd16(src));
    for (int j = 0; j < QK / 2; ++j) {
      y[j] = d * float(kIq4nlValues[src[2 + j] & 0xF]);
      y[j + QK / 2] = d * float(kIq4nlValues[src[2 + j] >> 4]);
    }
  }
}

// block_iq4_xs: d, scales_h (2 high bits of 8 6-bit scales), scales_l[4] (their low 4 bits), qs[128].
void dequantize_iq4_xs(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 136) {
    const float d = fp16_to_f32(rd16(src));
    const uint16_t scales_h = rd16(src + 2);
    const uint8_t* scales_l = src + 4;
    const uint8_t* qs = src + 8;
    for (int ib = 0; ib < QK_K / 32; ++ib, qs += 16, y += 32) {
      const int ls = ((scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((scales_h >> 2 * ib) & 3) << 4);
      const float dl = d * float(ls - 32);
      for (int j = 0; j < 16; ++j) {
        y[j + 0] = dl * float(kIq4nlValues[qs[j] & 0xf]);
        y[j + 16] = dl * float(kIq4nlValues[qs[j] >> 4]);
      }
    }
  }
}

#include "formats/iq_grids.inc"

// A grid entry's bytes in memory order (ggml reads its tables through a byte pointer).
template <class T>
inline const uint8_t* grid_bytes(const T* grid, int index) { return reinterpret_cast<const uint8_t*>(grid + index); }

// Eight weights of a grid row, each negated where its sign bit is set, times the sub-block scale.
inline void signed_grid8(float* y, float db, const uint8_t* grid, uint8_t signs) {
  for (int j = 0; j < 8; ++j) y[j] = db * grid[j] * (signs & kIqMask[j] ? -1.f : 1.f);
}

// block_iq2_xxs: d, then per 32 weights two words: four grid indices, four 7-bit sign patterns and a 4-bit scale.
void dequantize_iq2_xxs(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 66) {
    const float d = fp16_to_f32(rd16(src));
    for (int ib32 = 0; ib32 < QK_K / 32; ++ib32) {
      uint32_t aux32[2];
      std::memcpy(aux32, src + 2 + 8 * ib32, 8);
      const auto* aux8 = reinterpret_cast<const uint8_t*>(aux32);
      const float db = d * (0.5f + float(aux32[1] >> 28)) * 0.25f;
      for (int l = 0; l < 4; ++l, y += 8) signed_grid8(y, db, grid_bytes(kIq2xxsGrid, aux8[l]), kIqSigns[(aux32[1] >> 7 * l) & 127]);
    }
  }
}

// block_iq2_xs: d, 32 words (9-bit grid index | 7-bit sign pattern), 8 bytes of two 4-bit scales.
void dequantize_iq2_xs(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 74) {
    const float d = fp16_to_f32(rd16(src));
    const uint8_t* scales = src + 66;
    for (int ib32 = 0; ib32 < QK_K / 32; ++ib32) {
      const float db[2] = {d * (0.5f + float(scales[ib32] & 0xf)) * 0.25f, d * (0.5f + float(scales[ib32] >> 4)) * 0.25f};
      for (int l = 0; l < 4; ++l, y += 8) {
        const uint16_t q = rd16(src + 2 + 2 * (4 * ib32 + l));
        signed_grid8(y, db[l / 2], grid_bytes(kIq2xsGrid, q & 511), kIqSigns[q >> 9]);
      }
    }
  }
}

// block_iq2_s: d, 32 grid-index bytes, 32 sign bytes, 8 bytes of the indices' high bits, 8 of two 4-bit scales.
void dequantize_iq2_s(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 82) {
    const float d = fp16_to_f32(rd16(src));
    const uint8_t* qs = src + 2;
    const uint8_t* signs = src + 2 + 32;
    const uint8_t* qh = src + 66;
    const uint8_t* scales = src + 74;
    for (int ib32 = 0; ib32 < QK_K / 32; ++ib32, qs += 4, signs += 4) {
      const float db[2] = {d * (0.5f + float(scales[ib32] & 0xf)) * 0.25f, d * (0.5f + float(scales[ib32] >> 4)) * 0.25f};
      for (int l = 0; l < 4; ++l, y += 8) signed_grid8(y, db[l / 2], grid_bytes(kIq2sGrid, qs[l] | ((qh[ib32] << (8 - 2 * l)) & 0x300)), signs[l]);
    }
  }
}

// Two grid rows of four weights (IQ3's grids), with one sign byte for the eight.
inline void signed_grid4x2(float* y, float db, const uint8_t* g1, const uint8_t* g2, uint8_t signs) {
  for (int j = 0; j < 4; ++j) {
    y[j + 0] = db * g1[j] * (signs & kIqMask[j + 0] ? -1.f : 1.f);
    y[j + 4] = db * g2[j] * (signs & kIqMask[j + 4] ? -1.f : 1.f);
  }
}

// block_iq3_xxs: d, 64 grid-index bytes, then per 32 weights a word of four 7-bit sign patterns and a 4-bit scale.
void dequantize_iq3_xxs(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 98) {
    const float d = fp16_to_f32(rd16(src));
    const uint8_t* qs = src + 2;
    const uint8_t* scales_and_signs = src + 2 + QK_K / 4;
    for (int ib32 = 0; ib32 < QK_K / 32; ++ib32, qs += 8) {
      uint32_t aux32;
      std::memcpy(&aux32, scales_and_signs + 4 * ib32, 4);
      const float db = d * (0.5f + float(aux32 >> 28)) * 0.5f;
      for (int l = 0; l < 4; ++l, y += 8)
        signed_grid4x2(y, db, grid_bytes(kIq3xxsGrid, qs[2 * l]), grid_bytes(kIq3xxsGrid, qs[2 * l + 1]), kIqSigns[(aux32 >> 7 * l) & 127]);
    }
  }
}

// block_iq3_s: d, 64 grid-index bytes, 8 bytes of their ninth bits, 32 sign bytes, 4 bytes of two 4-bit scales.
void dequantize_iq3_s(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 110) {
    const float d = fp16_to_f32(rd16(src));
    const uint8_t* qs = src + 2;
    const uint8_t* qh = src + 66;
    const uint8_t* signs = src + 74;
    const uint8_t* scales = src + 106;
    for (int ib32 = 0; ib32 < QK_K / 32; ib32 += 2) {
      const float db[2] = {d * float(1 + 2 * (scales[ib32 / 2] & 0xf)), d * float(1 + 2 * (scales[ib32 / 2] >> 4))};
      for (int half = 0; half < 2; ++half, qs += 8, signs += 4)
        for (int l = 0; l < 4; ++l, y += 8)
          signed_grid4x2(y, db[half], grid_bytes(kIq3sGrid, qs[2 * l] | ((qh[half] << (8 - 2 * l)) & 256)),
                         grid_bytes(kIq3sGrid, qs[2 * l + 1] | ((qh[half] << (7 - 2 * l)) & 256)), signs[l]);
      qh += 2;
    }
  }
}

constexpr float kIq1Delta = 0.125f;  // IQ1S_DELTA: the grid's values (-1, 0, 1) shifted by +-1/8

// Eight weights of an IQ1 grid row: (value + delta) times the sub-block scale.
inline void iq1_grid8(float* y, float dl, int index, float delta) {
  const auto* grid = reinterpret_cast<const int8_t*>(kIq1sGrid + index);
  for (int j = 0; j < 8; ++j) y[j] = dl * (float(grid[j]) + delta);
}

// block_iq1_s: d, 32 grid-index bytes, 8 words (3 high index bits per row, a 3-bit scale, the delta's sign).
void dequantize_iq1_s(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 50) {
    const float d = fp16_to_f32(rd16(src));
    const uint8_t* qs = src + 2;
    for (int ib = 0; ib < QK_K / 32; ++ib, qs += 4) {
      const uint16_t qh = rd16(src + 34 + 2 * ib);
      const float dl = d * float(2 * ((qh >> 12) & 7) + 1);
      const float delta = qh & 0x8000 ? -kIq1Delta : kIq1Delta;
      for (int l = 0; l < 4; ++l, y += 8) iq1_grid8(y, dl, qs[l] | (((qh >> 3 * l) & 7) << 8), delta);
    }
  }
}

// block_iq1_m: 32 grid-index bytes, 16 bytes (high index bits, deltas' signs), 8 bytes of 3-bit scales whose top
// nibbles hold the f16 block scale.
void dequantize_iq1_m(const uint8_t* src, float* y, int64_t n) {
  for (int64_t b = 0; b < n / QK_K; ++b, src += 56) {
    uint16_t sc[4];
    std::memcpy(sc, src + 48, 8);
    const float d = fp16_to_f32(uint16_t((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000)));
    const uint8_t* qs = src;
    const uint8_t* qh = src + 32;
    for (int ib = 0; ib < QK_K / 32; ++ib, qs += 4, qh += 2) {
      const float dl1 = d * float(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 0)) & 0x7) + 1);
      const float dl2 = d * float(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 0x7) + 1);
      const int idx[4] = {qs[0] | ((qh[0] << 8) & 0x700), qs[1] | ((qh[0] << 4) & 0x700), qs[2] | ((qh[1] << 8) & 0x700),
                          qs[3] | ((qh[1] << 4) & 0x700)};
      const float delta[4] = {qh[0] & 0x08 ? -kIq1Delta : kIq1Delta, qh[0] & 0x80 ? -kIq1Delta : kIq1Delta,
                              qh[1] & 0x08 ? -kIq1Delta : kIq1Delta, qh[1] & 0x80 ? -kIq1Delta : kIq1Delta};
      for (int l = 0; l < 4; ++l, y += 8) iq1_grid8(y, l < 2 ? dl1 : dl2, idx[l], delta[l]);
    }
  }
}

}  // namespace

std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t id) {
  for (const auto& e : kTypes) if (e.id == id) return e.t;
  return std::nullopt;
}

const GgmlTypeTraits& traits(GgmlType t) {
  for (const auto& e : kTypes) if (e.id == uint32_t(t)) return e.t;
  throw std::invalid_argument(fmt::format("unknown ggml type id {}", uint32_t(t)));
}

std::string ggml_type_name(GgmlType t) {
  auto tr = ggml_type_traits(uint32_t(t));
  return tr ? tr->name : fmt::format("type{}", uint32_t(t));
}

std::optional<GgmlType> ggml_type_from_name(std::string_view name) {
  for (const auto& e : kTypes) {
    std::string_view n = e.t.name;
    if (n.size() == name.size() &&
        std::equal(n.begin(), n.end(), name.begin(), [](char a, char b) { return std::tolower(a) == std::tolower(b); }))
      return GgmlType(e.id);
  }
  return std::nullopt;
}

size_t ggml_row_bytes(GgmlType t, int64_t n) {
  check_blocks(t, n);
  const auto& tr = traits(t);
  return size_t(n / tr.block_size) * tr.type_size;
}

bool can_dequantize(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0: case GgmlType::Q4_0:
    case GgmlType::MXFP4: case GgmlType::Q4_K: case GgmlType::Q6_K: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1:
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q5_K: case GgmlType::IQ4_NL: case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XXS: case GgmlType::IQ2_XS: case GgmlType::IQ2_S: case GgmlType::IQ3_XXS: case GgmlType::IQ3_S:
    case GgmlType::IQ1_S: case GgmlType::IQ1_M: return true;
    default: return false;
  }
}

bool can_quantize(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0: case GgmlType::Q4_0:
    case GgmlType::MXFP4: return true;
    default: return false;
  }
}

void dequantize_row(GgmlType t, const void* src_v, float* y, int64_t n) {
  check_blocks(t, n);
  const auto* src = static_cast<const uint8_t*>(src_v);
  switch (t) {
    case GgmlType::F32: std::memcpy(y, src, size_t(n) * 4); return;
    case GgmlType::F16: for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_f32(rd16(src + 2 * i)); return;
    case GgmlType::BF16: for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(rd16(src + 2 * i)); return;
    case GgmlType::Q8_0:
      for (int64_t b = 0; b < n / QK; ++b) {
        const uint8_t* blk = src + b * 34;
        const float d = fp16_to_f32(rd16(blk));
        for (int j = 0; j < QK; ++j) y[b * QK + j] = float(int8_t(blk[2 + j])) * d;
      }
      return;
    case GgmlType::Q4_0:
      for (int64_t b = 0; b < n / QK; ++b) {
        const uint8_t* blk = src + b * 18;
        const float d = fp16_to_f32(rd16(blk));
        for (int j = 0; j < QK / 2; ++j) {
          y[b * QK + j] = float((blk[2 + j] & 0x0F) - 8) * d;
          y[b * QK + j + QK / 2] = float((blk[2 + j] >> 4) - 8) * d;
        }
      }
      return;
    case GgmlType::MXFP4:
      for (int64_t b = 0; b < n / QK; ++b) {
        const uint8_t* blk = src + b * 17;
        const float d = e8m0_half(blk[0]);
        for (int j = 0; j < QK / 2; ++j) {
          y[b * QK + j] = kMxfp4Values[blk[1 + j] & 0x0F] * d;
          y[b * QK + j + QK / 2] = kMxfp4Values[blk[1 + j] >> 4] * d;
        }
      }
      return;
    case GgmlType::Q4_K:
      for (int64_t b = 0; b < n / QK_K; ++b) {
        const uint8_t* blk = src + b * 144;
        const float d = fp16_to_f32(rd16(blk)), dmin = fp16_to_f32(rd16(blk + 2));
        const uint8_t* scales = blk + 4;
        const uint8_t* q = blk + 16;
        float* out = y + b * QK_K;
        int is = 0;
        for (int j = 0; j < QK_K; j += 64) {
          const KScales k = k4_scales(scales, is, d, dmin);
          for (int l = 0; l < 32; ++l) *out++ = k.d1 * (q[l] & 0xF) - k.m1;
          for (int l = 0; l < 32; ++l) *out++ = k.d2 * (q[l] >> 4) - k.m2;
          q += 32;
          is += 2;
        }
      }
      return;
    case GgmlType::Q6_K:
      for (int64_t b = 0; b < n / QK_K; ++b) {
        const uint8_t* blk = src + b * 210;
        const uint8_t* ql = blk;
        const uint8_t* qh = blk + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const float d = fp16_to_f32(rd16(blk + 208));
        float* out = y + b * QK_K;
        for (int n128 = 0; n128 < QK_K; n128 += 128) {
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int8_t q1 = int8_t((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int8_t q2 = int8_t((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int8_t q3 = int8_t((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int8_t q4 = int8_t((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            out[l + 0] = d * sc[is + 0] * q1;
            out[l + 32] = d * sc[is + 2] * q2;
            out[l + 64] = d * sc[is + 4] * q3;
            out[l + 96] = d * sc[is + 6] * q4;
          }
          out += 128;
          ql += 64;
          qh += 32;
          sc += 8;
        }
      }
      return;
    case GgmlType::Q4_1: return dequantize_q4_1(src, y, n);
    case GgmlType::Q5_0: return dequantize_q5(src, y, n, false);
    case GgmlType::Q5_1: return dequantize_q5(src, y, n, true);
    case GgmlType::Q2_K: return dequantize_q2_k(src, y, n);
    case GgmlType::Q3_K: return dequantize_q3_k(src, y, n);
    case GgmlType::Q5_K: return dequantize_q5_k(src, y, n);
    case GgmlType::IQ4_NL: return dequantize_iq4_nl(src, y, n);
    case GgmlType::IQ4_XS: return dequantize_iq4_xs(src, y, n);
    case GgmlType::IQ2_XXS: return dequantize_iq2_xxs(src, y, n);
    case GgmlType::IQ2_XS: return dequantize_iq2_xs(src, y, n);
    case GgmlType::IQ2_S: return dequantize_iq2_s(src, y, n);
    case GgmlType::IQ3_XXS: return dequantize_iq3_xxs(src, y, n);
    case GgmlType::IQ3_S: return dequantize_iq3_s(src, y, n);
    case GgmlType::IQ1_S: return dequantize_iq1_s(src, y, n);
    case GgmlType::IQ1_M: return dequantize_iq1_m(src, y, n);
    default:
      throw std::invalid_argument(fmt::format("no decoder for ggml type {}", ggml_type_name(t)));
  }
}

void quantize_row(GgmlType t, const float* x, void* dst_v, int64_t n, Q8Rounding q8_rounding) {
  check_blocks(t, n);
  auto* dst = static_cast<uint8_t*>(dst_v);
  switch (t) {
    case GgmlType::F32: std::memcpy(dst, x, size_t(n) * 4); return;
    case GgmlType::F16: for (int64_t i = 0; i < n; ++i) wr16(dst + 2 * i, f32_to_fp16(x[i])); return;
    case GgmlType::BF16: for (int64_t i = 0; i < n; ++i) wr16(dst + 2 * i, f32_to_bf16(x[i])); return;
    case GgmlType::Q8_0:
      for (int64_t b = 0; b < n / QK; ++b) {
        const float* xb = x + b * QK;
        uint8_t* blk = dst + b * 34;
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.0f;
        const bool ref = q8_rounding == Q8Rounding::TiesAway;
        const float id = ref ? (d != 0.0f ? 1.0f / d : 0.0f) : (amax != 0.0f ? 127.0f / amax : 0.0f);
        wr16(blk, f32_to_fp16(d));
        for (int j = 0; j < QK; ++j) {
          const float v = xb[j] * id;
          blk[2 + j] = uint8_t(int8_t(ref ? std::round(v) : std::nearbyint(v)));
        }
      }
      return;
    case GgmlType::Q4_0:
      for (int64_t b = 0; b < n / QK; ++b) {
        const float* xb = x + b * QK;
        uint8_t* blk = dst + b * 18;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; ++j)
          if (amax < std::fabs(xb[j])) { amax = std::fabs(xb[j]); max = xb[j]; }
        const float d = max / -8;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        wr16(blk, f32_to_fp16(d));
        for (int j = 0; j < QK / 2; ++j) {
          const float x0 = xb[j] * id, x1 = xb[QK / 2 + j] * id;
          const uint8_t xi0 = uint8_t(std::min<int>(15, int8_t(x0 + 8.5f)));
          const uint8_t xi1 = uint8_t(std::min<int>(15, int8_t(x1 + 8.5f)));
          blk[2 + j] = uint8_t(xi0 | (xi1 << 4));
        }
      }
      return;
    case GgmlType::MXFP4:
      for (int64_t b = 0; b < n / QK; ++b) {
        const float* xb = x + b * QK;
        uint8_t* blk = dst + b * 17;
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const uint8_t e = amax > 0.0f ? uint8_t(std::floor(std::log2(amax)) - 2 + 127) : 0;
        const float d = e8m0_half(e);
        auto best = [d](float v) {
          int bi = 0;
          float be = std::fabs(kMxfp4Values[0] * d - v);
          for (int i = 1; i < 16; ++i) {
            const float err = std::fabs(kMxfp4Values[i] * d - v);
            if (err < be) { bi = i; be = err; }
          }
          return uint8_t(bi);
        };
        blk[0] = e;
        for (int j = 0; j < QK / 2; ++j) blk[1 + j] = uint8_t(best(xb[j]) | (best(xb[QK / 2 + j]) << 4));
      }
      return;
    default:
      throw std::invalid_argument(fmt::format("no encoder for ggml type {}", ggml_type_name(t)));
  }
}

void dequantize_block_fp8(const uint8_t* w, int64_t rows, int64_t cols, const float* scale_inv,
                          int64_t block_rows, int64_t block_cols, float* dst) {
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scale_inv + (r / block_rows) * scale_cols;
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = fp8_e4m3_to_f32(w[r * cols + c]) * srow[c / block_cols];
  }
}

}  // namespace pdb
