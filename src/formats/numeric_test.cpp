#include "formats/numeric.h"

#include <gtest/gtest.h>

#include <cmath>
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

}  // namespace pdb
