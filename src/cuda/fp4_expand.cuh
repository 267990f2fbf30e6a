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

}  // namespace pdb::cuda
