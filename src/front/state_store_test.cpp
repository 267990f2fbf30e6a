// The kept state files' contract: the longest shared prefix wins, a newer turn supersedes its prefix, the
// bound evicts the least recently used, and a file is removed only when no bridge still reads it.
#include "front/state_store.h"

#include <filesystem>
#include <chrono>
#include <fstream>
#include <thread>

#include <unistd.h>

#include <gtest/gtest.h>

namespace pdb {
namespace {
namespace fs = std::filesystem;

class KeptStatesTest : public ::testing::Test {
 protected:
  fs::path dir = fs::temp_directory_path() / ("pdbridge-kept-test-" + std::to_string(::getpid()));
  void SetUp() override { fs::create_directories(dir); }
  void TearDown() override { fs::remove_all(dir); }
  std::string file(const std::string& name) {
    const std::string p = (dir / name).string();
    std::ofstream(p) << "state";
    return p;
  }
  // Waits for the remover's worker (at most 5 s).
  static bool gone(const std::string& p) {
    for (int i = 0; i < 500 && fs::exists(p); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return !fs::exists(p);
  }
};

std::vector<int32_t> seq(int n, int32_t base) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(base + i);
  return t;
}

TEST_F(KeptStatesTest, TheLongestSharedPrefixWinsAndANewerTurnSupersedesItsPrefix) {
  BackgroundRemover rm;
  KeptStates k(1000, rm);
  const std::string a = file("a.bin"), b = file("b.bin"), a2 = file("a2.bin");
  k.keep(a, seq(100, 0), 100);
  k.keep(b, seq(50, 1000), 100);
  int64_t common = -1;
  auto prompt = seq(150, 0);
  auto f = k.best(prompt, &common);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->path, a);
  EXPECT_EQ(common, 100);
  prompt[60] = -5;  // an edited message: the prefix ends there
  EXPECT_EQ(k.best(prompt, &common)->path, a);
  EXPECT_EQ(common, 60);
  EXPECT_FALSE(k.best(seq(10, 5000), &common));
  EXPECT_EQ(common, 0);
  // the next turn's file extends a's tokens: a is dropped from the store, but removed only once f lets go
  k.keep(a2, seq(180, 0), 200);
  EXPECT_EQ(k.stats().files, 2u);
  EXPECT_EQ(k.stats().bytes, 300u);
  EXPECT_EQ(k.stats().superseded, 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(fs::exists(a)) << "removed while a bridge still reads it";
  f.reset();
  EXPECT_TRUE(gone(a));
  EXPECT_TRUE(fs::exists(b));
  EXPECT_EQ(k.best(seq(200, 0), &common)->path, a2);
  EXPECT_EQ(common, 180);
}

TEST_F(KeptStatesTest, TheBoundEvictsTheLeastRecentlyUsedAndRefusesAFileAloneOverIt) {
  BackgroundRemover rm;
  KeptStates k(1000, rm);
  const std::string a = file("a.bin"), b = file("b.bin"), c = file("c.bin"), big = file("big.bin");
  k.keep(a, seq(10, 0), 400);
  k.keep(b, seq(10, 100), 400);
  int64_t common = 0;
  ASSERT_TRUE(k.best(seq(10, 0), &common));  // a is now the most recently used
  k.keep(c, seq(10, 200), 400);              // past 1000: b goes
  EXPECT_TRUE(gone(b));
  EXPECT_TRUE(fs::exists(a));
  EXPECT_TRUE(fs::exists(c));
  EXPECT_EQ(k.stats().evictions, 1u);
  k.keep(big, seq(10, 300), 1001);
  EXPECT_TRUE(gone(big));
  EXPECT_EQ(k.stats().refused, 1u);
  EXPECT_EQ(k.stats().bytes, 800u);
  k.drop(a);
  EXPECT_TRUE(gone(a));
  k.clear();
  EXPECT_TRUE(gone(c));
  EXPECT_EQ(k.stats().files, 0u);
  EXPECT_EQ(k.stats().bytes, 0u);
}

TEST_F(KeptStatesTest, OffKeepsNothing) {
  BackgroundRemover rm;
  KeptStates k(0, rm);
  EXPECT_FALSE(k.enabled());
  const std::string a = file("a.bin");
  k.keep(a, seq(10, 0), 1);
  EXPECT_TRUE(gone(a));
}

}  // namespace
}  // namespace pdb
