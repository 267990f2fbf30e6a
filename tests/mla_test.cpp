// deepseek2 with MLA against the real llama-server: the state it saves has one K section per layer
// (kv_lora_rank + rope dims wide) and no V section, and the deepseek2 recipe computes layer 0's rows
// from the decoder's own embedding exactly as the server stored them: the latent normalized, the
// rope part rotated with YaRN (factor 4, log multiplier 0.0707), in f16 and q8_0 caches.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <thread>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "arch/backends.h"
#include "formats/state_file.h"
#include "cache/calibration.h"
#include "model/cpu_engine.h"
#include "prefill/backend.h"
#include "recipes/recipe.h"
#include "support/stack.h"
#include "formats/state_diff.h"

namespace pdb {
using json = nlohmann::json;

struct MlaCase { std::string gguf, cache; };
void PrintTo(const MlaCase& c, std::ostream* os) { *os << c.gguf << "/" << c.cache; }

class Mla : public ::testing::TestWithParam<MlaCase> {};

TEST_P(Mla, Deepseek2Layer0RowsAreTheDecodersOwn) {
  const auto& c = GetParam();
  auto so = test::parity_stack_options(test::models_dir() + "/deepseek2-tiny", c.gguf, c.cache);
  so.start_front = false;
  test::Stack st(so);
  std::mt19937_64 g(5);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 300; ++i) tokens.push_back(int32_t(1000 + g() % 100000));
  auto r = st.post_decoder("/completion", {{"prompt", tokens}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  r = st.post_decoder("/slots/0?action=save", {{"filename", "native.bin"}});
  ASSERT_EQ(r.status, 200) << r.body;
  const ParsedState native = parse_state_file(st.slot_dir + "/native.bin");
  auto recipe = Recipe::load(st.decoder_gguf, 2);
  const auto& info = recipe->info();
  ASSERT_TRUE(info.mla());
  // the layout the fact sheet describes, as the running server wrote it
  EXPECT_FALSE(native.layout.has_v()) << native.layout.describe();
  ASSERT_EQ(native.layout.n_layer(), uint32_t(info.n_layer));
  EXPECT_EQ(native.layout.layers[0].n_embd_k, uint32_t(info.kv_lora_rank + info.rope.n_dims));
  const uint32_t n = native.cell_count;
  ASSERT_GE(n, 299u);
  // layer 0 from the decoder's own embedding rows
  std::vector<float> h(size_t(n) * size_t(info.n_embd));
  recipe->decoder_embedding(native.tokens.data(), n, h.data());
  CacheSpec spec = CacheSpec::decoder_default(native.layout.layers[0].k_type, native.layout.layers[0].k_type, info.head_dim);
  // the decoder's own width (its ISA), learned from its layer 0 as the front door does: an AVX2 decoder on an
  // AVX-512 host sums in 8 lanes, not the host's 16
  const CalibrationResult fid = calibrate_layer0(st.decoder_gguf, native, native.tokens, spec);
  spec.simd_width = fid.simd_width ? fid.simd_width : host_simd_width();
  std::vector<uint8_t> k, v;
  recipe->kv_rows(0, h.data(), n, 0, spec, k, v);
  EXPECT_TRUE(v.empty());
  ASSERT_EQ(k.size(), size_t(native.layout.layers[0].k_row_bytes) * n);
  ParsedState ours = native;
  ours.k_data[0] = k.data();
  const auto d = diff_states(native, ours, 1);
  ASSERT_TRUE(d.same_layout) << d.layout_note;
  ASSERT_EQ(d.tensors.size(), 1u);  // K only
  std::printf("MLA deepseek2-tiny %s cache=%s | layer 0 K (%u x %u): %.4f%% identical, max ulp %lld, rel rms %.3g\n", c.gguf.c_str(),
              c.cache.c_str(), n, native.layout.layers[0].n_embd_k, d.tensors[0].pct_identical(), (long long)d.tensors[0].max_ulp,
              d.tensors[0].rel_rms());
  // f32/f16 weights: the mirrored class, bit for bit, at the width the calibration found
  EXPECT_EQ(to_string(fid.cls), std::string("mirrored")) << fid.note;
  EXPECT_EQ(d.tensors[0].pct_identical(), 100.0) << fid.note;
  // a wrong layout loads silently in llama.cpp: the rows do depend on the position (RoPE is applied)
  std::vector<uint8_t> k1, v1;
  recipe->kv_rows(0, h.data() + info.n_embd, 1, 0, spec, k1, v1);  // token 1 at position 0
  EXPECT_NE(0, std::memcmp(k1.data(), k.data() + native.layout.layers[0].k_row_bytes, k1.size())) << "position did not change the row";
}

// `pdbridge convert` on the HF checkpoints make-model wrote gives the same GGUF bytes: the converter's
// expert stacking, F32 router, kv_b_proj split and MLA keys are those the decoder loaded above.
TEST(Convert, MoeAndMlaCheckpointsConvertToTheGgufsTheDecoderLoads) {
  for (const auto& [model, name] : std::vector<std::pair<std::string, std::string>>{{"qwen3moe-tiny", "pdbridge-qwen3moe-tiny-seed3"},
                                                                                   {"deepseek2-tiny", "pdbridge-deepseek2-tiny-seed4"}}) {
    const std::string src = test::models_dir() + "/" + model, out = test::temp_dir("convert");
    test::Child c({test::pdbridge_bin(), "convert", "--hf", src + "/hf", "--out", out, "--types", "f32,f16", "--name", name, "--threads", "2"},
                  out + "/convert.log");
    ASSERT_EQ(c.stop(0, 300), 0) << c.log();
    for (const std::string t : {"f32", "f16"}) {
      std::ifstream a(out + "/decoder-" + t + ".gguf", std::ios::binary), b(src + "/decoder-" + t + ".gguf", std::ios::binary);
      const std::string x{std::istreambuf_iterator<char>(a), {}}, y{std::istreambuf_iterator<char>(b), {}};
      EXPECT_GT(x.size(), 1000u);
      EXPECT_TRUE(x == y) << model << " " << t << ": the converted GGUF differs from make-model's";
    }
  }
}

// The whole bridged state (the CPU engine's MLA forward + the recipe, through the wire frames and the
// assembler) against the decoder's own: layer 0 bit-identical; the deeper layers within the tolerance
// bound, because the engine's MLA arithmetic is the decoder's formulas, not yet its summation order.
TEST_P(Mla, BridgedStateMatchesTheDecodersOwn) {
  const auto& c = GetParam();
  const std::string mdir = test::models_dir() + "/deepseek2-tiny";
  auto so = test::parity_stack_options(mdir, c.gguf, c.cache);
  test::Stack st(so);
  std::mt19937_64 g(11);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 500; ++i) tokens.push_back(int32_t(1000 + g() % 100000));
  auto backend = make_cpu_backend(std::make_shared<CpuEngine>(mdir + "/hf", 2), std::shared_ptr<const Recipe>(Recipe::load(st.decoder_gguf, 2)));
  auto [native, ours, fid] = test::native_and_bridged_states(st, *backend, tokens, 128);
  auto layer0 = diff_states(native, ours, 1);
  auto all = diff_states(native, ours);
  ASSERT_TRUE(all.same_layout) << all.layout_note;
  std::printf("MLA PARITY deepseek2-tiny %s cache=%s class=%s isa=%s | layer0 %.4f%% identical | all %zu sections: %.4f%% identical, max |d| %.3g\n",
              c.gguf.c_str(), c.cache.c_str(), to_string(fid.cls), fid.isa.c_str(), layer0.pct_identical(), all.tensors.size(), all.pct_identical(),
              all.max_abs());
  for (const auto& t : all.tensors) std::printf("  %-12s %.4f%% rel rms %.3g\n", t.name.c_str(), t.pct_identical(), t.rel_rms());
  ASSERT_EQ(all.tensors.size(), 2u);  // two layers, K sections only
  EXPECT_EQ(fid.cls, FidelityClass::mirrored) << fid.note;
  EXPECT_EQ(layer0.pct_identical(), 100.0);
  for (const auto& t : all.tensors) EXPECT_LE(t.rel_rms(), 0.02) << t.name;
}

// The front door beside a deepseek2 decoder: its startup calibration classes the decoder on the K-only
// state (the pinned build: mirrored), and with no prefill engine for MLA yet a request is declined
// and served natively, with the reason in the verdict.
TEST(MlaFront, CalibratesOnTheKOnlyStateAndServesNativelyWithoutAnEngine) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/deepseek2-tiny";
  so.start_prefill = false;
  test::Stack st(so);
  httplib::Client c("127.0.0.1", st.front_port);
  json h;
  for (int i = 0; i < 600 && !(h.is_object() && h["fidelity"].is_object() && h["fidelity"].contains("class")); ++i) {
    if (auto r = c.Get("/health"); r && r->status == 200) h = json::parse(r->body);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(h["fidelity"].is_object()) << h.dump() << st.logs();
  std::printf("MLA front fidelity: %s\n", h["fidelity"].dump().c_str());
  EXPECT_EQ(h["fidelity"].value("class", ""), "mirrored") << h.dump();
  const std::string prompt = test::random_text(77, 700);
  auto r = st.post_front("/completion", {{"prompt", prompt}, {"n_predict", 8}, {"temperature", 0}});
  ASSERT_EQ(r.status, 200) << r.body << st.logs();
  const auto v = r.verdict();
  EXPECT_EQ(v.value("verdict", "").rfind("declined: ", 0), 0u) << v.dump();
  EXPECT_EQ(v["bridged_tokens"].get<int64_t>(), 0);
  EXPECT_FALSE(r.json().value("content", "").empty());
}

INSTANTIATE_TEST_SUITE_P(Caches, Mla, ::testing::Values(MlaCase{"f32", "f16"}, MlaCase{"f32", "q8_0"}, MlaCase{"f16", "f16"}),
                         [](const auto& info) { return info.param.gguf + "_" + info.param.cache; });

}  // namespace pdb
