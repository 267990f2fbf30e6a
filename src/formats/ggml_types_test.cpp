#include "formats/ggml_types.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "formats/numeric.h"

namespace pdb {
namespace {
std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
}  // namespace

TEST(GgmlTypes, TraitsMatchGgml) {
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q8_0, 64), 68u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_0, 64), 36u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::MXFP4, 32), 17u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_K, 256), 144u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q6_K, 512), 420u);
  EXPECT_EQ(ggml_row_bytes(GgmlType::BF16, 3), 6u);
  EXPECT_THROW(ggml_row_bytes(GgmlType::Q8_0, 33), std::invalid_argument);
  EXPECT_FALSE(ggml_type_traits(4).has_value());
  EXPECT_EQ(*ggml_type_from_name("Q8_0"), GgmlType::Q8_0);
  EXPECT_EQ(*ggml_type_from_name("q4_K"), GgmlType::Q4_K);
}

TEST(GgmlTypes, Q8_0BlockLayoutAndError) {
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = float(i - 16) * 0.5f;  // amax 8 at i=0
  std::vector<uint8_t> q(34);
  quantize_row(GgmlType::Q8_0, x.data(), q.data(), 32);
  uint16_t d;
  std::memcpy(&d, q.data(), 2);
  EXPECT_EQ(d, f32_to_fp16(8.0f / 127.0f));
  EXPECT_EQ(int8_t(q[2]), -127);
  EXPECT_EQ(int8_t(q[2 + 16]), 0);
  auto r = randn(4096, 1);
  std::vector<uint8_t> qq(ggml_row_bytes(GgmlType::Q8_0, 4096));
  std::vector<float> y(4096);
  quantize_row(GgmlType::Q8_0, r.data(), qq.data(), 4096);
  dequantize_row(GgmlType::Q8_0, qq.data(), y.data(), 4096);
  for (int b = 0; b < 128; ++b) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(r[b * 32 + j]));
    for (int j = 0; j < 32; ++j) EXPECT_LE(std::fabs(y[b * 32 + j] - r[b * 32 + j]), amax / 127 * 0.51f + 1e-3f * amax);
  }
}

TEST(GgmlTypes, Q8_0RoundingModesDifferOnlyOnTies) {
  // 0.5 * (amax/127) lands exactly on a tie after scaling.
  std::vector<float> x(32, 0.0f);
  x[0] = 127.0f;
  x[1] = 2.5f;
  x[2] = -3.5f;
  std::vector<uint8_t> away(34), even(34);
  quantize_row(GgmlType::Q8_0, x.data(), away.data(), 32, Q8Rounding::TiesAway);
  quantize_row(GgmlType::Q8_0, x.data(), even.data(), 32, Q8Rounding::TiesEven);
  EXPECT_EQ(int8_t(away[3]), 3);
  EXPECT_EQ(int8_t(even[3]), 2);
  EXPECT_EQ(int8_t(away[4]), -4);
  EXPECT_EQ(int8_t(even[4]), -4);
}

TEST(GgmlTypes, Q4_0AndMxfp4RoundTripWithinStep) {
  auto r = randn(1024, 2);
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::MXFP4}) {
    std::vector<uint8_t> q(ggml_row_bytes(t, 1024));
    std::vector<float> y(1024);
    quantize_row(t, r.data(), q.data(), 1024);
    dequantize_row(t, q.data(), y.data(), 1024);
    double err = 0, ref = 0;
    for (int i = 0; i < 1024; ++i) { err += (y[i] - r[i]) * (y[i] - r[i]); ref += r[i] * r[i]; }
    EXPECT_LT(std::sqrt(err / ref), 0.2) << ggml_type_name(t);
    // re-encoding the decoded values is a fixed point
    std::vector<uint8_t> q2(q.size());
    quantize_row(t, y.data(), q2.data(), 1024);
    std::vector<float> y2(1024);
    dequantize_row(t, q2.data(), y2.data(), 1024);
    EXPECT_EQ(y, y2) << ggml_type_name(t);
  }
}

