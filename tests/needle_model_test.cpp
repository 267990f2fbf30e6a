// The shipped model (models/needle-llama, converted by `make`): it answers the needle natively in
// llama-server (Q4_0) and through the bridge with the decoder's cache mounted, and the bridged state
// agrees with the decoder's own. Small sizes here; docs/RESULTS.md has the full evaluation.
#include <gtest/gtest.h>

#include <random>

#include "arch/backends.h"
#include "cache/assembler.h"
#include "prefill/capture.h"
#include "support/stack.h"
#include "tools/bench_cold.h"
#include "formats/state_diff.h"

namespace pdb {
namespace {

std::string repo_root() { return std::string(PDBRIDGE_TESTS_DIR) + "/.."; }

test::StackOptions needle_stack(const std::string& type) {
  test::StackOptions so;
  so.model_dir = test::build_dir() + "/models/needle";
  so.hf_dir = repo_root() + "/models/needle-llama";
  so.decoder_type = type;
  so.ctx = 16384;
  return so;
}

nlohmann::json chat(const std::string& text) {
  return {{"messages", {{{"role", "user"}, {"content", text}}}}, {"max_tokens", 24}, {"temperature", 0}};
}

std::string answer(const test::HttpReply& r) { return r.json()["choices"][0]["message"]["content"].get<std::string>(); }

}  // namespace

TEST(NeedleModel, AnswersNativelyAndThroughTheBridgeWithTheCacheMounted) {
  test::Stack st(needle_stack("q4_0"));
  std::mt19937_64 g(std::random_device{}());
  for (int i = 0; i < 3; ++i) {
    const uint64_t seed = g() % 1000000007ULL;
    const auto doc = make_needle_document(2500, seed);
    auto body = chat(doc.text);
    auto n = st.post_decoder("/v1/chat/completions", [&] { auto b = body; b["cache_prompt"] = false; return b; }());
    ASSERT_EQ(n.status, 200) << n.body;
    EXPECT_EQ(answer(n), doc.marker) << "native, seed " << seed;
    auto r = st.post_front("/v1/chat/completions", body);
    ASSERT_EQ(r.status, 200) << r.body << st.logs();
    auto v = r.verdict();
    ASSERT_EQ(v.value("verdict", ""), "complete") << v.dump() << st.logs();
    EXPECT_GE(v["cached_tokens"].get<int64_t>(), v["tokens"].get<int64_t>() - 1);
    EXPECT_EQ(answer(r), doc.marker) << "bridged, seed " << seed;
    std::printf("NEEDLE seed %llu marker %s: native %s, bridged %s (%lld tokens, cached %lld)\n", (unsigned long long)seed, doc.marker.c_str(),
                answer(n).c_str(), answer(r).c_str(), (long long)v["tokens"].get<int64_t>(), (long long)v["cached_tokens"].get<int64_t>());
  }
}

// The tokenizer contract the model was trained with (scripts/train/train_needle.py): one token per
// printable ASCII character, U+2581 for space, byte fallback for everything else, no space prefix.
TEST(NeedleModel, LlamaServerTokenizesAsTheTrainingScriptDid) {
  auto so = needle_stack("q4_0");
  so.start_prefill = false;
  test::Stack st(so);
  const std::string text = "def f(x):\n\treturn x  # caf\xc3\xa9 ZEBRA-12-3456.";
  std::vector<int32_t> want;
  for (unsigned char ch : text) {
    if (ch == ' ') want.push_back(259);
    else if (ch >= 0x21 && ch <= 0x7e) want.push_back(260 + (ch - 0x21));
    else want.push_back(3 + ch);
  }
  auto r = st.post_decoder("/tokenize", {{"content", text}, {"add_special", false}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json()["tokens"].get<std::vector<int32_t>>(), want);
}

TEST(NeedleModel, BridgedStateAgreesWithTheDecodersOwn) {
  struct Case { std::string gguf, cache; double min_pct_layer0, min_pct_all; };
  // F16 decoder: the same weights on both sides once the engine multiplies the GGUF's f16 values (bf16
  // values below f16's normal range round); with an f16 cache the whole state is ~99.95% identical, with
  // q8_0 ~81% (one quantization step: that attention path is not mirrored yet). Q4_0 decoder: layer 0 is the decoder's own (the
  // recipe starts from the decoder's quantized embedding rows and multiplies in integers per 32-block as ggml-cpu does:
  // 100% identical since 2026-11-30, 99.94% with the earlier f32 product of dequantized values); deeper layers' inputs come from the bf16
  // checkpoint and differ from the Q4_0 decoder's by quantization noise (the seed's situation, measured
  // 17-23% identical): what matters there is the answer (test above) and the output parity (RESULTS.md).
  for (const Case& c : {Case{"f16", "f16", 99.0, 99.5}, Case{"f16", "q8_0", 99.0, 70.0}, Case{"q4_0", "f16", 99.99, 10.0}, Case{"q4_0", "q4_0", 99.99, 10.0}}) {
    auto so = needle_stack(c.gguf);
    so.parallel = 1;
    so.start_prefill = false;
    so.cache_type = c.cache;
    test::Stack st(so);
    const auto doc = make_needle_document(900, std::random_device{}());
    auto tok = st.post_decoder("/tokenize", {{"content", doc.text}, {"add_special", true}});
    ASSERT_EQ(tok.status, 200) << tok.body;
    std::vector<int32_t> tokens = tok.json()["tokens"].get<std::vector<int32_t>>();
    auto backend = make_cpu_backend(std::make_shared<CpuEngine>(so.hf_dir, 2), std::shared_ptr<const Recipe>(Recipe::load(st.decoder_gguf, 2)));
    auto [native, ours, fid] = test::native_and_bridged_states(st, *backend, tokens, 256);
    auto layer0 = diff_states(native, ours, 1);
    auto all = diff_states(native, ours);
    ASSERT_TRUE(all.same_layout) << all.layout_note;
    std::printf("NEEDLE PARITY HF bf16 -> GGUF %s, cache %s, %zu tokens, decoder class %s (%s): layer0 %.4f%% identical, max ulp %lld | all %zu layers: %.4f%% identical, max ulp %lld, max |d| %.3g\n",
                c.gguf.c_str(), c.cache.c_str(), tokens.size(), to_string(fid.cls), fid.isa.c_str(), layer0.pct_identical(), (long long)layer0.max_ulp(),
                all.tensors.size() / 2, all.pct_identical(), (long long)all.max_ulp(), all.max_abs());
    for (const auto& t : all.tensors) std::printf("  %-12s %.4f%% max ulp %lld rel rms %.3g\n", t.name.c_str(), t.pct_identical(), (long long)t.max_ulp, t.rel_rms());
    ASSERT_NE(fid.cls, FidelityClass::mismatch) << fid.note;
    if (fid.cls == FidelityClass::mirrored) {  // the pinned CPU build on x86 (AVX2 or AVX-512)
      EXPECT_GE(layer0.pct_identical(), c.min_pct_layer0);
      EXPECT_GE(all.pct_identical(), c.min_pct_all);
    } else {  // an ISA whose sums are not mirrored: the guard's layer-0 bounds held (above); the answer test covers the rest
      std::printf("  decoder not mirrored here: asserting the tolerance class only (%s)\n", fid.note.c_str());
    }
    EXPECT_LT(all.max_abs(), 8.0);  // measured up to 3.0 with the Q4_0 decoder
  }
}

}  // namespace pdb
