// MXFP4 codes to bf16 as the FP4 expert products expand them in their tiles (moe_fp4_gemm.cu), host and device alike,
// so that the arithmetic is checked on any machine against ggml's dequantization (moe_fp4_gemm_test.cpp). An e2m1
// code's bits placed as an e4m3 byte hold its value x 2^-6 exactly (subnormals too); the e4m3 -> half conversion is
// exact, and one multiply by 2^(e - 121) gives kvalues x 2^(e - 128), ggml's value; past e = 248 that factor leaves
// f32, so there it is two multiplies (128, then 2^(e - 128)), which changes no value.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

namespace pdb::cuda {

// Four codes (the nibbles at `shift` of a word's four bytes) as four e4m3 bytes.
__host__ __device__ inline uint32_t e2m1x4_to_e4m3x4(uint32_t w, int shift) {
  const uint32_t c = (w >> shift) & 0x0f0f0f0fu;
  return ((c & 0x07070707u) << 2) | ((c & 0x08080808u) << 4);
}
__host__ __device__ inline float2 e4m3x2_to_float2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(h));
}
__host__ __device__ inline float fp4_f32_of_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
__host__ __device__ inline uint32_t fp4_bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

// The block's E8M0 byte e as the factors its e4m3 values are multiplied by.
struct Fp4Scale {
  float m1, m2;
  bool two;  // m2 applies (e > 248)
};
__host__ __device__ inline Fp4Scale fp4_scale(uint32_t e) {
  if (e <= 248) return {fp4_f32_of_bits((e + 6) << 23), 1.0f, false};
  return {128.0f, fp4_f32_of_bits((e - 1) << 23), true};
}

// Eight consecutive elements: the nibbles at `shift` of words a (elements 0-3) and b (4-7), as four bf16 pairs.
template <bool kTwo>
__host__ __device__ inline void fp4_expand8(uint32_t a, uint32_t b, int shift, const Fp4Scale& s, uint32_t (&out)[4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t q = e2m1x4_to_e4m3x4(h ? b : a, shift);
    float2 lo = e4m3x2_to_float2(q), hi = e4m3x2_to_float2(q >> 16);
    lo.x *= s.m1, lo.y *= s.m1, hi.x *= s.m1, hi.y *= s.m1;
    if (kTwo) lo.x *= s.m2, lo.y *= s.m2, hi.x *= s.m2, hi.y *= s.m2;
    out[2 * h] = fp4_bf16_pair(lo.x, lo.y);
    out[2 * h + 1] = fp4_bf16_pair(hi.x, hi.y);
  }
}

// Chunk c (0..3) of a 32-block, elements 8c .. 8c + 7, from its 16 code bytes as four words (ggml's order: byte j
// holds element j in the low nibble and j + 16 in the high one).
template <bool kTwo>
__host__ __device__ inline void fp4_expand_chunk(const uint32_t (&w)[4], int c, const Fp4Scale& s, uint32_t (&out)[4]) {
  fp4_expand8<kTwo>(w[(c & 1) * 2], w[(c & 1) * 2 + 1], (c >> 1) * 4, s, out);
}

// ---- The same values by table: an E8M0 byte's eight magnitudes as bf16 (the products above, so bit for bit the
// same), looked up by byte permutes. Per four elements: masks, two permutes into the table, the sign OR-ed in, two
// permutes to pair the bytes: integer work at full rate, where the path above spends four conversions (a quarter-rate
// unit on Hopper) per four elements.

// The byte permute (PTX prmt, default mode): byte i of the result is byte sel[4i..4i+2] of {b, a} (a the low four).
// The selectors used here never set a nibble's top bit (the sign-replicate mode).
__host__ __device__ inline uint32_t fp4_byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  const uint64_t ab = uint64_t(a) | uint64_t(b) << 32;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((ab >> (8 * ((sel >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
#endif
}

// Magnitudes 0..7 (0, 0.5, 1, 1.5, 2, 3, 4, 6) under one E8M0 byte: their bf16 low bytes (lo[0]: entries 0-3, lo[1]:
// 4-7) and high bytes, as the byte permutes index them.
struct Fp4Table {
  uint32_t lo[2], hi[2];
};
__host__ __device__ inline Fp4Table fp4_table(uint32_t e) {
  const Fp4Scale s = fp4_scale(e);
  uint32_t w[4];
  for (int i = 0; i < 4; ++i) {
    // magnitude m as its e4m3 byte's half value (m << 2 read as e4m3: exact), as fp4_expand8 has it
    const float step = 1.0f / 128.0f;  // 2^-7: magnitude 1 (the value 0.5)
    const float mags[8] = {0.0f, step, 2 * step, 3 * step, 4 * step, 6 * step, 8 * step, 12 * step};
    float lo = mags[2 * i] * s.m1, hi = mags[2 * i + 1] * s.m1;
    if (s.two) lo *= s.m2, hi *= s.m2;
    w[i] = fp4_bf16_pair(lo, hi);
  }
  return {{fp4_byte_perm(w[0], w[1], 0x6420), fp4_byte_perm(w[2], w[3], 0x6420)},
          {fp4_byte_perm(w[0], w[1], 0x7531), fp4_byte_perm(w[2], w[3], 0x7531)}};
}

// Four elements, the nibbles at `shift` of word a's four bytes, as two bf16 pairs.
__host__ __device__ inline void fp4_lookup4(const Fp4Table& t, uint32_t a, int shift, uint32_t& pair01, uint32_t& pair23) {
  const uint32_t n = a >> shift, mag = n & 0x07070707u, sign = n & 0x08080808u;
  const uint32_t sel = fp4_byte_perm(mag | (mag >> 4), 0, 0x0020);  // the four magnitudes as four selector nibbles
  const uint32_t lo = fp4_byte_perm(t.lo[0], t.lo[1], sel);
  const uint32_t hi = fp4_byte_perm(t.hi[0], t.hi[1], sel) | (sign << 4);  // each code's sign to its byte's top bit
  pair01 = fp4_byte_perm(lo, hi, 0x5140);
  pair23 = fp4_byte_perm(lo, hi, 0x7362);
}

// fp4_expand_chunk by table: chunk c (0..3) of a 32-block, elements 8c .. 8c + 7, as four bf16 pairs.
__host__ __device__ inline void fp4_lookup_chunk(const uint32_t (&w)[4], int c, const Fp4Table& t, uint32_t (&out)[4]) {
  const int shift = (c >> 1) * 4;
  fp4_lookup4(t, w[(c & 1) * 2], shift, out[0], out[1]);
  fp4_lookup4(t, w[(c & 1) * 2 + 1], shift, out[2], out[3]);
}

}  // namespace pdb::cuda
