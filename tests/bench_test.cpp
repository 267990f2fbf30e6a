// `bench cold` runs the seed's protocol against a real stack and records truthful rows; `bench plot` draws them;
// `bench prefill` records a row per mode.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include <httplib.h>

#include "support/stack.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;

TEST(BenchCold, RecordsBothLegsWithVerdictsAndPlots) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/qwen3-tiny";
  test::Stack st(so);
  const std::string out = st.dir + "/bench.jsonl";
  test::Child b({test::pdbridge_bin(), "bench", "cold", "--front", "http://127.0.0.1:" + std::to_string(st.front_port), "--native-url",
                 "http://127.0.0.1:" + std::to_string(st.decoder_port), "--chars", "6000", "--runs", "1", "--max-tokens", "8", "--out", out},
                st.dir + "/bench.log");
  ASSERT_EQ(b.stop(0, 300), 0) << b.log();
  std::ifstream in(out);
  std::vector<json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
  ASSERT_EQ(rows.size(), 2u);
  const json& bridged = rows[0]["leg"] == "bridged" ? rows[0] : rows[1];
  const json& native = rows[0]["leg"] == "native" ? rows[0] : rows[1];
  EXPECT_EQ(bridged["verdict"], "complete") << bridged.dump();
  EXPECT_GE(bridged["cached_tokens"].get<int64_t>(), bridged["prompt_tokens"].get<int64_t>() - 1);
  // the first bridge on a front learns the decoder's layout; that time is its own stage, not the wire's
  EXPECT_GT(bridged["t_probe_s"].get<double>(), 0.0) << bridged.dump();
  EXPECT_LE(bridged["t_probe_s"].get<double>() + bridged["t_wire_s"].get<double>() + bridged["t_restore_s"].get<double>(),
            bridged["t_bridge_s"].get<double>() + 1e-3) << bridged.dump();
  EXPECT_EQ(native["cached_tokens"].get<int64_t>(), 0);
  EXPECT_NE(rows[0]["seed"], rows[1]["seed"]) << "every prompt needs a fresh seed";
  for (const auto& r : rows) {
    EXPECT_GT(r["ttft_s"].get<double>(), 0.0);
    EXPECT_TRUE(r.contains("marker_found"));
    EXPECT_NE(r["marker"].get<std::string>().find("ZEBRA-"), std::string::npos);
  }
  test::Child p({test::pdbridge_bin(), "bench", "plot", "--in", out, "--out", st.dir + "/bench.png"}, st.dir + "/plot.log");
  ASSERT_EQ(p.stop(0, 60), 0) << p.log();
  std::ifstream png(st.dir + "/bench.png", std::ios::binary);
  char magic[4] = {};
  png.read(magic, 4);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");
}

// The protocol measures warm engines and cold prompts on an idle decoder: while a fresh front door's /health
// says it is still learning the decoder's layout, or while the decoder's /slots shows a slot still processing
// (the previous run hung up), `bench cold` sends nothing. On the H200 box a request sent meanwhile waited 13.5 s
// (probe) and 0.4-28 s (a cancelled request's last step or prompt batch).
TEST(BenchCold, WaitsForAWarmFrontDoorAndAnIdleDecoder) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const auto probing = [&] { return Clock::now() - t0 < std::chrono::milliseconds(1500); };
  std::atomic<int> requests{0}, early{0}, while_busy{0};
  std::atomic<int64_t> busy_until_ms{0};  // the slot "processes" for 1 s after each request
  const auto now_ms = [&] { return int64_t(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()); };
  httplib::Server front;
  front.Get("/health", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(json{{"ok", true}, {"layout", probing() ? json("probing") : json("32 layers")}}.dump(), "application/json");
  });
  front.Get("/slots", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(json::array({{{"id", 0}, {"is_processing", now_ms() < busy_until_ms.load()}}}).dump(), "application/json");
  });
  front.Post("/v1/chat/completions", [&](const httplib::Request&, httplib::Response& res) {
    ++requests;
    if (probing()) ++early;
    if (now_ms() < busy_until_ms.load()) ++while_busy;
    busy_until_ms = now_ms() + 1000;
    res.status = 400;
    res.set_content(R"({"error":{"message":"refused by the test","code":400}})", "application/json");
  });
  const int port = front.bind_to_any_port("127.0.0.1");
  std::thread serve([&] { front.listen_after_bind(); });
  const std::string dir = test::temp_dir("bench-warm");
  test::Child b({test::pdbridge_bin(), "bench", "cold", "--front", "http://127.0.0.1:" + std::to_string(port), "--skip-native", "--chars", "2000",
                 "--runs", "2", "--max-tokens", "8", "--out", dir + "/bench.jsonl"},
                dir + "/bench.log");
  const int rc = b.stop(0, 60);
  front.stop();
  serve.join();
  ASSERT_EQ(rc, 0) << b.log();
  EXPECT_EQ(requests.load(), 2);
  EXPECT_EQ(early.load(), 0) << "a request went out while the front door was probing";
  EXPECT_EQ(while_busy.load(), 0) << "a request went out while the decoder's slot was still processing";
  EXPECT_NE(b.log().find("waiting for the front door"), std::string::npos) << b.log();
}

