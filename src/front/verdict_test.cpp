// The verdict a bridged answer ends with: settled from the decoder's own timings, so that a restore the decoder
// reported but did not use is never `complete`; read from streamed answers as their bytes pass.
#include "front/verdict.h"

#include <gtest/gtest.h>

#include "front/decoder_setup.h"

namespace pdb {
namespace {

Verdict mounted(int64_t tokens, int64_t mounted_tokens, const std::string& verdict = "complete") {
  Verdict v;
  v.verdict = verdict;
  v.complete = verdict == "complete";
  v.tokens = tokens;
  v.mounted_tokens = mounted_tokens;
  v.bridged_tokens = mounted_tokens;
  return v;
}

}  // namespace

TEST(Verdict, CompleteOnlyWhenTheAnswerTookTheMountedTokensFromTheCache) {
  Verdict v = mounted(1000, 1000);  // a K/V file of all T tokens: llama-server evaluates the last one again
  settle_verdict(v, 999);
  EXPECT_EQ(v.verdict, "complete");
  EXPECT_EQ(v.decoder_used, true);
  EXPECT_EQ(v.cached_tokens, 999);

  Verdict d = mounted(1000, 999);  // DeepSeek-V4: T-1 mounted, cache_n T-1
  settle_verdict(d, 999);
  EXPECT_EQ(d.verdict, "complete");

  Verdict p = mounted(1000, 400, "partial 400/1000");
  settle_verdict(p, 400);
  EXPECT_EQ(p.verdict, "partial 400/1000");
  EXPECT_EQ(p.decoder_used, true);

  Verdict u = mounted(1000, 1000);  // the restore was reported, the prompt computed again
  settle_verdict(u, 3);
  EXPECT_EQ(verdict_class(u.verdict), "unused") << u.verdict;
  EXPECT_FALSE(u.complete);
  EXPECT_EQ(u.decoder_used, false);
  EXPECT_NE(u.verdict.find("restored 1000 tokens"), std::string::npos) << u.verdict;
  EXPECT_NE(u.verdict.find("997"), std::string::npos) << u.verdict;
  EXPECT_EQ(u.to_json().value("decoder_used", true), false);

  Verdict pu = mounted(1000, 400, "partial 400/1000");  // a partial bridge of which only some was used
  settle_verdict(pu, 399);
  EXPECT_EQ(verdict_class(pu.verdict), "unused");
}

TEST(Verdict, NativeDeclinedAndUntimedAnswersAreLeftAsTheyAre) {
  Verdict n;
  n.verdict = "native: short";
  n.tokens = 10;
  settle_verdict(n, 0);
  EXPECT_EQ(n.verdict, "native: short");
  EXPECT_FALSE(n.decoder_used.has_value());
  EXPECT_EQ(n.cached_tokens, 0);
  Verdict d;
  d.verdict = "declined: prefill server down";
  d.tokens = 5000;
  settle_verdict(d, 0);
  EXPECT_EQ(d.verdict, "declined: prefill server down");
  Verdict c = mounted(1000, 1000);
  settle_verdict(c, std::nullopt);  // no timings: nothing to settle from
  EXPECT_EQ(c.verdict, "complete");
  EXPECT_FALSE(c.decoder_used.has_value());
  EXPECT_FALSE(c.to_json().contains("decoder_used"));
}

TEST(Verdict, StreamScannerFindsTheTimingsWhereverTheBytesSplit) {
  const std::string stream =
      "data: {\"content\":\"a\",\"stop\":false}\n\n"
      "data: {\"content\":\"\",\"stop\":true,\"timings\":{\"prompt_n\":1,\"cache_n\":4095,\"predicted_n\":8}}\n\n"
      "data: [DONE]\n\n";
  for (size_t cut = 1; cut < stream.size(); cut += 7) {
    SseTimingsScanner s;
    s.feed(stream.data(), cut);
    s.feed(stream.data() + cut, stream.size() - cut);
    ASSERT_EQ(s.cache_n(), 4095) << "split at " << cut;
  }
  SseTimingsScanner none;
  const std::string no_timings = "data: {\"content\":\"timings\"}\n\n";
  none.feed(no_timings.data(), no_timings.size());
  EXPECT_FALSE(none.cache_n().has_value());
}

TEST(Verdict, TheStreamedEventCarriesTheSettledVerdict) {
  Verdict v = mounted(100, 100);
  settle_verdict(v, 2);
  const std::string oai = verdict_event(v, true), native = verdict_event(v, false);
  ASSERT_EQ(oai.rfind("event: pdbridge.verdict\ndata: ", 0), 0u) << oai;
  ASSERT_EQ(oai.substr(oai.size() - 2), "\n\n");
  const auto j = nlohmann::json::parse(oai.substr(oai.find("data: ") + 6));
  EXPECT_EQ(verdict_class(j["pdbridge_verdict"]["verdict"].get<std::string>()), "unused");
  EXPECT_FALSE(j.contains("content"));
  const auto n = nlohmann::json::parse(native.substr(native.find("data: ") + 6));
  EXPECT_EQ(n["content"], "");
  EXPECT_EQ(n["stop"], true);
}

TEST(DecoderSetup, NamesTheFlagsAUserStartedServerNeeds) {
  const nlohmann::json props = {{"build_info", "b7000-80fb11ac7"}, {"total_slots", 4}, {"endpoint_slots", true},
                                {"default_generation_settings", {{"n_ctx", 8192}}}};
  const DecoderSetup unified = assess_decoder(props, 1, 3, 4096);
  EXPECT_EQ(unified.release, "node-llama-cpp 3.21.1 (pinned)");
  ASSERT_EQ(unified.problems.size(), 1u);
  EXPECT_NE(unified.problems[0].find("--no-kv-unified"), std::string::npos) << unified.problems[0];
  EXPECT_NE(unified.problems[0].find("--cache-idle-slots"), std::string::npos) << unified.problems[0];
  EXPECT_TRUE(assess_decoder(props, 4, 3, 4096).problems.empty());
  EXPECT_TRUE(assess_decoder(props, 0, 0, 4096).problems.empty()) << "streams unknown before the probe";
  auto small = props;
  small["default_generation_settings"]["n_ctx"] = 2048;
  small["endpoint_slots"] = false;
  const DecoderSetup s = assess_decoder(small, 4, 3, 4096);
  ASSERT_EQ(s.problems.size(), 2u);
  EXPECT_NE(s.problems[0].find("--ctx-size"), std::string::npos);
  EXPECT_NE(s.problems[1].find("--slots"), std::string::npos);
  EXPECT_EQ(find_measured_release("version: 1 (964a1a5)")->state_version, 2u);
  EXPECT_EQ(find_measured_release("b1-de3ff81")->node_llama_cpp, std::string("3.22.1"));
  EXPECT_EQ(find_measured_release("b9999-0123456"), nullptr);
  EXPECT_NE(explain_slot_error("This server does not support slots action. Start it with `--slot-save-path`", "/s").find("--slot-save-path /s"),
            std::string::npos);
}

}  // namespace pdb
