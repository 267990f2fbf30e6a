// One block of every ggml weight type to f32, bit for bit ggml-quants.c's dequantize_row_* (tests/ggml_dequant_test.cpp
// links the pinned llama.cpp's to_float). ONE source for both sides: formats/ggml_types.cpp includes it for the host
// decoders, cuda/dequant.cu for the GPU's per-layer expansion of quantized weights (cuda/dequant.cuh), so the two
// cannot drift apart. Where ggml writes `a * b + c` a compiler may fuse the two (FMA) or not: the same bits either
// way, since every such product is exact in float (an f16 scale of 11 significant bits times a sub-scale of at most
// 6 bits times a code of at most 6 bits).
#pragma once
#include <cstdint>

#include "formats/ggml_types.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define PDB_DECODE_FN __device__ __forceinline__
#define PDB_DECODE_TABLE static __device__ const
#else
#include "formats/numeric.h"
#define PDB_DECODE_FN inline
#define PDB_DECODE_TABLE static constexpr
#endif

namespace pdb::ggml_decode {

constexpr int QK = 32;     // Q4_0 / Q8_0 / MXFP4 / IQ4_NL block
constexpr int QK_K = 256;  // K-quant and IQ super-block

// IQ4_NL / IQ4_XS code values (ggml's kvalues_iq4nl: a non-linear 4-bit grid).
PDB_DECODE_TABLE int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// E2M1 values doubled, as ggml's kvalues_mxfp4 (the E8M0 "half" scale compensates).
PDB_DECODE_TABLE int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#include "formats/iq_grids.inc"

PDB_DECODE_FN uint16_t rd16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
PDB_DECODE_FN uint32_t rd32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }

#if defined(__CUDACC__)
PDB_DECODE_FN float f16(const uint8_t* p) { return __half2float(__ushort_as_half(rd16(p))); }
PDB_DECODE_FN float f16_bits(uint16_t h) { return __half2float(__ushort_as_half(h)); }
PDB_DECODE_FN float from_bits(uint32_t u) { return __uint_as_float(u); }
#else
PDB_DECODE_FN float f16(const uint8_t* p) { return fp16_to_f32(rd16(p)); }
PDB_DECODE_FN float f16_bits(uint16_t h) { return fp16_to_f32(h); }
PDB_DECODE_FN float from_bits(uint32_t u) { return bits_f32(u); }
#endif

// ggml_e8m0_to_fp32_half: 2^(e-128), with the two denormal cases spelled out.
PDB_DECODE_FN float e8m0_half(uint8_t e) { return from_bits(e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23)); }

PDB_DECODE_FN void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

PDB_DECODE_FN void q8_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  for (int j = 0; j < QK; ++j) y[j] = float(int8_t(b[2 + j])) * d;
}

PDB_DECODE_FN void q4_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = float((b[2 + j] & 0x0F) - 8) * d;
    y[j + QK / 2] = float((b[2 + j] >> 4) - 8) * d;
  }
}

PDB_DECODE_FN void q4_1(const uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = float(b[4 + j] & 0x0F) * d + m;
    y[j + QK / 2] = float(b[4 + j] >> 4) * d + m;
  }
}

// Q5_0: d, 32 high bits, 16 bytes of low nibbles; codes - 16. Q5_1: d, m, the same bits; codes * d + m.
template <bool kMin>
PDB_DECODE_FN void q5(const uint8_t* b, float* y) {
  constexpr int off = kMin ? 4 : 2;
  const float d = f16(b), m = kMin ? f16(b + 2) : 0.0f;
  const uint32_t qh = rd32(b + off);
  const uint8_t* qs = b + off + 4;
  for (int j = 0; j < QK / 2; ++j) {
    const uint8_t xh0 = uint8_t(((qh >> (j + 0)) << 4) & 0x10), xh1 = uint8_t((qh >> (j + 12)) & 0x10);
    const int x0 = (qs[j] & 0x0F) | xh0, x1 = (qs[j] >> 4) | xh1;
    if (kMin) {
      y[j] = float(x0) * d + m;
      y[j + QK / 2] = float(x1) * d + m;
    } else {
      y[j] = float(x0 - 16) * d;
      y[j + QK / 2] = float(x1 - 16) * d;
    }
  }
}

