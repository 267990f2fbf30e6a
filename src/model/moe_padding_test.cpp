// pad_experts (model/moe_padding.h): the padded layout the MoE block's batched products run on.
#include "model/moe_padding.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <tuple>

namespace pdb {
namespace {

// Every expert's rows are contiguous from its offset and covered by its chunks, each chunk inside its expert's rows,
// no chunk more than its expert needs, and the rows add up.
void expect_valid(const std::vector<int32_t>& counts, const PaddedExperts& p) {
  ASSERT_FALSE(p.classes.empty());
  ASSERT_LE(p.classes.size(), 2u);
  ASSERT_EQ(p.offsets.size(), counts.size());
  std::map<int32_t, int64_t> covered;  // expert -> rows its chunks cover
  int64_t rows = 0;
  for (const auto& c : p.classes) {
    EXPECT_EQ(c.cap % 64, 0);
    ASSERT_EQ(c.expert.size(), c.first_row.size());
    for (size_t i = 0; i < c.expert.size(); ++i) {
      const int32_t e = c.expert[i];
      const int64_t end = size_t(e) + 1 < p.offsets.size() ? p.offsets[size_t(e) + 1] : p.rows;
      EXPECT_GE(c.first_row[i], p.offsets[size_t(e)]);
      EXPECT_LE(c.first_row[i] + c.cap, end) << "a chunk of expert " << e << " runs into the next expert's rows";
      covered[e] += c.cap;
      rows += c.cap;
    }
  }
  EXPECT_EQ(rows, p.rows);
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t end = e + 1 < p.offsets.size() ? p.offsets[e + 1] : p.rows;
    EXPECT_EQ(end - p.offsets[e], covered[int32_t(e)]) << "expert " << e << "'s rows are its chunks'";
    EXPECT_GE(covered[int32_t(e)], counts[e]);
    EXPECT_LT(covered[int32_t(e)], counts[e] + p.cap()) << "expert " << e << " has a chunk it does not need";
  }
}

int64_t cost_of(const PaddedExperts& p) {
  int64_t cost = 0;
  for (const auto& c : p.classes) cost += padded_cost(int64_t(c.expert.size()) * c.cap, c.cap);
  return cost;
}

// One chunk size: no candidate size costs less.
void expect_least_of_one_size(const std::vector<int32_t>& counts, const PaddedExperts& p) {
  ASSERT_EQ(p.classes.size(), 1u);
  for (int64_t cap = 128; cap <= (*std::max_element(counts.begin(), counts.end()) + 63) / 64 * 64; cap += 64) {
    int64_t rows = 0;
    for (int32_t n : counts) rows += (n + cap - 1) / cap * cap;
    EXPECT_GE(padded_cost(rows, cap), cost_of(p)) << "cap " << cap << " costs less than " << p.cap();
  }
}

// A chunk's expert counts as the benchmark draws them (cuda/grouped_gemm_cudnn_test.cpp): each token picks n_used
// distinct experts, expert e with weight (e+1)^-0.6.
std::vector<int32_t> skewed_counts(int64_t experts, int64_t n_used, int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<double> cdf;
  for (int64_t e = 0; e < experts; ++e) cdf.push_back((cdf.empty() ? 0.0 : cdf.back()) + std::pow(double(e + 1), -0.6));
  std::vector<int32_t> counts(size_t(experts), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int64_t> picks;
    while (int64_t(picks.size()) < n_used) {
      const double u = double(rng()) / 4294967296.0 * cdf.back();
      const int64_t e = std::min<int64_t>(experts - 1, std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
      if (std::find(picks.begin(), picks.end(), e) == picks.end()) picks.push_back(e);
    }
    for (int64_t e : picks) ++counts[size_t(e)];
  }
  return counts;
}

TEST(MoePadding, UniformRoutingPadsToOneSizeAtTheLeastCost) {
  std::mt19937 rng(7);
  std::vector<int32_t> uniform(128);
  for (auto& n : uniform) n = 225 + int32_t(rng() % 70);  // ~256 rows each: a 4096-token chunk, top 8 of 128
  auto p = pad_experts(uniform.data(), 128, 3, 2);
  expect_valid(uniform, p);
  expect_least_of_one_size(uniform, p);
  EXPECT_EQ(p.cap(), 320);  // one chunk per expert (25% padding) costs less than chunks of 128 (24%) or two sizes
  EXPECT_TRUE(p.one_chunk_per_expert(128));
  expect_least_of_one_size(uniform, pad_experts(uniform.data(), 128, 3, 2, false));
}

// Two sizes only where they pad at least 4% of the routed rows less than the best single size (a second product costs
// a launch and its own tail: on the H200 two sizes that padded no less ran 4-7% slower).
TEST(MoePadding, SkewedRoutingTakesTwoSizesOnlyWhereTheyPadLess) {
  int two_taken = 0;
  for (const auto& [E, k, T] : {std::tuple<int64_t, int64_t, int64_t>{128, 8, 4096}, {128, 8, 8192}, {64, 6, 4096}, {64, 6, 8192}}) {
    for (uint32_t seed = 1; seed <= 4; ++seed) {
      const auto counts = skewed_counts(E, k, T, seed);
      const auto one = pad_experts(counts.data(), E, INT32_MAX, 1, false), p = pad_experts(counts.data(), E, INT32_MAX, 1);
      expect_valid(counts, one);
      expect_least_of_one_size(counts, one);
      expect_valid(counts, p);
      if (p.classes.size() == 1) {
        EXPECT_EQ(p.cap(), one.cap());
        continue;
      }
      ++two_taken;
      EXPECT_GT(p.classes[0].cap, p.classes[1].cap);
      EXPECT_GE(p.classes[0].cap, 384);
      EXPECT_LE(p.rows + T * k / 25, one.rows) << "two sizes pad at least 4% of the routed rows less";
    }
  }
  EXPECT_GT(two_taken, 0) << "the skewed 64-expert chunks of 8192 tokens pad less with two sizes (as measured on the H200)";
}

TEST(MoePadding, NotWorthItWherePaddingWouldPassTheLimit) {
  std::vector<int32_t> sparse(128, 1);  // one row per expert: 128 chunks of 128 rows for 128 rows
  EXPECT_EQ(pad_experts(sparse.data(), 128, 3, 2).cap(), 0);
  std::vector<int32_t> none(64, 0);
  EXPECT_EQ(pad_experts(none.data(), 64, 3, 2).cap(), 0);
  std::vector<int32_t> some_empty = {0, 256, 0, 256};  // empty experts take no chunk
  auto p = pad_experts(some_empty.data(), 4, 3, 2);
  ASSERT_EQ(p.classes.size(), 1u);
  EXPECT_EQ(p.cap(), 256);
  EXPECT_EQ(p.rows, 512);
  EXPECT_EQ(p.classes[0].expert, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(p.classes[0].first_row, (std::vector<int32_t>{0, 256}));
  EXPECT_EQ(p.offsets, (std::vector<int32_t>{0, 0, 256, 256}));
  EXPECT_FALSE(p.one_chunk_per_expert(4));  // the empty experts have none
}

// The chunks are at most 1024 rows (larger products run no faster, and the search runs while the GPU waits).
TEST(MoePadding, ChunksStayWithin1024RowsHoweverLargeAnExpert) {
  std::vector<int32_t> one_hot(256, 0);
  one_hot[3] = 32768 * 8 + 5;  // every row on one expert
  auto p = pad_experts(one_hot.data(), 256, INT32_MAX, 1);
  expect_valid(one_hot, p);
  for (const auto& c : p.classes) EXPECT_LE(c.cap, 1024);
  EXPECT_LT(p.rows, one_hot[3] + 1024);
}

}  // namespace
}  // namespace pdb
