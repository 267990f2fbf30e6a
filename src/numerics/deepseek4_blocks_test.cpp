// The CPU side of DeepSeek-V4's blocks that the GPU kernels take as their twins, on any CPU: the FP8 indexer's
// operands (dsv4_indexer_fp8_rows; cuda/dsv4_kernels_test.cpp checks the device's codes equal these bit for bit).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "formats/numeric.h"
#include "numerics/deepseek4_blocks.h"

namespace pdb {

TEST(Deepseek4Blocks, IndexerFp8RowsTakeAPowerOfTwoScaleAndRoundEachValueToE4m3) {
  const int64_t dim = 128;
  std::mt19937 gen(11);
  std::normal_distribution<float> nd;
  std::vector<float> x;
  // rows of magnitudes far apart, a zero row, rows whose amax / 448 is a power of two (the scale is that power)
  for (const float mag : {1e-4f, 0.02f, 1.0f, 37.0f, 5e3f}) {
    for (int64_t i = 0; i < dim; ++i) x.push_back(mag * nd(gen));
  }
  x.insert(x.end(), size_t(dim), 0.0f);
  for (const float amax : {448.0f, 896.0f, 0.4375f}) {
    for (int64_t i = 0; i < dim; ++i) x.push_back(0.5f * amax * std::tanh(nd(gen)));
    x[x.size() - 7] = -amax;
  }
  const int64_t rows = int64_t(x.size()) / dim;
  std::vector<uint8_t> codes(x.size());
  std::vector<float> scales(size_t(rows), -1.0f), values(x.size());
  dsv4_indexer_fp8_rows(x.data(), rows, dim, codes.data(), scales.data(), values.data());
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[size_t(r * dim + i)]));
    const float s = scales[size_t(r)];
    int e;
    ASSERT_EQ(std::frexp(s, &e), 0.5f) << "row " << r << ": scale " << s << " is not a power of two";
    if (amax == 0) {
      EXPECT_EQ(s, 1.0f);
      for (int64_t i = 0; i < dim; ++i) EXPECT_EQ(codes[size_t(r * dim + i)], 0) << "a zero row codes zeros";
      continue;
    }
    // the smallest power of two with amax / s <= 448: the row's largest code lands in (224, 448]
    EXPECT_LE(amax / s, 448.0f) << "row " << r;
    EXPECT_GT(amax / s, 224.0f) << "row " << r;
    for (int64_t i = 0; i < dim; ++i) {
      const size_t k = size_t(r * dim + i);
      EXPECT_EQ(values[k], fp8_e4m3_to_f32(codes[k]) * s);
      // e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value, or 2^-10 of the scale below 2^-6
      const float a = std::fabs(x[k]) / s;
      const float bound = a >= 0.015625f ? a * 0.0625f : 0.0009765625f;
      EXPECT_LE(std::fabs(values[k] / s - x[k] / s), bound * 1.0001f) << "row " << r << " value " << i;
    }
  }
  EXPECT_EQ(scales[size_t(rows - 3)], 1.0f) << "amax 448: scale 1";
  EXPECT_EQ(scales[size_t(rows - 2)], 2.0f) << "amax 896: scale 2";
  EXPECT_EQ(scales[size_t(rows - 1)], 1.0f / 1024.0f) << "amax 0.4375 = 448 / 1024";
}

}  // namespace pdb
