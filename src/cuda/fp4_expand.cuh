// MXFP4 codes to bf16 as the FP4 expert products make their weight fragments in registers (moe_fp4_gemm.cu), host
// and device alike, so that the arithmetic is checked on any machine against ggml's dequantization
// (moe_fp4_gemm_test.cpp: every code under every E8M0 byte, bit for bit).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace pdb::cuda {

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

// Each pair's four bits per element placed in the repacked word (fp4_fragment_word) where one rotation puts them
// where a bf16 wants them (magnitude bits 6-8 and sign bit 15 for the lower-k element, 22-24 and 31 for the other),
// so that a pair costs a funnel shift and a mask (pair 3: a shift and two masks) instead of two shifts and two
// masks: 9 integer operations a word instead of 16 (session 40: these were most of the products' instructions,
// docs/RESULTS.md). An e2m1 code's magnitude bits at bf16 bits 6-8 and its sign at bit 15 read as its
// value x 2^-126 (magnitude 1, the subnormal 0.5, exactly); two bf16 products, by 2^(e-1) and 1 (e <= 128) or by
// 2^127 and 2^(e-128), give kvalue x 2^(e-128): ggml's value, exact wherever bf16 holds it and rounded as a product
// is elsewhere.
// Where element bits m, e0, e1, s (code bits 0-3) of pair p's lower / upper element sit in the word:
__host__ __device__ constexpr int fp4_word_bit(int p, bool upper, int b) {
  constexpr int lower_at[4][4] = {{0, 1, 2, 9}, {26, 27, 28, 3}, {4, 5, 6, 13}, {30, 7, 8, 15}};
  constexpr int upper_at[4][4] = {{16, 17, 18, 25}, {10, 11, 12, 19}, {20, 21, 22, 29}, {14, 23, 24, 31}};
  return upper ? upper_at[p][b] : lower_at[p][b];
}
__host__ __device__ inline uint32_t fp4_rotl(uint32_t w, int d) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(w, w, d);
#else
  return d ? (w << d) | (w >> (32 - d)) : w;
#endif
}
__host__ __device__ inline uint32_t fp4_pair_bits(uint32_t w, int p) {
  constexpr uint32_t kBf16Bits = 0x81C081C0u;  // bits 6-8 and 15 of each half
  if (p == 0) return fp4_rotl(w, 6) & kBf16Bits;
  if (p == 1) return fp4_rotl(w, 12) & kBf16Bits;
  if (p == 2) return fp4_rotl(w, 2) & kBf16Bits;
  return (w & 0x81808180u) | (fp4_rotl(w, 8) & 0x00400040u);  // e0, e1, s where they belong; m from bits 30 and 14
}
struct Fp4PairScale {
  uint32_t m1, m2;  // bf16x2 factors, both halves alike
};
__host__ __device__ inline Fp4PairScale fp4_pair_scale(uint32_t e) {
  const uint32_t b1 = e <= 128 ? e + 126 : 254, b2 = e <= 128 ? 127 : e - 1;  // biased exponents of 2^(e-1) | 2^127, 1 | 2^(e-128)
  return {(b1 << 7) * 0x10001u, (b2 << 7) * 0x10001u};
}
// a * b, both bf16x2, rounded to nearest even (the hardware's product; on the host the exact f32 product rounded)
__host__ __device__ inline uint32_t fp4_mul_bf16x2(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  const float lo = fp4_f32_of_bits(a << 16) * fp4_f32_of_bits(b << 16), hi = fp4_f32_of_bits(a & 0xffff0000u) * fp4_f32_of_bits(b & 0xffff0000u);
  return fp4_bf16_pair(lo, hi);
#endif
}
// The repacked word of lane q (0..3) of a 32-block (ggml's 16 code bytes: byte j holds element j low, j + 16 high):
// its pair p holds elements 2q + 8p and 2q + 8p + 1, the k columns of a wgmma A fragment's registers (a0 / a2 of the
// block's two 16-wide chunks: p = 0, 1 the first chunk, 2, 3 the second), their bits where fp4_word_bit says.
__host__ __device__ inline uint32_t fp4_fragment_word(const uint8_t* codes, int q) {
  auto elem = [codes](int k) { return uint32_t(k < 16 ? codes[k] & 0x0f : codes[k - 16] >> 4); };
  uint32_t w = 0;
  for (int p = 0; p < 4; ++p)
    for (int b = 0; b < 4; ++b)
      w |= (elem(2 * q + 8 * p) >> b & 1u) << fp4_word_bit(p, false, b) | (elem(2 * q + 8 * p + 1) >> b & 1u) << fp4_word_bit(p, true, b);
  return w;
}

// Pair p of a repacked word under a block's scale: two bf16 values, the lower-k element in the low half.
__host__ __device__ inline uint32_t fp4_pair(uint32_t w, int p, const Fp4PairScale& s) {
  return fp4_mul_bf16x2(fp4_mul_bf16x2(fp4_pair_bits(w, p), s.m1), s.m2);
}

}  // namespace pdb::cuda
