// The bridge end to end against the real llama-server: bridged == native, the cache hit is real,
// every verdict is truthful, failures fall back to a correct native answer, nothing is left behind.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <httplib.h>

#include "support/stack.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {


json completion_body(const std::string& prompt) { return {{"prompt", prompt}, {"n_predict", 24}, {"temperature", 0}}; }

// The same request straight to the decoder, without any reuse: the reference answer.
std::string native_content(test::Stack& st, const std::string& prompt) {
  auto b = completion_body(prompt);
  b["cache_prompt"] = false;
  b["id_slot"] = 0;
  auto r = st.post_decoder("/completion", b);
  EXPECT_EQ(r.status, 200) << r.body;
  return r.json().value("content", "");
}

struct E2ECase { std::string model, gguf; };
void PrintTo(const E2ECase& c, std::ostream* os) { *os << c.model << "/" << c.gguf; }

}  // namespace

class BridgeEndToEnd : public ::testing::TestWithParam<E2ECase> {};

TEST_P(BridgeEndToEnd, BridgedCompletionEqualsNativeWithARealCacheHit) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/" + GetParam().model;
  so.decoder_type = GetParam().gguf;
  test::Stack st(so);
  const std::string prompt = test::random_text(101, 900);
  auto r = st.post_front("/completion", completion_body(prompt));
  ASSERT_EQ(r.status, 200) << r.body << st.logs();
  auto v = r.verdict();
  ASSERT_EQ(v.value("verdict", ""), "complete") << v.dump() << st.logs();
  const int64_t T = v["tokens"].get<int64_t>();
  EXPECT_GT(T, 900);
  EXPECT_EQ(v["bridged_tokens"].get<int64_t>(), T);
  // the decoder reused the whole bridged prefix and evaluated only the last token
  const auto timings = r.json()["timings"];
  EXPECT_GE(timings["cache_n"].get<int64_t>(), T - 1) << timings.dump();
  EXPECT_LE(timings["prompt_n"].get<int64_t>(), 1) << timings.dump();
  EXPECT_EQ(v["cached_tokens"].get<int64_t>(), timings["cache_n"].get<int64_t>());
  EXPECT_GT(v["bytes"].get<int64_t>(), 0);
  EXPECT_EQ(r.json()["content"].get<std::string>(), native_content(st, prompt));
  EXPECT_EQ(st.stray_state_files(), 0u) << "state files left in the slot directory";
}

INSTANTIATE_TEST_SUITE_P(Models, BridgeEndToEnd,
                         ::testing::Values(E2ECase{"llama-tiny", "f32"}, E2ECase{"llama-tiny", "f16"}, E2ECase{"qwen3-tiny", "f32"},
                                           E2ECase{"qwen3-tiny", "f16"}, E2ECase{"llama-tiny", "q8_0"}, E2ECase{"qwen3moe-tiny", "f32"},
                                           E2ECase{"deepseek2-tiny", "f32"}),
                         [](const auto& info) {
                           std::string n = info.param.model + "_" + info.param.gguf;
                           for (auto& ch : n) if (ch == '-') ch = '_';
                           return n;
                         });

TEST(BridgeVerdicts, ShortWarmAndQuantizedCache) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/llama-tiny";
  so.cache_type = "q8_0";  // quantized cache: Hadamard-rotated rows
  test::Stack st(so);
  auto r = st.post_front("/completion", completion_body("Hello there, short prompt."));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.verdict().value("verdict", ""), "native: short");
  const std::string prompt = test::random_text(202, 700);
  r = st.post_front("/completion", completion_body(prompt));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.verdict().value("verdict", ""), "complete") << r.verdict().dump() << st.logs();
  const std::string bridged = r.json()["content"];
  // Same prompt again: the slot already holds it.
  r = st.post_front("/completion", completion_body(prompt));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.verdict().value("verdict", ""), "native: warm");
  EXPECT_GE(r.verdict()["cached_tokens"].get<int64_t>(), r.verdict()["tokens"].get<int64_t>() - 1);
  EXPECT_EQ(r.json()["content"].get<std::string>(), bridged);
  EXPECT_EQ(bridged, native_content(st, prompt));
  EXPECT_EQ(st.stray_state_files(), 0u);
}