PDB_DECODE_FN void mxfp4(const uint8_t* b, float* y) {
  const float d = e8m0_half(b[0]);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = kMxfp4Values[b[1 + j] & 0x0F] * d;
    y[j + QK / 2] = kMxfp4Values[b[1 + j] >> 4] * d;
  }
}

PDB_DECODE_FN void iq4_nl(const uint8_t* b, float* y) {
  const float d = f16(b);
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = d * float(kIq4nlValues[b[2 + j] & 0xF]);
    y[j + QK / 2] = d * float(kIq4nlValues[b[2 + j] >> 4]);
  }
}

// The 256-weight super-blocks decode in groups of 32 (group g: weights [32g, 32g + 32)): the GPU gives each group a
// thread, the host loops over them; each weight's arithmetic is ggml's loop's, in another order of the loop.

// block_q2_K: scales[16] (4-bit scale | 4-bit min), qs[64] (2-bit codes), d, dmin. Group g: codes at shift 2(g%4) of
// the 32 bytes of half g/4, two 16-weight sub-blocks.
PDB_DECODE_FN void q2_k(const uint8_t* b, int g, float* y) {
  const uint8_t* q = b + 16 + 32 * (g / 4);
  const int shift = 2 * (g % 4);
  const float d = f16(b + 80), dmin = f16(b + 82);
  for (int half = 0; half < 2; ++half) {
    const uint8_t sc = b[2 * g + half];
    const float dl = d * float(sc & 0xF), ml = dmin * float(sc >> 4);
    for (int l = 0; l < 16; ++l) *y++ = dl * float(int8_t((q[l + 16 * half] >> shift) & 3)) - ml;
  }
}

// block_q3_K: hmask[32] (the codes' high bits), qs[64] (low 2 bits), scales[12] (16 6-bit scales), d. Group g as Q2_K's,
// its high bit 1 << g of hmask.
PDB_DECODE_FN void q3_k(const uint8_t* b, int g, float* y) {
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  const uint8_t* hm = b;
  const uint8_t* q = b + 32 + 32 * (g / 4);
  const int shift = 2 * (g % 4);
  const uint8_t m = uint8_t(1 << g);
  const float d_all = f16(b + 108);
  uint32_t aux[4] = {rd32(b + 96), rd32(b + 100), rd32(b + 104), 0};
  const uint32_t tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  for (int half = 0; half < 2; ++half) {
    const int is = 2 * g + half;
    const int8_t scale = int8_t(aux[is / 4] >> (8 * (is % 4)));  // the scales' bytes in memory order
    const float dl = d_all * float(scale - 32);
    for (int l = 0; l < 16; ++l) {
      const int i = l + 16 * half;
      *y++ = dl * float(int8_t((q[i] >> shift) & 3) - ((hm[i] & m) ? 0 : 4));
    }
  }
}

// Q4_K / Q5_K: d, dmin, scales[12] (8 6-bit scale/min pairs); Q5_K adds qh[32] (the codes' fifth bits); qs[128].
// Group g: scale/min pair g, the low (g even) or high nibbles of the 32 bytes g/2, Q5_K's fifth bit 1 << g.
template <bool kQ5>
PDB_DECODE_FN void q45_k(const uint8_t* b, int g, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + (kQ5 ? 48 : 16) + 32 * (g / 2);
  uint8_t sc, mn;
  scale_min_k4(g, b + 4, &sc, &mn);
  const float dl = d * sc, ml = dmin * mn;
  const int nshift = 4 * (g % 2);
  if (kQ5) {
    const uint8_t u = uint8_t(1 << g);
    for (int l = 0; l < 32; ++l) y[l] = dl * float(((ql[l] >> nshift) & 0xF) + (qh[l] & u ? 16 : 0)) - ml;
  } else {
    for (int l = 0; l < 32; ++l) y[l] = dl * ((ql[l] >> nshift) & 0xF) - ml;
  }
}

