// Streaming at scale, in miniature: a capture that outruns its link seals a valid prefix (partial
// verdict, correct answer), and the sender's pacing holds the emulated link rate.
#include <gtest/gtest.h>

#include <filesystem>

#include "support/stack.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
json body(const std::string& prompt) { return {{"prompt", prompt}, {"n_predict", 16}, {"temperature", 0}}; }
std::string native(test::Stack& st, const std::string& prompt) {
  auto b = body(prompt);
  b["cache_prompt"] = false;
  b["id_slot"] = 1;
  auto r = st.post_decoder("/completion", b);
  return r.status == 200 ? r.json().value("content", "") : "HTTP " + std::to_string(r.status);
}
}  // namespace

TEST(Streaming, CaptureOverItsMemoryLimitSealsAValidPrefix) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/llama-tiny";
  // ~1 KB of cache per token; a 1 MiB backlog limit behind a 2 Mbit/s link seals after ~1-2K tokens
  so.prefill_extra = {"--memory-limit-mb", "1", "--link-gbps", "0.002", "--chunk", "64"};
  test::Stack st(so);
  const std::string prompt = test::random_text(77, 4000);
  auto r = st.post_front("/completion", body(prompt));
  ASSERT_EQ(r.status, 200) << r.body;
  const auto v = r.verdict();
  const std::string verdict = v.value("verdict", "");
  ASSERT_EQ(verdict.rfind("partial ", 0), 0u) << v.dump() << st.logs();
  const int64_t T = v["tokens"].get<int64_t>(), B = v["bridged_tokens"].get<int64_t>();
  EXPECT_EQ(verdict, "partial " + std::to_string(B) + "/" + std::to_string(T));
  EXPECT_GT(B, 0);
  EXPECT_LT(B, T);
  EXPECT_EQ(B % 64, 0) << "the sealed prefix ends on a chunk boundary";
  // the decoder mounted exactly the prefix and prefilled the rest itself
  const auto t = r.json()["timings"];
  EXPECT_EQ(t["cache_n"].get<int64_t>(), B) << t.dump();
  EXPECT_EQ(t["prompt_n"].get<int64_t>(), T - B) << t.dump();
  EXPECT_EQ(r.json()["content"].get<std::string>(), native(st, prompt));
  EXPECT_EQ(st.stray_state_files(), 0u);
}

TEST(Streaming, SenderPacingHoldsTheLinkRate) {
  const double gbps = 0.001;  // 125 kB/s: well below the CPU engine's output even on a slow machine
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/llama-tiny";
  so.prefill_extra = {"--link-gbps", "0.001", "--memory-limit-mb", "512"};
  test::Stack st(so);
  auto r = st.post_front("/completion", body(test::random_text(78, 600)));
  ASSERT_EQ(r.status, 200) << r.body;
  const auto v = r.verdict();
  ASSERT_EQ(v.value("verdict", ""), "complete") << v.dump();
  const double rate = double(v["bytes"].get<int64_t>()) * 8 / v["t_wire_s"].get<double>() / 1e9;
  std::printf("wire %.0f bytes in %.2fs: %.4f Gbit/s on a %.4f Gbit/s emulated link (%.0f%%)\n", double(v["bytes"].get<int64_t>()),
              v["t_wire_s"].get<double>(), rate, gbps, 100 * rate / gbps);
  EXPECT_LE(rate, gbps * 1.05);
  EXPECT_GE(rate, gbps * 0.80);
}

}  // namespace pdb