// The front door learns the decoder's state layout and calibrates layer 0 as it starts, so the first
// bridged request does not wait for the probe prefill (11-14 s on an 8B CPU decoder).
TEST(FrontDoor, LearnsTheDecoderLayoutBeforeTheFirstRequest) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/llama-tiny";
  test::Stack st(so);
  httplib::Client c("127.0.0.1", st.front_port);
  json h;
  for (int i = 0; i < 600; ++i) {
    auto r = c.Get("/health");
    ASSERT_TRUE(r);
    h = json::parse(r->body);
    if (h["layout"].is_string() && h["layout"] != "probing") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(h["layout"].is_string() && h["layout"] != "probing") << "no layout 60 s after start, without any request: " << h.dump() << st.logs();
  ASSERT_TRUE(h["calibration"].is_string()) << h.dump();
  EXPECT_NE(h["calibration"].get<std::string>().find("identical"), std::string::npos) << h.dump();
  EXPECT_TRUE(h["calibration_error"].is_null()) << h.dump();
  auto r = st.post_front("/completion", completion_body(test::random_text(505, 700)));
  ASSERT_EQ(r.status, 200) << r.body;
  const auto v = r.verdict();
  EXPECT_EQ(v.value("verdict", ""), "complete") << v.dump() << st.logs();
  EXPECT_LT(v["t_probe_s"].get<double>(), 0.05) << "the first request probed again: " << v.dump();
  EXPECT_EQ(st.stray_state_files(), 0u);
}

TEST(BridgeVerdicts, PrefillDownIsDeclinedAndServedNatively) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/qwen3-tiny";
  test::Stack st(so);
  st.stop_prefill();
  const std::string prompt = test::random_text(303, 700);
  auto r = st.post_front("/completion", completion_body(prompt));
  ASSERT_EQ(r.status, 200) << r.body;
  const auto v = r.verdict();
  EXPECT_EQ(v.value("verdict", "").rfind("declined: ", 0), 0u) << v.dump();
  EXPECT_EQ(v["bridged_tokens"].get<int64_t>(), 0);
  EXPECT_LT(r.json()["timings"]["cache_n"].get<int64_t>(), 10) << "nothing may have been mounted";
  EXPECT_EQ(r.json()["content"].get<std::string>(), native_content(st, prompt));
  EXPECT_EQ(st.stray_state_files(), 0u);
}

TEST(BridgeVerdicts, WrongRecipeIsDeclinedNeverMounted) {
  // The prefill server runs another seed's decoder GGUF as its recipe: same shapes, other weights.
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/llama-tiny";
  so.recipe_gguf = test::models_dir() + "/llama-tiny-other/decoder-f32.gguf";
  test::Stack st(so);
  const std::string prompt = test::random_text(404, 700);
  auto r = st.post_front("/completion", completion_body(prompt));
  ASSERT_EQ(r.status, 200) << r.body;
  const auto v = r.verdict();
  EXPECT_NE(v.value("verdict", "").find("declined: "), std::string::npos) << v.dump();
  EXPECT_NE(v.value("verdict", "").find("fingerprint"), std::string::npos) << v.dump();
  EXPECT_LT(r.json()["timings"]["cache_n"].get<int64_t>(), 10);
  EXPECT_EQ(r.json()["content"].get<std::string>(), native_content(st, prompt));
  EXPECT_EQ(st.stray_state_files(), 0u);
}

