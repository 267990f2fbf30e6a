#include "formats/numeric.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

namespace pdb {

TEST(Numeric, Fp16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_f32(uint16_t(h));
    if (std::isnan(f)) { EXPECT_TRUE(std::isnan(fp16_to_f32(f32_to_fp16(f)))); continue; }
    EXPECT_EQ(f32_to_fp16(f), h) << "half 0x" << std::hex << h;
  }
}

TEST(Numeric, Fp16RoundsToNearestEven) {
  // 1 + 2^-11 is exactly between 1 and the next half (1 + 2^-10): ties to even -> 1.
  EXPECT_EQ(f32_to_fp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3*2^-11 is between 1+2^-10 (odd) and 1+2^-9 (even): -> 1+2^-9.
  EXPECT_EQ(f32_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(f32_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_fp16(65520.0f), 0x7c00);  // rounds up to inf
  EXPECT_EQ(f32_to_fp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  // subnormal halves: 2^-24 is the smallest; 1.5 * 2^-24 ties to even (2 * 2^-24)
  EXPECT_EQ(f32_to_fp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(f32_to_fp16(std::ldexp(1.5f, -24)), 0x0002);
  EXPECT_EQ(f32_to_fp16(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(f32_to_fp16(std::ldexp(1023.75f, -24)), 0x0400);  // rounds into the smallest normal
}

TEST(Numeric, Bf16RoundsToNearestEvenAndKeepsNan) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f818000)), 0x3f82);  // tie, odd rounds up
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_f32(uint16_t(b));
    if (!std::isnan(f)) { EXPECT_EQ(f32_to_bf16(f), b); }
  }
}

TEST(Numeric, Fp8E4m3KnownValuesAndRoundTrip) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x00), 0.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(f32_to_fp8_e4m3(fp8_e4m3_to_f32(uint8_t(c))), c == 0x80 ? 0x80 : c);
  }
  EXPECT_EQ(f32_to_fp8_e4m3(1000.0f), 0x7e);  // saturates
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
}

// The conversion computes the code from the float's binade; the oracle here is the definition: the
// nearest of all 253 finite magnitudes, ties to the even code. Every midpoint between two codes, its
// neighbours, and a stride through all floats below the saturation point.
TEST(Numeric, Fp8E4m3IsTheNearestCodeTiesToEven) {
  auto nearest = [](float x) {
    const float a = std::fabs(x);
    int best = 0;
    for (int c = 1; c <= 0x7e; ++c) {
      const float d = std::fabs(fp8_e4m3_to_f32(uint8_t(c)) - a), db = std::fabs(fp8_e4m3_to_f32(uint8_t(best)) - a);
      if (d < db || (d == db && (c & 1) == 0)) best = c;
    }
    return uint8_t((std::signbit(x) ? 0x80 : 0) | best);
  };
  std::vector<float> xs;
  for (int c = 0; c < 0x7e; ++c) {
    const float mid = (fp8_e4m3_to_f32(uint8_t(c)) + fp8_e4m3_to_f32(uint8_t(c + 1))) / 2;
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) xs.insert(xs.end(), {x, -x});
  }
  for (uint32_t u = 0; u < 0x43e00000u; u += 99991) {  // 0x43e00000 = 448.0f
    float x;
    std::memcpy(&x, &u, 4);
    xs.push_back(x);
  }
  size_t bad = 0;
  for (float x : xs) bad += f32_to_fp8_e4m3(x) != nearest(x);
  EXPECT_EQ(bad, 0u) << "of " << xs.size();
}

}  // namespace pdb
