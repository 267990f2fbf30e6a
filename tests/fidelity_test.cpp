// The fidelity guard on real llama-server decoders: it classes the pinned CPU build as mirrored at
// the ISA it runs on, an OpenBLAS build (sums the recipe does not mirror, as a Metal or CUDA decoder's)
// as within tolerance and bridges onto it, and still declines every geometry mismatch — a RoPE base,
// linear or YaRN scaling override, another model of the same shape — whatever the cache type.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "cache/calibration.h"
#include "recipes/recipe.h"
#include "support/stack.h"

namespace pdb {
using json = nlohmann::json;

namespace {

std::string tiny() { return test::models_dir() + "/llama-tiny"; }

// The front door's /health once its startup calibration has ended (either way).
json calibrated_health(test::Stack& st) {
  httplib::Client c("127.0.0.1", st.front_port);
  json h;
  for (int i = 0; i < 600; ++i) {
    auto r = c.Get("/health");
    if (r && r->status == 200) {
      h = json::parse(r->body);
      if (h["fidelity"].is_object() && h["fidelity"].contains("class")) return h;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ADD_FAILURE() << "no fidelity report in /health: " << h.dump() << st.logs();
  return h;
}

json completion(const std::string& prompt) { return {{"prompt", prompt}, {"n_predict", 4}, {"temperature", 0}}; }

void print_fidelity(const std::string& what, const json& f) {
  const json k = f.value("layer0_k", json::object()), v = f.value("layer0_v", json::object());
  std::printf("FIDELITY %-44s class %-9s isa %-12s K: %.3f%% identical, rel RMS %.3g, max %.3g RMS, %.2f%% within 4 ulp | V: %.3f%% identical, rel RMS %.3g, max %.3g RMS, %.2f%% within 4 ulp\n",
              what.c_str(), f.value("class", "?").c_str(), f.value("decoder_isa", "?").c_str(), k.value("pct_identical", -1.0),
              k.value("rel_rms", -1.0), k.value("max_rel", -1.0), k.value("pct_within_4_ulp", -1.0), v.value("pct_identical", -1.0),
              v.value("rel_rms", -1.0), v.value("max_rel", -1.0), v.value("pct_within_4_ulp", -1.0));
}

}  // namespace

// The pinned CPU build is mirrored, and the ISA the probe finds is the one this host runs it on.
TEST(Fidelity, PinnedCpuDecoderIsMirroredAtTheIsaItRunsOn) {
  for (const std::string gguf : {"f32", "q4_0"}) {
    test::StackOptions so;
    so.model_dir = tiny();
    so.decoder_type = gguf;
    so.decoder_bin = test::build_dir() + "/llama/bin/llama-server";  // the pinned build, whatever PDBRIDGE_LLAMA_SERVER says
    test::Stack st(so);
    const json h = calibrated_health(st);
    const json f = h["fidelity"];
    print_fidelity("pinned build, GGUF " + gguf + ", f16 cache", f);
    EXPECT_EQ(f.value("class", ""), "mirrored") << f.dump();
    EXPECT_EQ(f.value("decoder_isa", ""), isa_name(host_simd_width())) << f.dump();
    if (gguf == "f32") EXPECT_NE(f.value("isa_source", "").find("probe"), std::string::npos) << f.dump();
    else EXPECT_NE(f.value("isa_source", "").find("quantized"), std::string::npos) << f.dump();
    auto r = st.post_front("/completion", completion(test::random_text(31, 600)));
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.verdict().value("verdict", ""), "complete") << r.verdict().dump() << st.logs();
    EXPECT_EQ(r.verdict()["fidelity"].value("class", ""), "mirrored") << r.verdict().dump();
  }
}

// Every geometry mismatch stays far outside the summation-order bounds, in every cache type.
TEST(Fidelity, GeometryMismatchesAreDeclinedInEveryCacheType) {
  struct Case { std::string what, cache; std::vector<std::string> decoder_flags; };
  const std::string other = test::models_dir() + "/llama-tiny-other/decoder-f32.gguf";
  const std::vector<Case> cases = {
      {"--rope-freq-base 250000", "f16", {"--rope-freq-base", "250000"}},
      {"--rope-freq-base 250000", "q8_0", {"--rope-freq-base", "250000"}},
      {"--rope-freq-base 250000", "q4_0", {"--rope-freq-base", "250000"}},
      {"--rope-scaling linear --rope-scale 2", "f16", {"--rope-scaling", "linear", "--rope-scale", "2"}},
      {"--rope-scaling yarn --rope-scale 2", "f16", {"--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", "4096"}},
      {"--rope-scaling yarn --rope-scale 2", "q8_0", {"--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", "4096"}},
      {"--rope-scaling yarn --rope-scale 2", "q4_0", {"--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", "4096"}},
      {"another model of the same shape (seed 9)", "f16", {"-m", other}},
      {"another model of the same shape (seed 9)", "q4_0", {"-m", other}},
  };
  for (const auto& c : cases) {
    test::StackOptions so;
    so.model_dir = tiny();
    so.cache_type = c.cache;
    so.decoder_extra = c.decoder_flags;
    so.start_prefill = false;
    test::Stack st(so);
    const json h = calibrated_health(st);
    print_fidelity(c.what + ", " + c.cache + " cache", h["fidelity"]);
    EXPECT_EQ(h["fidelity"].value("class", ""), "mismatch") << c.what << " " << c.cache << ": " << h.dump();
    auto r = st.post_front("/completion", completion(test::random_text(32, 600)));
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_NE(r.verdict().value("verdict", "").find("calibration"), std::string::npos) << c.what << ": " << r.verdict().dump();
    EXPECT_EQ(r.verdict()["fidelity"].value("class", ""), "mismatch") << r.verdict().dump();
    EXPECT_LT(r.json()["timings"]["cache_n"].get<int64_t>(), 10) << "a cache was mounted on a mismatched decoder";
  }
}

// The tolerance class does not loosen the guard: a RoPE override on the OpenBLAS decoder is still declined.
TEST(Fidelity, OpenBlasDecoderStillDeclinesARopeOverride) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.decoder_extra = {"--rope-freq-base", "250000"};
  so.start_prefill = false;
  so.decoder_bin = test::blas_llama_server();
  test::Stack st(so);
  const json h = calibrated_health(st);
  print_fidelity("OpenBLAS build, --rope-freq-base 250000, f16 cache", h["fidelity"]);
  EXPECT_EQ(h["fidelity"].value("class", ""), "mismatch") << h.dump();
  auto r = st.post_front("/completion", completion(test::random_text(34, 600)));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.verdict().value("verdict", "").find("calibration"), std::string::npos) << r.verdict().dump();
  EXPECT_LT(r.json()["timings"]["cache_n"].get<int64_t>(), 10) << "a cache was mounted on a mismatched decoder";
}