TEST(GgmlTypes, Mxfp4KnownBlock) {
  uint8_t blk[17] = {};
  blk[0] = 128;          // scale 2^(128-128) = 1 on the doubled table -> e2m1 value*2^1... table/2*2
  blk[1] = 0x7 | (0xF << 4);  // x[0] = 12, x[16] = -12
  blk[2] = 0x1 | (0x9 << 4);  // x[1] = 1, x[17] = -1
  std::vector<float> y(32);
  dequantize_row(GgmlType::MXFP4, blk, y.data(), 32);
  EXPECT_EQ(y[0], 12.0f);
  EXPECT_EQ(y[16], -12.0f);
  EXPECT_EQ(y[1], 1.0f);
  EXPECT_EQ(y[17], -1.0f);
  EXPECT_EQ(y[5], 0.0f);
}

TEST(GgmlTypes, Q4_KKnownBlock) {
  // d = 1, dmin = 0.5; sub-block 0: scale 2, min 3 (j<4 path); sub-block 5: scale 17, min 33 (j>=4 path)
  uint8_t blk[144] = {};
  const uint16_t one = f32_to_fp16(1.0f), half = f32_to_fp16(0.5f);
  std::memcpy(blk, &one, 2);
  std::memcpy(blk + 2, &half, 2);
  uint8_t* sc = blk + 4;
  sc[0] = 2; sc[4] = 3;
  // j=5: d = (q[9]&0xF) | ((q[1]>>6)<<4) = 17 -> q[9] low = 1, q[1] top bits = 1
  //      m = (q[9]>>4) | ((q[5]>>6)<<4)   = 33 -> q[9] high = 1, q[5] top bits = 2
  sc[9] = 0x11; sc[1] = 0x40; sc[5] = 0x80;
  uint8_t* qs = blk + 16;
  qs[0] = 0x5;          // element 0 (sub-block 0), low nibble 5
  qs[64 + 0] = 0x90;    // element 160 (sub-block 5 = high nibbles of bytes 64..95), nibble 9
  std::vector<float> y(256);
  dequantize_row(GgmlType::Q4_K, blk, y.data(), 256);
  EXPECT_FLOAT_EQ(y[0], 2 * 5 - 0.5f * 3);
  EXPECT_FLOAT_EQ(y[1], -0.5f * 3);
  EXPECT_FLOAT_EQ(y[160], 17 * 9 - 0.5f * 33);
}

TEST(GgmlTypes, Q6_KKnownBlock) {
  uint8_t blk[210] = {};
  const uint16_t d = f32_to_fp16(0.25f);
  std::memcpy(blk + 208, &d, 2);
  int8_t* sc = reinterpret_cast<int8_t*>(blk + 192);
  sc[0] = 4; sc[2] = -2; sc[8] = 3;
  uint8_t* ql = blk;
  uint8_t* qh = blk + 128;
  ql[0] = 0x0F;  // element 0: low 4 bits 15; element 64 gets the high nibble 0
  qh[0] = 0x03;  // element 0: high 2 bits 3 -> q = 15 | 48 = 63 -> 31 after -32
  ql[32] = 0x01;  // element 32: q = 1 -> -31
  ql[64] = 0x02;  // element 128 (second half): q = 2 -> -30, scale sc[8]
  std::vector<float> y(256);
  dequantize_row(GgmlType::Q6_K, blk, y.data(), 256);
  EXPECT_FLOAT_EQ(y[0], 0.25f * 4 * 31);
  EXPECT_FLOAT_EQ(y[32], 0.25f * -2 * -31);
  EXPECT_FLOAT_EQ(y[64], 0.25f * sc[4] * -32);
  EXPECT_FLOAT_EQ(y[128], 0.25f * 3 * -30);
}

TEST(GgmlTypes, BlockFp8AppliesPerBlockScales) {
  const int64_t rows = 3, cols = 5;
  std::vector<uint8_t> w(rows * cols, 0x38);  // 1.0
  w[0] = 0x40;                                 // 2.0
  const std::vector<float> s = {0.5f, 4.0f, 3.0f, 7.0f};  // blocks 2x3 -> scale grid 2x2
  std::vector<float> y(rows * cols);
  dequantize_block_fp8(w.data(), rows, cols, s.data(), 2, 3, y.data());
  EXPECT_EQ(y[0], 1.0f);            // 2 * 0.5
  EXPECT_EQ(y[1 * cols + 4], 4.0f); // row 1, col 4: block (0,1)
  EXPECT_EQ(y[2 * cols + 0], 3.0f); // block (1,0)
  EXPECT_EQ(y[2 * cols + 3], 7.0f);
}

}  // namespace pdb