// `bench prefill` on the CPU backend: a row per mode and length, and the recipe's rows add up to the
// decoder's cache bytes (layers x tokens x K and V rows of f16).
TEST(BenchPrefill, RecordsEveryModeAndTheRecipesCacheBytes) {
  const std::string dir = test::temp_dir("bench-prefill");
  const std::string model = test::models_dir() + "/llama-tiny", out = dir + "/prefill.jsonl";
  test::Child b({test::pdbridge_bin(), "bench", "prefill", "--device", "cpu", "--model", model + "/hf", "--recipe", model + "/decoder-f32.gguf",
                 "--tokens", "48,96", "--reps", "2", "--chunk", "32", "--label", "ci", "--out", out},
                dir + "/bench.log");
  ASSERT_EQ(b.stop(0, 120), 0) << b.log();
  std::ifstream in(out);
  std::map<std::pair<int64_t, std::string>, json> rows;
  for (std::string line; std::getline(in, line);) {
    const json r = json::parse(line);
    rows[{r["tokens"].get<int64_t>(), r["mode"].get<std::string>()}] = r;
  }
  const json cfg = json::parse(std::ifstream(model + "/hf/config.json"));
  const int64_t layers = cfg["num_hidden_layers"], kv_dim = cfg["num_key_value_heads"].get<int64_t>() * cfg["head_dim"].get<int64_t>();
  for (int64_t T : {48, 96}) {
    for (const std::string mode : {"full-forward", "engine", "engine+recipe", "engine+recipe+frames"}) {
      ASSERT_TRUE(rows.count({T, mode})) << T << " " << mode;
      const json& r = rows[{T, mode}];
      EXPECT_GT(r["tok_s"].get<double>(), 0.0) << r.dump();
      EXPECT_EQ(r["seconds_all"].size(), 2u) << r.dump();
      EXPECT_EQ(r["label"], "ci");
    }
    const int64_t recipe_bytes = rows.at(std::make_pair(T, std::string("engine+recipe")))["wire_bytes"];
    const int64_t framed_bytes = rows.at(std::make_pair(T, std::string("engine+recipe+frames")))["wire_bytes"];
    EXPECT_EQ(recipe_bytes, layers * T * 2 * kv_dim * 2) << "f16 K and V rows of every layer";
    EXPECT_GT(framed_bytes, recipe_bytes) << "frames carry headers";
    EXPECT_EQ(rows.count(std::make_pair(T, std::string("engine-no-attention"))), 0u) << "a GPU-only mode";
  }
  fs::remove_all(dir);
}

TEST(BenchCold, HangsUpAfterStopAfterAndRecordsRefusedPromptsAsErrors) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/qwen3-tiny";
  so.parallel = 1;
  so.ctx = 4096;
  test::Stack st(so);
  const std::string out = st.dir + "/bench.jsonl";
  auto bench = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {test::pdbridge_bin(), "bench", "cold", "--front", "http://127.0.0.1:" + std::to_string(st.front_port),
                                     "--native-url", "http://127.0.0.1:" + std::to_string(st.decoder_port), "--runs", "1", "--out", out};
    argv.insert(argv.end(), extra.begin(), extra.end());
    test::Child b(argv, st.dir + "/bench.log");
    return b.stop(0, 300) == 0 ? std::string() : b.log();
  };
  // both legs, a real 300-token budget, hung up after 2 pieces: the counts still arrive
  ASSERT_EQ(bench({"--chars", "3000", "--max-tokens", "300", "--stop-after", "2"}), "");
  // only the native leg
  ASSERT_EQ(bench({"--chars", "3000", "--max-tokens", "8", "--skip-bridged"}), "");
  // a prompt longer than the decoder's slot: a row with the front door's message, and the bench goes on
  ASSERT_EQ(bench({"--chars", "40000", "--max-tokens", "8", "--skip-native"}), "");
  std::ifstream in(out);
  std::vector<json> rows;
  for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
  ASSERT_EQ(rows.size(), 4u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(rows[size_t(i)]["stopped_after"], 2) << rows[size_t(i)].dump();
    EXPECT_EQ(rows[size_t(i)]["http_status"], 200) << rows[size_t(i)].dump();
    EXPECT_GT(rows[size_t(i)]["prompt_tokens"].get<int64_t>(), 500) << rows[size_t(i)].dump();
    EXPECT_LE(rows[size_t(i)]["generated_tokens"].get<int64_t>(), 3) << rows[size_t(i)].dump();
  }
  EXPECT_EQ(rows[0]["verdict"], "complete") << rows[0].dump();
  EXPECT_EQ(rows[2]["leg"], "native");
  EXPECT_FALSE(rows[2].contains("stopped_after"));
  EXPECT_EQ(rows[3]["http_status"], 400) << rows[3].dump();
  EXPECT_NE(rows[3].value("error", "").find("slots hold 4096"), std::string::npos) << rows[3].dump();
}

}  // namespace pdb