// A decoder whose arithmetic the recipe does not mirror (OpenBLAS prompt matmuls) is within
// tolerance and gets bridges: complete, cache_n = T-1, the class in the verdict.
TEST(Fidelity, OpenBlasDecoderBridgesInTheToleranceClass) {
  for (const std::string cache : {"f16", "q8_0"}) {
    test::StackOptions so;
    so.model_dir = tiny();
    so.cache_type = cache;
    so.decoder_bin = test::blas_llama_server();
    test::Stack st(so);
    const json h = calibrated_health(st);
    print_fidelity("OpenBLAS build, GGUF f32, " + cache + " cache", h["fidelity"]);
    EXPECT_EQ(h["fidelity"].value("class", ""), "tolerance") << h.dump();
    EXPECT_EQ(h["fidelity"].value("decoder_isa", ""), "not mirrored") << h.dump();
    auto r = st.post_front("/completion", completion(test::random_text(33, 700)));
    ASSERT_EQ(r.status, 200) << r.body;
    const json v = r.verdict();
    EXPECT_EQ(v.value("verdict", ""), "complete") << v.dump() << st.logs();
    EXPECT_EQ(v["fidelity"].value("class", ""), "tolerance") << v.dump();
    EXPECT_EQ(r.json()["timings"]["cache_n"].get<int64_t>(), v["tokens"].get<int64_t>() - 1) << r.body;
  }
}

}  // namespace pdb
