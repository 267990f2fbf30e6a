// DeepSeek-V4's state (llama.cpp's `deepseek4` memory) as the running llama-server writes it, for prompt
// lengths on and inside the edges of the 4- and 128-token blocks: the sections the fact sheet describes are
// there with the counts it derives (window = the last W cells, CSA/LID one row per 4 tokens, HCA one per
// 128, f32 rings of 8 / 128 / 8 rows), `formats/state_file_dsv4` re-writes each file byte-identical, and a
// file of T-1 tokens restored under a T-token prompt leaves the decoder one token to compute
// (cache_n = T-1, prompt_n = 1), while a file of all T tokens makes it prefill everything again: why the bridge
// writes T-1 tokens for this architecture.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "formats/ggml_types.h"
#include "formats/gguf.h"
#include "formats/state_file_dsv4.h"
#include "support/stack.h"
#include "support/test_env.h"

namespace pdb {
namespace {
using json = nlohmann::json;

std::vector<int32_t> tokens_of(uint64_t seed, int n) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(int32_t(1000 + g() % 100000));
  return t;
}

std::vector<uint8_t> read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST(Deepseek4State, ServerFilesHaveEverySectionAndRewriteByteIdentical) {
  const std::string dir = test::models_dir() + "/deepseek4-tiny";
  auto g = GgufFile::open(dir + "/decoder-f32.gguf");
  const auto& ratios_v = g->get("deepseek4.attention.compress_ratios").arr;
  std::vector<uint32_t> ratios;
  for (const auto& v : ratios_v) ratios.push_back(uint32_t(v.u));
  const uint32_t W = uint32_t(g->get("deepseek4.attention.sliding_window").u), D = uint32_t(g->get("deepseek4.attention.key_length").u),
                 I = uint32_t(g->get("deepseek4.attention.indexer.key_length").u);
  std::vector<uint32_t> csa_layers, hca_layers;
  for (uint32_t l = 0; l < ratios.size(); ++l) {
    if (ratios[l] == 4) csa_layers.push_back(l);
    if (ratios[l] == 128) hca_layers.push_back(l);
  }
  for (const std::string cache : {"f16", "q8_0"}) {
    test::StackOptions so;
    so.model_dir = dir;
    so.cache_type = cache;
    so.parallel = 1;
    so.ctx = 4096;
    so.start_prefill = false;
    so.start_front = false;
    test::Stack st(so);
    const GgmlType kt = cache == "f16" ? GgmlType::F16 : GgmlType::Q8_0;
    for (int T : {127, 128, 129, 256, 259, 300}) {
      const auto toks = tokens_of(uint64_t(T) * 7 + (cache == "f16" ? 0 : 1), T);
      auto r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", false}});
      ASSERT_EQ(r.status, 200) << r.body;
      r = st.post_decoder("/slots/0?action=save", {{"filename", "s.bin"}});
      ASSERT_EQ(r.status, 200) << r.body;
      const std::string path = st.slot_dir + "/s.bin";
      auto bytes = read_all(path);
      ASSERT_TRUE(is_dsv4_state(bytes));
      const Dsv4State s = parse_dsv4_state_bytes(bytes, path);
      std::printf("DSV4 cache=%s T=%d: %s, %zu bytes\n", cache.c_str(), T, s.describe().c_str(), bytes.size());
      EXPECT_EQ(s.tokens, toks);
      const uint32_t n = uint32_t(T);
      ASSERT_EQ(s.cells(), n);
      EXPECT_EQ(s.window_cells(), std::min(n, W));
      for (const auto& stm : s.swa.streams)
        if (stm.cell_count) {
          ASSERT_EQ(stm.layers.size(), ratios.size());
          EXPECT_EQ(stm.positions.front(), int32_t(n - std::min(n, W)));
          EXPECT_EQ(stm.positions.back(), int32_t(n - 1));
          for (const auto& b : stm.layers) {
            EXPECT_EQ(b.type, int32_t(kt));
            EXPECT_EQ(b.row_bytes, ggml_row_bytes(kt, D));
          }
        }
      EXPECT_EQ(s.csa.n_rows, n / 4);
      EXPECT_EQ(s.hca.n_rows, n / 128);
      EXPECT_EQ(s.lid.n_rows, n / 4);
      EXPECT_EQ(s.csa.layer_ids, csa_layers);
      EXPECT_EQ(s.hca.layer_ids, hca_layers);
      EXPECT_EQ(s.lid.layer_ids, csa_layers);
      for (const auto& b : s.lid.layers) EXPECT_EQ(b.ne0, I);
      for (const auto& b : s.csa.layers) EXPECT_EQ(b.ne0, D);
      EXPECT_EQ(s.csa_ring.state_size, 8u);
      EXPECT_EQ(s.csa_ring.n_embd_state, 2 * D);
      EXPECT_EQ(s.hca_ring.state_size, 128u);
      EXPECT_EQ(s.hca_ring.n_embd_state, D);
      EXPECT_EQ(s.lid_ring.state_size, 8u);
      EXPECT_EQ(s.lid_ring.n_embd_state, 2 * I);
      EXPECT_EQ(serialize_dsv4_state(s), bytes) << "a parsed DSV4 file must re-write byte-identical";
      // every section is somewhere in the file and none overlaps the next
      uint64_t end = 0;
      for (const auto& sec : s.sections()) {
        EXPECT_GE(sec.block.offset, end) << to_string(sec.kind) << " layer " << sec.layer;
        end = sec.block.offset + sec.block.bytes();
      }
      EXPECT_LE(end, bytes.size());
    }
  }
}

TEST(Deepseek4State, RestoringTMinusOneTokensLeavesOneTokenToComputeAndTTokensRecomputeAll) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/deepseek4-tiny";
  so.parallel = 1;
  so.ctx = 4096;
  so.start_prefill = false;
  so.start_front = false;
  test::Stack st(so);
  const int T = 301;  // 300 cached: 75 CSA rows, 2 HCA rows, window of 128
  const auto toks = tokens_of(99, T);
  const std::vector<int32_t> head(toks.begin(), toks.end() - 1);
  auto r = st.post_decoder("/completion", {{"prompt", head}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "head.bin"}}).status, 200);
  // Our writer's bytes (identical to the server's, asserted above) as the file restored.
  const std::string path = st.slot_dir + "/head.bin";
  const auto bytes = read_all(path);
  const auto rewritten = serialize_dsv4_state(parse_dsv4_state_bytes(bytes, path));
  ASSERT_EQ(rewritten, bytes);
  {
    std::ofstream f(st.slot_dir + "/ours.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(rewritten.data()), std::streamsize(rewritten.size()));
  }
  ASSERT_EQ(st.post_decoder("/slots/0?action=erase", json::object()).status, 200);
  r = st.post_decoder("/slots/0?action=restore", {{"filename", "ours.bin"}});
  ASSERT_EQ(r.status, 200) << r.body;
  json body = {{"prompt", toks}, {"n_predict", 8}, {"temperature", 0}, {"id_slot", 0}, {"cache_prompt", true}};
  r = st.post_decoder("/completion", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const auto t = r.json()["timings"];
  EXPECT_EQ(t["cache_n"].get<int64_t>(), T - 1) << t.dump();
  EXPECT_EQ(t["prompt_n"].get<int64_t>(), 1) << t.dump();
  const std::string restored = r.json()["content"];
  // the same completion computed from nothing
  body["cache_prompt"] = false;
  r = st.post_decoder("/completion", body);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json()["content"].get<std::string>(), restored);
  // a file of all T tokens under the same T-token prompt: the decoder recomputes everything (fact sheet §5)
  r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "all.bin"}}).status, 200);
  ASSERT_EQ(st.post_decoder("/slots/0?action=erase", json::object()).status, 200);
  ASSERT_EQ(st.post_decoder("/slots/0?action=restore", {{"filename", "all.bin"}}).status, 200);
  body["cache_prompt"] = true;
  r = st.post_decoder("/completion", body);
  ASSERT_EQ(r.status, 200) << r.body;
  std::printf("DSV4 restore: T-1 file -> cache_n %lld prompt_n %lld; T file -> cache_n %lld prompt_n %lld\n",
              (long long)t["cache_n"].get<int64_t>(), (long long)t["prompt_n"].get<int64_t>(),
              (long long)r.json()["timings"]["cache_n"].get<int64_t>(), (long long)r.json()["timings"]["prompt_n"].get<int64_t>());
  EXPECT_EQ(r.json()["timings"]["prompt_n"].get<int64_t>(), T) << r.json()["timings"].dump();
  EXPECT_EQ(r.json()["content"].get<std::string>(), restored);
}

}  // namespace pdb
