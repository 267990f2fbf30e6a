// The ISA-dependent orders the decoder-faithful engine mirrors (their agreement with the real decoder is
// asserted end to end by the parity tests; these pin the properties each order must have).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "numerics/decoder_numerics.h"
#include "numerics/gemm_lanes.h"
#include "recipes/recipe.h"

namespace pdb {
namespace {

int64_t ulp_distance(float a, float b) {
  auto ordered = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, 4);
    return i < 0 ? int64_t(INT32_MIN) - i : int64_t(i);
  };
  return std::llabs(ordered(a) - ordered(b));
}

}  // namespace

// Both forms of ggml_v_expf are accurate to a couple of ulp over the softmax's range and saturate as
// ggml's do; they are different functions, so they differ in the last bit somewhere.
TEST(DecoderNumerics, VectorExpfOfEachIsaIsAccurateAndSaturates) {
  int64_t worst[2] = {0, 0}, differ = 0, n = 0;
  for (float x = -87.0f; x < 88.0f; x += 0.0137f, ++n) {
    const float ref = float(std::exp(double(x)));
    const float a2 = ggmlnum::v_expf(x, 8), a5 = ggmlnum::v_expf(x, 16);
    worst[0] = std::max(worst[0], ulp_distance(a2, ref));
    worst[1] = std::max(worst[1], ulp_distance(a5, ref));
    differ += a2 != a5;
  }
  EXPECT_LE(worst[0], 2) << "AVX2/NEON form";
  EXPECT_LE(worst[1], 2) << "AVX-512 form";
  EXPECT_GT(differ, 0) << "the two forms never differed over " << n << " points: the AVX-512 variant is not in use";
  for (int lanes : {8, 16}) {
    EXPECT_EQ(ggmlnum::v_expf(-200.0f, lanes), 0.0f) << lanes;
    EXPECT_TRUE(std::isinf(ggmlnum::v_expf(200.0f, lanes))) << lanes;
    EXPECT_EQ(ggmlnum::v_expf(0.0f, lanes), 1.0f) << lanes;
    const float sub = ggmlnum::v_expf(-100.0f, lanes);  // below FLT_MIN: a subnormal, rounded once
    EXPECT_GT(sub, 0.0f) << lanes;
    EXPECT_LT(sub, 1.2e-38f) << lanes;
  }
}

// x86 folds its vector in halves, NEON adds neighbours: an input where the association decides.
TEST(DecoderNumerics, HorizontalSumsFollowEachIsa) {
  float x86[4] = {1e8f, 1.0f, -1e8f, 1.0f}, neon[4] = {1e8f, 1.0f, -1e8f, 1.0f};
  float wide[8] = {1e8f, 1.0f, 1.0f, 1.0f, -1e8f, 1.0f, 1.0f, 1.0f};
  EXPECT_EQ(fold_lanes(neon, 4), 0.0f);  // (1e8 + 1) + (-1e8 + 1): each 1 is lost
  // halves: (1e8 + -1e8) + (1 + 1)
  for (int w = 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) x86[i] = x86[i + w] + x86[i];
  EXPECT_EQ(x86[0], 2.0f);
  EXPECT_EQ(fold_lanes(wide, 8), 6.0f);  // lanes i and i+4 first: the large values cancel before the ones add
}

// Every output of gemm_lanes is dot_lanes of its row and column, whatever the batch: so a chunked
// prefill equals a one-shot one, at every ISA's width.
TEST(DecoderNumerics, LaneGemmIsBatchIndependentAtEveryWidth) {
  std::mt19937 g(5);
  std::normal_distribution<float> d;
  const int64_t rows = 13, out = 7, k = 64;
  std::vector<float> x(size_t(rows * k)), w(size_t(out * k));
  for (auto& v : x) v = d(g);
  for (auto& v : w) v = d(g);
  for (int kn : {4, 8, 16}) {
    std::vector<float> all(static_cast<size_t>(rows * out)), one(static_cast<size_t>(out));
    gemm_lanes(x.data(), w.data(), all.data(), rows, out, k, kn, 2);
    for (int64_t r = 0; r < rows; ++r) {
      gemm_lanes(x.data() + r * k, w.data(), one.data(), 1, out, k, kn, 1);
      for (int64_t o = 0; o < out; ++o) {
        EXPECT_EQ(all[size_t(r * out + o)], one[size_t(o)]) << "kn " << kn;
        EXPECT_EQ(all[size_t(r * out + o)], dot_lanes(w.data() + o * k, x.data() + r * k, k, kn)) << "kn " << kn;
      }
    }
  }
}

// ggml_vec_swiglu_f32: full vectors through ggml_v_silu, the tail past the last one through libm's expf.
TEST(DecoderNumerics, SwigluTailUsesLibmExpf) {
  const int64_t n = 20;
  std::vector<float> gate(n), up(n, 1.0f), y(n);
  for (int64_t i = 0; i < n; ++i) gate[size_t(i)] = -3.0f + 0.31f * float(i);
  ggmlnum::swiglu(1, n, y.data(), gate.data(), up.data(), 16);
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[size_t(i)];
    const float want = i < 16 ? ggmlnum::silu(g, 16) : g / (1.0f + expf(-g));
    EXPECT_EQ(y[size_t(i)], want) << i;
  }
}

}  // namespace pdb
