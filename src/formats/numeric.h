// Scalar number formats shared by both engines: IEEE half, bfloat16, FP8 E4M3 (FN) and E8M0.
// Conversions round to nearest even exactly as ggml does, because cache rows must match bit for bit.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdb {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// IEEE binary16 -> binary32 (exact).
inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    // subnormal: value = man * 2^-24
    float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13));
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

// binary32 -> binary16 with round-to-nearest-even (matches F16C / ggml's software path).
inline uint16_t f32_to_fp16(float f) {
  uint32_t x = f32_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00 | uint16_t((ax >> 13) & 0x3ff);  // NaN, keep quiet
  if (ax >= 0x477ff000u) return sign | 0x7c00;                                // overflow -> inf
  if (ax < 0x38800000u) {                                                       // subnormal or zero
    // in units of 2^-24 (the subnormal step); 1024 rolls over into the smallest normal correctly
    const float scaled = bits_f32(ax) * 16777216.0f;  // exact (power of two)
    float r = std::nearbyint(scaled);                  // default rounding mode: nearest even
    return sign | uint16_t(r);
  }
  uint32_t mant_odd = (ax >> 13) & 1;
  ax += 0xc8000fffu + mant_odd;  // rebias exponent (-112<<23) and round
  return sign | uint16_t(ax >> 13);
}

inline float bf16_to_f32(uint16_t b) { return bits_f32(uint32_t(b) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 64);  // quiet NaN, as ggml
  return uint16_t((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

// x as f16 / bf16 holds it (round to nearest even), back in f32: what a value becomes when a tensor
// or an activation is stored in that width.
inline float round_f16(float x) { return fp16_to_f32(f32_to_fp16(x)); }
inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// FP8 E4M3 "FN" (no infinities; S.1111.111 is NaN), bias 7.
inline float fp8_e4m3_to_f32(uint8_t v) {
  const bool neg = v & 0x80;
  const int exp = (v >> 3) & 0xf, man = v & 7;
  float r;
  if (exp == 15 && man == 7) r = NAN;
  else if (exp == 0) r = std::ldexp(float(man), -9);
  else r = std::ldexp(float(8 + man), exp - 10);
  return neg ? -r : r;
}

// f32 -> E4M3FN, round to nearest even, saturating at +-448 (as torch's float8_e4m3fn cast of a
// pre-scaled tensor does in checkpoint quantizers).
inline uint8_t f32_to_fp8_e4m3(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7e;
  // Below 2^-6 the codes are subnormal, steps of 2^-9; above, 8 steps per binade. nearbyint rounds
  // half to even in the default rounding mode, and a mantissa that rounds up to 8 carries into the
  // exponent field by plain addition (the encoding is monotonic).
  if (a < 0.015625f) return sign | uint8_t(std::nearbyint(a * 512.0f));
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int steps = int(std::nearbyint((m * 2.0f - 1.0f) * 8.0f));
  return sign | uint8_t(((e - 1 + 7) << 3) + steps);
}

// E8M0 scale: 2^(e-127); 0xff is NaN.
inline float e8m0_to_f32(uint8_t e) { return e == 0xff ? NAN : std::ldexp(1.0f, int(e) - 127); }

}  // namespace pdb
