// Every verdict for the MoE (qwen3moe) and MLA (deepseek2, a K-only state) stacks, as the dense ones
// have them (bridge_test.cpp, streaming_test.cpp): `native: short`, `complete` == native greedy,
// `native: warm`, declined with the prefill server down, declined (fingerprint) with another model's
// recipe, and a capture over its memory limit sealing a prefix that the decoder mounts and answers from.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "support/stack.h"
#include "support/test_env.h"
#include "tools/make_model.h"

namespace pdb {
namespace {
using json = nlohmann::json;

struct VerdictCase {
  std::string model, arch;
  uint64_t seed;
  int partial_words;  // a prompt long enough to pass a 1 MiB backlog at this model's cache bytes per token
  std::string link_gbps;  // slower than the engine's output on a loaded 2-core machine, so that the backlog grows
};
void PrintTo(const VerdictCase& c, std::ostream* os) { *os << c.model; }

json body(const std::string& prompt) { return {{"prompt", prompt}, {"n_predict", 24}, {"temperature", 0}}; }
std::string native(test::Stack& st, const std::string& prompt) {
  auto b = body(prompt);
  b["cache_prompt"] = false;
  b["id_slot"] = 0;
  auto r = st.post_decoder("/completion", b);
  EXPECT_EQ(r.status, 200) << r.body;
  return r.json().value("content", "");
}
// The same architecture and shapes with other weights (another seed): a recipe the fingerprint must refuse.
std::string other_seed_gguf(const VerdictCase& c) {
  MakeModelOptions o;
  o.arch = c.arch; o.preset = "tiny"; o.seed = c.seed + 100; o.out = test::temp_dir(c.model + "-other"); o.gguf_types = {"f32"};
  o.vocab_dir = test::llama_src() + "/models";
  make_model(o);
  return o.out + "/decoder-f32.gguf";
}

class MoeMlaVerdicts : public ::testing::TestWithParam<VerdictCase> {};

TEST_P(MoeMlaVerdicts, ShortCompleteWarmDeclinedAndPartial) {
  const auto& c = GetParam();
  const std::string dir = test::models_dir() + "/" + c.model;
  {
    test::StackOptions so;
    so.model_dir = dir;
    test::Stack st(so);
    auto r = st.post_front("/completion", body("Hello there, short prompt."));
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.verdict().value("verdict", ""), "native: short");
    const std::string prompt = test::random_text(611, 700);
    r = st.post_front("/completion", body(prompt));
    ASSERT_EQ(r.status, 200) << r.body;
    ASSERT_EQ(r.verdict().value("verdict", ""), "complete") << r.verdict().dump() << st.logs();
    const std::string bridged = r.json()["content"];
    r = st.post_front("/completion", body(prompt));
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.verdict().value("verdict", ""), "native: warm");
    EXPECT_EQ(r.json()["content"].get<std::string>(), bridged);
    EXPECT_EQ(bridged, native(st, prompt));
    st.stop_prefill();
    const std::string other = test::random_text(612, 700);
    r = st.post_front("/completion", body(other));
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.verdict().value("verdict", "").rfind("declined: ", 0), 0u) << r.verdict().dump();
    EXPECT_LT(r.json()["timings"]["cache_n"].get<int64_t>(), 10) << "nothing may have been mounted";
    EXPECT_EQ(r.json()["content"].get<std::string>(), native(st, other));
    EXPECT_EQ(st.stray_state_files(), 0u);
  }
  {
    test::StackOptions so;
    so.model_dir = dir;
    so.recipe_gguf = other_seed_gguf(c);
    test::Stack st(so);
    const std::string prompt = test::random_text(613, 700);
    auto r = st.post_front("/completion", body(prompt));
    ASSERT_EQ(r.status, 200) << r.body;
    const std::string v = r.verdict().value("verdict", "");
    EXPECT_NE(v.find("declined: "), std::string::npos) << r.verdict().dump();
    EXPECT_NE(v.find("fingerprint"), std::string::npos) << r.verdict().dump();
    EXPECT_LT(r.json()["timings"]["cache_n"].get<int64_t>(), 10);
    EXPECT_EQ(r.json()["content"].get<std::string>(), native(st, prompt));
  }
  {
    test::StackOptions so;
    so.model_dir = dir;
    so.ctx = 32768;
    so.prefill_extra = {"--memory-limit-mb", "1", "--link-gbps", c.link_gbps, "--chunk", "64"};
    test::Stack st(so);
    const std::string prompt = test::random_text(614, c.partial_words);
    auto r = st.post_front("/completion", body(prompt));
    ASSERT_EQ(r.status, 200) << r.body;
    const auto v = r.verdict();
    const std::string verdict = v.value("verdict", "");
    ASSERT_EQ(verdict.rfind("partial ", 0), 0u) << v.dump() << st.logs();
    const int64_t T = v["tokens"].get<int64_t>(), B = v["bridged_tokens"].get<int64_t>();
    EXPECT_GT(B, 0);
    EXPECT_LT(B, T);
    const auto t = r.json()["timings"];
    EXPECT_EQ(t["cache_n"].get<int64_t>(), B) << t.dump();
    EXPECT_EQ(t["prompt_n"].get<int64_t>(), T - B) << t.dump();
    EXPECT_EQ(r.json()["content"].get<std::string>(), native(st, prompt));
    EXPECT_EQ(st.stray_state_files(), 0u);
  }
}

// qwen3moe-tiny: ~1 KB of cache per token; deepseek2-tiny: 384 bytes (2 layers x one 96-wide f16 row), and its
// decoder-faithful MLA engine made only ~127 KB/s on CI's loaded 2-core machine: its link is slower still
INSTANTIATE_TEST_SUITE_P(Models, MoeMlaVerdicts,
                         ::testing::Values(VerdictCase{"qwen3moe-tiny", "qwen3moe", 3, 4000, "0.002"},
                                           VerdictCase{"deepseek2-tiny", "deepseek2", 4, 10000, "0.0005"}),
                         [](const auto& info) {
                           std::string n = info.param.model;
                           for (auto& ch : n) if (ch == '-') ch = '_';
                           return n;
                         });

}  // namespace
}  // namespace pdb