// block_q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d. Group g: quarter g%4 of half g/4.
PDB_DECODE_FN void q6_k(const uint8_t* b, int g, float* y) {
  const int half = g / 4, quarter = g % 4;
  const uint8_t* ql = b + 64 * half + 32 * (quarter % 2);
  const uint8_t* qh = b + 128 + 32 * half;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * quarter;
  const float d = f16(b + 208);
  const int nshift = 4 * (quarter / 2), hshift = 2 * quarter;
  for (int l = 0; l < 32; ++l) {
    const int8_t q = int8_t(((ql[l] >> nshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
    y[l] = d * sc[l / 16] * q;
  }
}

// block_iq4_xs: d, scales_h (2 high bits of 8 6-bit scales), scales_l[4] (their low 4 bits), qs[128].
PDB_DECODE_FN void iq4_xs(const uint8_t* b, int ib, float* y) {
  const float d = f16(b);
  const uint16_t scales_h = rd16(b + 2);
  const uint8_t* qs = b + 8 + 16 * ib;
  const int ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xf) | (((scales_h >> 2 * ib) & 3) << 4);
  const float dl = d * float(ls - 32);
  for (int j = 0; j < 16; ++j) {
    y[j + 0] = dl * float(kIq4nlValues[qs[j] & 0xf]);
    y[j + 16] = dl * float(kIq4nlValues[qs[j] >> 4]);
  }
}

// A grid entry's bytes in memory order (ggml reads its tables through a byte pointer).
template <class T>
PDB_DECODE_FN const uint8_t* grid_bytes(const T* grid, int index) { return reinterpret_cast<const uint8_t*>(grid + index); }

// Eight weights of a grid row, each negated where its sign bit is set, times the sub-block scale.
PDB_DECODE_FN void signed_grid8(float* y, float db, const uint8_t* grid, uint8_t signs) {
  for (int j = 0; j < 8; ++j) y[j] = db * grid[j] * (signs & kIqMask[j] ? -1.f : 1.f);
}

// block_iq2_xxs: d, then per 32 weights two words: four grid indices, four 7-bit sign patterns and a 4-bit scale.
PDB_DECODE_FN void iq2_xxs(const uint8_t* b, int ib32, float* y) {
  const float d = f16(b);
  const uint8_t* aux8 = b + 2 + 8 * ib32;
  const uint32_t aux1 = rd32(aux8 + 4);
  const float db = d * (0.5f + float(aux1 >> 28)) * 0.25f;
  for (int l = 0; l < 4; ++l, y += 8) signed_grid8(y, db, grid_bytes(kIq2xxsGrid, aux8[l]), kIqSigns[(aux1 >> 7 * l) & 127]);
}

// block_iq2_xs: d, 32 words (9-bit grid index | 7-bit sign pattern), 8 bytes of two 4-bit scales.
PDB_DECODE_FN void iq2_xs(const uint8_t* b, int ib32, float* y) {
  const float d = f16(b);
  const uint8_t sc = b[66 + ib32];
  const float db[2] = {d * (0.5f + float(sc & 0xf)) * 0.25f, d * (0.5f + float(sc >> 4)) * 0.25f};
  for (int l = 0; l < 4; ++l, y += 8) {
    const uint16_t q = rd16(b + 2 + 2 * (4 * ib32 + l));
    signed_grid8(y, db[l / 2], grid_bytes(kIq2xsGrid, q & 511), kIqSigns[q >> 9]);
  }
}

// block_iq2_s: d, 32 grid-index bytes, 32 sign bytes, 8 bytes of the indices' high bits, 8 of two 4-bit scales.
PDB_DECODE_FN void iq2_s(const uint8_t* b, int ib32, float* y) {
  const float d = f16(b);
  const uint8_t* qs = b + 2 + 4 * ib32;
  const uint8_t* signs = b + 2 + 32 + 4 * ib32;
  const uint8_t qh = b[66 + ib32], sc = b[74 + ib32];
  const float db[2] = {d * (0.5f + float(sc & 0xf)) * 0.25f, d * (0.5f + float(sc >> 4)) * 0.25f};
  for (int l = 0; l < 4; ++l, y += 8) signed_grid8(y, db[l / 2], grid_bytes(kIq2sGrid, qs[l] | ((qh << (8 - 2 * l)) & 0x300)), signs[l]);
}

// Two grid rows of four weights (IQ3's grids), with one sign byte for the eight.
PDB_DECODE_FN void signed_grid4x2(float* y, float db, const uint8_t* g1, const uint8_t* g2, uint8_t signs) {
  for (int j = 0; j < 4; ++j) {
    y[j + 0] = db * g1[j] * (signs & kIqMask[j + 0] ? -1.f : 1.f);
    y[j + 4] = db * g2[j] * (signs & kIqMask[j + 4] ? -1.f : 1.f);
  }
}

// block_iq3_xxs: d, 64 grid-index bytes, then per 32 weights a word of four 7-bit sign patterns and a 4-bit scale.
PDB_DECODE_FN void iq3_xxs(const uint8_t* b, int ib32, float* y) {
  const float d = f16(b);
  const uint8_t* qs = b + 2 + 8 * ib32;
  const uint32_t aux32 = rd32(b + 2 + QK_K / 4 + 4 * ib32);
  const float db = d * (0.5f + float(aux32 >> 28)) * 0.5f;
  for (int l = 0; l < 4; ++l, y += 8)
    signed_grid4x2(y, db, grid_bytes(kIq3xxsGrid, qs[2 * l]), grid_bytes(kIq3xxsGrid, qs[2 * l + 1]), kIqSigns[(aux32 >> 7 * l) & 127]);
}

// block_iq3_s: d, 64 grid-index bytes, 8 bytes of their ninth bits, 32 sign bytes, 4 bytes of two 4-bit scales.
PDB_DECODE_FN void iq3_s(const uint8_t* b, int ib32, float* y) {
  const float d = f16(b);
  const uint8_t* qs = b + 2 + 8 * ib32;
  const uint8_t qh = b[66 + ib32];
  const uint8_t* signs = b + 74 + 4 * ib32;
  const uint8_t sc = b[106 + ib32 / 2];
  const float db = ib32 % 2 ? d * float(1 + 2 * (sc >> 4)) : d * float(1 + 2 * (sc & 0xf));
  for (int l = 0; l < 4; ++l, y += 8)
    signed_grid4x2(y, db, grid_bytes(kIq3sGrid, qs[2 * l] | ((qh << (8 - 2 * l)) & 256)),
                   grid_bytes(kIq3sGrid, qs[2 * l + 1] | ((qh << (7 - 2 * l)) & 256)), signs[l]);
}

constexpr float kIq1Delta = 0.125f;  // IQ1S_DELTA: the grid's values (-1, 0, 1) shifted by +-1/8

// Eight weights of an IQ1 grid row: (value + delta) times the sub-block scale.
PDB_DECODE_FN void iq1_grid8(float* y, float dl, int index, float delta) {
  const auto* grid = reinterpret_cast<const int8_t*>(kIq1sGrid + index);
  for (int j = 0; j < 8; ++j) y[j] = dl * (float(grid[j]) + delta);
}

// block_iq1_s: d, 32 grid-index bytes, 8 words (3 high index bits per row, a 3-bit scale, the delta's sign).
PDB_DECODE_FN void iq1_s(const uint8_t* b, int ib, float* y) {
  const float d = f16(b);
  const uint8_t* qs = b + 2 + 4 * ib;
  const uint16_t qh = rd16(b + 34 + 2 * ib);
  const float dl = d * float(2 * ((qh >> 12) & 7) + 1);
  const float delta = qh & 0x8000 ? -kIq1Delta : kIq1Delta;
  for (int l = 0; l < 4; ++l, y += 8) iq1_grid8(y, dl, qs[l] | (((qh >> 3 * l) & 7) << 8), delta);
}

// block_iq1_m: 32 grid-index bytes, 16 bytes (high index bits, deltas' signs), 8 bytes of 3-bit scales whose top
// nibbles hold the f16 block scale.
PDB_DECODE_FN void iq1_m(const uint8_t* b, int ib, float* y) {
  const uint16_t sc[4] = {rd16(b + 48), rd16(b + 50), rd16(b + 52), rd16(b + 54)};
  const float d = f16_bits(uint16_t((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000)));
  const uint8_t* qs = b + 4 * ib;
  const uint8_t* qh = b + 32 + 2 * ib;
  const float dl1 = d * float(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 0)) & 0x7) + 1);
  const float dl2 = d * float(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 0x7) + 1);
  const int idx[4] = {qs[0] | ((qh[0] << 8) & 0x700), qs[1] | ((qh[0] << 4) & 0x700), qs[2] | ((qh[1] << 8) & 0x700),
                      qs[3] | ((qh[1] << 4) & 0x700)};
  const float delta[4] = {qh[0] & 0x08 ? -kIq1Delta : kIq1Delta, qh[0] & 0x80 ? -kIq1Delta : kIq1Delta,
                          qh[1] & 0x08 ? -kIq1Delta : kIq1Delta, qh[1] & 0x80 ? -kIq1Delta : kIq1Delta};
  for (int l = 0; l < 4; ++l, y += 8) iq1_grid8(y, l < 2 ? dl1 : dl2, idx[l], delta[l]);
}