TEST(FrontDoor, MalformedRequestsGet4xxAndTheServerKeepsServing) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/llama-tiny";
  so.start_prefill = false;
  test::Stack st(so);
  struct Bad { std::string path, body; int status; std::string needle; };
  std::vector<Bad> bad = {
      {"/v1/chat/completions", "{not json", 400, "not valid JSON"},
      {"/v1/chat/completions", "[1,2]", 400, "JSON object"},
      {"/v1/chat/completions", R"({"model":"x"})", 400, "messages"},
      {"/v1/chat/completions", R"({"messages":"hi"})", 400, "messages"},
      {"/v1/chat/completions", R"({"messages":[{"content":"no role"}]})", 400, "role"},
      {"/v1/completions", R"({"prompt":{"a":1}})", 400, "prompt"},
      {"/completion", R"({"n_predict":3})", 400, "prompt"},
      {"/completion", R"({"prompt":"x","stream":"yes"})", 400, "stream"},
      {"/completion", R"({"prompt":"x","id_slot":3})", 400, "id_slot"},
  };
  for (const auto& b : bad) {
    auto r = test::http_post(st.front_port, b.path, b.body, 30);
    EXPECT_EQ(r.status, b.status) << b.path << " " << b.body << " -> " << r.body;
    auto j = json::parse(r.body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.body;
    EXPECT_NE(j["error"]["message"].get<std::string>().find(b.needle), std::string::npos) << r.body;
  }
  auto r = st.post_front("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "still there?"}}}}, {"max_tokens", 4}});
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.verdict().value("verdict", ""), "native: short");
  httplib::Client c("127.0.0.1", st.front_port);
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_TRUE(json::parse(h->body)["decoder"].get<bool>());
}

TEST(FrontDoor, StreamsServerSentEventsAsTheyArrive) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/llama-tiny";
  test::Stack st(so);
  const std::string prompt = test::random_text(505, 700);
  httplib::Client c("127.0.0.1", st.front_port);
  c.set_read_timeout(300, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = json{{"messages", {{{"role", "user"}, {"content", prompt}}}}, {"stream", true}, {"max_tokens", 16}, {"temperature", 0}}.dump();
  req.set_header("Content-Type", "application/json");
  std::string header;
  std::vector<std::string> pieces;
  req.response_handler = [&](const httplib::Response& r) { header = r.get_header_value("X-PD-Bridge"); return true; };
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) { pieces.emplace_back(d, n); return true; };
  auto r = c.send(req);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  ASSERT_FALSE(header.empty());
  EXPECT_EQ(json::parse(header)["verdict"], "complete") << header << st.logs();
  std::string all;
  for (auto& p : pieces) all += p;
  EXPECT_GT(pieces.size(), 3u) << "the body arrived in one piece: not streamed";
  EXPECT_NE(all.find("data: "), std::string::npos);
  EXPECT_NE(all.find("[DONE]"), std::string::npos);
  EXPECT_EQ(st.stray_state_files(), 0u);
}

TEST(FrontDoor, OfficialOpenAiClientStreamsThroughTheBridge) {
  const std::string npm = test::build_dir() + "/npm/node_modules/openai";
  ASSERT_TRUE(fs::exists(npm)) << "the openai npm package is installed by the npm_openai fixture";
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/qwen3-tiny";
  test::Stack st(so);
  const std::string prompt = test::random_text(606, 700);
  const std::string out = st.dir + "/openai.out";
  setenv("NODE_PATH", (test::build_dir() + "/npm/node_modules").c_str(), 1);
  test::Child node({"/usr/bin/env", "node", std::string(PDBRIDGE_TESTS_DIR) + "/openai_stream.cjs",
                    "http://127.0.0.1:" + std::to_string(st.front_port) + "/v1", prompt},
                   out);
  const int rc = node.stop(0, 300);  // signal 0: just wait
  ASSERT_EQ(rc, 0) << node.log();
  std::string line = node.log();
  auto j = json::parse(line.substr(line.find('{')));
  EXPECT_EQ(j["verdict"]["verdict"], "complete") << line << st.logs();
  EXPECT_GT(j["chunks"].get<int>(), 2);
  EXPECT_FALSE(j["text"].get<std::string>().empty());
}

}  // namespace pdb
