// pad_experts (model/moe_padding.h): the padded layout the MoE block's batched products run on.
#include "model/moe_padding.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace pdb {
namespace {

// Every expert's rows fit its chunks, chunks are whole and in expert order, and no candidate chunk size costs less.
void expect_valid_and_least(const std::vector<int32_t>& counts, const PaddedExperts& p) {
  ASSERT_GT(p.cap, 0);
  EXPECT_EQ(p.cap % 64, 0);
  ASSERT_EQ(p.offsets.size(), counts.size());
  int64_t row = 0, chunk = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    EXPECT_EQ(p.offsets[e], row);
    const int64_t chunks = (counts[e] + p.cap - 1) / p.cap;
    for (int64_t c = 0; c < chunks; ++c) EXPECT_EQ(p.chunk_expert[size_t(chunk + c)], int32_t(e));
    chunk += chunks;
    row += chunks * p.cap;
  }
  EXPECT_EQ(row, p.rows);
  EXPECT_EQ(int64_t(p.chunk_expert.size()) * p.cap, p.rows);
  for (int64_t cap = 128; cap <= 4096; cap += 64) {
    int64_t rows = 0;
    for (int32_t n : counts) rows += (n + cap - 1) / cap * cap;
    if (cap <= (*std::max_element(counts.begin(), counts.end()) + 63) / 64 * 64) {
      EXPECT_GE(padded_cost(rows, cap), padded_cost(p.rows, p.cap)) << "cap " << cap << " costs less than " << p.cap;
    }
  }
}

TEST(MoePadding, UniformAndSkewedRoutingPadAtTheLeastCost) {
  std::mt19937 rng(7);
  std::vector<int32_t> uniform(128);
  for (auto& n : uniform) n = 225 + int32_t(rng() % 70);  // ~256 rows each: a 4096-token chunk, top 8 of 128
  auto p = pad_experts(uniform.data(), 128, 3, 2);
  expect_valid_and_least(uniform, p);
  EXPECT_EQ(p.cap, 320);  // one chunk per expert (25% padding) costs less than chunks of 128 (24%)
  std::vector<int32_t> skewed(128);
  for (size_t e = 0; e < skewed.size(); ++e) skewed[e] = int32_t(1700.0 / (1.0 + 0.3 * double(e)));  // the largest ~20x the smallest
  auto q = pad_experts(skewed.data(), 128, 3, 2);
  if (q.cap) expect_valid_and_least(skewed, q);
  auto forced = pad_experts(skewed.data(), 128, INT32_MAX, 1);
  expect_valid_and_least(skewed, forced);
}

TEST(MoePadding, NotWorthItWherePaddingWouldPassTheLimit) {
  std::vector<int32_t> sparse(128, 1);  // one row per expert: 128 chunks of 128 rows for 128 rows
  EXPECT_EQ(pad_experts(sparse.data(), 128, 3, 2).cap, 0);
  std::vector<int32_t> none(64, 0);
  EXPECT_EQ(pad_experts(none.data(), 64, 3, 2).cap, 0);
  std::vector<int32_t> some_empty = {0, 256, 0, 256};  // empty experts take no chunk
  auto p = pad_experts(some_empty.data(), 4, 3, 2);
  EXPECT_EQ(p.cap, 256);
  EXPECT_EQ(p.rows, 512);
  EXPECT_EQ(p.chunk_expert, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(p.offsets, (std::vector<int32_t>{0, 0, 256, 256}));
}

}  // namespace
}  // namespace pdb