// Weights [32g, 32g + 32) of one block of type t (g 0 for the 32-weight types). A constant t (a caller templated on
// it) folds the switch away. False: no decoder (or a float type: see f16_block).
PDB_DECODE_FN bool group(GgmlType t, const uint8_t* b, int g, float* y) {
  switch (t) {
    case GgmlType::Q8_0: q8_0(b, y); return true;
    case GgmlType::Q4_0: q4_0(b, y); return true;
    case GgmlType::Q4_1: q4_1(b, y); return true;
    case GgmlType::Q5_0: q5<false>(b, y); return true;
    case GgmlType::Q5_1: q5<true>(b, y); return true;
    case GgmlType::MXFP4: mxfp4(b, y); return true;
    case GgmlType::IQ4_NL: iq4_nl(b, y); return true;
    case GgmlType::Q2_K: q2_k(b, g, y); return true;
    case GgmlType::Q3_K: q3_k(b, g, y); return true;
    case GgmlType::Q4_K: q45_k<false>(b, g, y); return true;
    case GgmlType::Q5_K: q45_k<true>(b, g, y); return true;
    case GgmlType::Q6_K: q6_k(b, g, y); return true;
    case GgmlType::IQ4_XS: iq4_xs(b, g, y); return true;
    case GgmlType::IQ2_XXS: iq2_xxs(b, g, y); return true;
    case GgmlType::IQ2_XS: iq2_xs(b, g, y); return true;
    case GgmlType::IQ2_S: iq2_s(b, g, y); return true;
    case GgmlType::IQ3_XXS: iq3_xxs(b, g, y); return true;
    case GgmlType::IQ3_S: iq3_s(b, g, y); return true;
    case GgmlType::IQ1_S: iq1_s(b, g, y); return true;
    case GgmlType::IQ1_M: iq1_m(b, g, y); return true;
    default: return false;
  }
}

// Groups of 32 in one block of type t: 8 for the 256-weight types, 1 for the 32-weight ones, 0 for float types.
PDB_DECODE_FN int groups_per_block(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: return 0;
    case GgmlType::Q8_0: case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::MXFP4:
    case GgmlType::IQ4_NL: return 1;
    default: return 8;
  }
}

// One element of a float type.
PDB_DECODE_FN float float_element(GgmlType t, const uint8_t* row, int64_t i) {
  switch (t) {
    case GgmlType::F16: return f16(row + 2 * i);
    case GgmlType::BF16: return from_bits(uint32_t(rd16(row + 2 * i)) << 16);
    default: return from_bits(rd32(row + 4 * i));
  }
}

}  // namespace pdb::ggml_decode
