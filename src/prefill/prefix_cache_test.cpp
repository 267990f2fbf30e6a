// The prefix cache's contract: exact longest prefixes under a key, the cap, superseding, LRU by bytes.
#include "prefill/prefix_cache.h"

#include <gtest/gtest.h>

namespace pdb {
namespace {

struct FakeState final : EngineState {
  size_t b;
  FakeState(int64_t t, size_t bytes) : b(bytes) { tokens = t; }
  size_t bytes() const override { return b; }
};
std::shared_ptr<const EngineState> state(int64_t tokens, size_t bytes = 1000) { return std::make_shared<FakeState>(tokens, bytes); }
std::vector<int32_t> seq(int64_t n, int32_t base = 0) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[size_t(i)] = base + int32_t(i * 7 % 1000);
  return t;
}

TEST(PrefixCache, FindsTheExactLongestCommonPrefixUpToTheCap) {
  PrefixCache c(1 << 20);
  auto a = seq(300);
  EXPECT_EQ(c.lookup("k", a, 300).tokens, 0);  // empty: a miss
  ASSERT_TRUE(c.insert("k", a, state(300)));
  auto b = a;
  b.resize(500);
  for (size_t i = 300; i < 500; ++i) b[i] = 5;
  b[250] = -1;  // diverges inside the fourth block: the hit ends exactly there
  auto h = c.lookup("k", b, 500);
  EXPECT_EQ(h.tokens, 250);
  ASSERT_TRUE(h.state);
  EXPECT_EQ(h.state->tokens, 300);
  b[250] = a[250];
  EXPECT_EQ(c.lookup("k", b, 500).tokens, 300);  // all it holds
  EXPECT_EQ(c.lookup("k", b, 280).tokens, 280);  // at most the cap (what the decoder holds)
  EXPECT_EQ(c.lookup("other spec", b, 500).tokens, 0);  // another key never serves
  b[10] = -1;
  EXPECT_EQ(c.lookup("k", b, 500).tokens, 0);  // shorter than one block: a miss
  const auto s = c.stats();
  EXPECT_EQ(s.hits, 3u);
  EXPECT_EQ(s.misses, 3u);
  EXPECT_EQ(s.reused_tokens, 250u + 300 + 280);
}

TEST(PrefixCache, ANewerTurnSupersedesItsPrefixAndLruEvictsByBytes) {
  PrefixCache c(12'000);  // an entry: its state plus 4 bytes a token
  auto turn1 = seq(200), turn2 = seq(400);  // turn2 extends turn1
  ASSERT_TRUE(c.insert("k", turn1, state(200, 3000)));
  ASSERT_TRUE(c.insert("k", turn2, state(400, 3000)));
  EXPECT_EQ(c.stats().entries, 1u);
  EXPECT_EQ(c.stats().superseded, 1u);
  EXPECT_EQ(c.lookup("k", turn1, 200).state->tokens, 400);  // the newer entry serves the older prefix
  auto other = seq(300, 5000);
  ASSERT_TRUE(c.insert("k", other, state(300, 3000)));
  EXPECT_EQ(c.stats().entries, 2u);
  c.lookup("k", turn2, 400);  // turn2 is now the most recently used
  auto third = seq(300, 9000);
  ASSERT_TRUE(c.insert("k", third, state(300, 3000)));  // needs room: `other` is the least recently used
  EXPECT_EQ(c.stats().evictions, 1u);
  EXPECT_EQ(c.lookup("k", other, 300).tokens, 0);
  EXPECT_EQ(c.lookup("k", turn2, 400).tokens, 400);
  EXPECT_EQ(c.lookup("k", third, 300).tokens, 300);
  EXPECT_FALSE(c.insert("k", seq(100, 20000), state(100, 20'000)));  // alone larger than the bound
  EXPECT_EQ(c.stats().refused, 1u);
  EXPECT_LE(c.stats().bytes, 12'000u);
  PrefixCache off(0);
  EXPECT_FALSE(off.insert("k", turn1, state(200)));
  EXPECT_EQ(off.lookup("k", turn1, 200).tokens, 0);
}

}  // namespace
}  // namespace pdb
