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
#include <cmath>
#include <chrono>
#include <cstring>
#include <thread>
#include <random>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "arch/backends.h"
#include "formats/ggml_types.h"
#include "formats/gguf.h"
#include "formats/hf_deepseek4.h"
#include "formats/state_file_dsv4.h"
#include "prefill/server.h"
#include "cache/assembler.h"
#include "prefill/backend.h"
#include "prefill/capture.h"
#include "model/cpu_engine_dsv4.h"
#include "recipes/deepseek4.h"
#include "recipes/recipe.h"
#include "tools/make_model.h"
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

// llama-server alone (no prefill server, no front door), one slot: the tests talk to its slots directly.
test::StackOptions decoder_only(const std::string& model_dir, const std::string& cache) {
  test::StackOptions so;
  so.model_dir = model_dir;
  so.cache_type = cache;
  so.parallel = 1;
  so.ctx = 4096;
  so.start_prefill = false;
  so.start_front = false;
  return so;
}

std::vector<uint8_t> read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// One section: the file's rows (type t) against the recipe's f32 rows, both as f32 values.
struct Compare { double rel_rms = 0, identical = 0; size_t n = 0; };
Compare compare(const std::vector<uint8_t>& file, const Dsv4Block& blk, const std::vector<float>& want) {
  Compare c;
  const auto t = GgmlType(blk.type);
  const int64_t ne0 = int64_t(t == GgmlType::F32 ? blk.row_bytes / 4 : (blk.ne0 ? blk.ne0 : int64_t(want.size() / std::max<uint64_t>(blk.rows, 1))));
  std::vector<float> got(size_t(blk.rows * uint64_t(ne0)));
  for (uint64_t r = 0; r < blk.rows; ++r) dequantize_row(t, file.data() + blk.offset + r * blk.row_bytes, got.data() + r * uint64_t(ne0), ne0);
  EXPECT_EQ(got.size(), want.size());
  // what the recipe's rows become in the decoder's type, then back: the comparison is of stored values
  std::vector<float> w2(want.size());
  if (t == GgmlType::F32) {
    w2 = want;
  } else {
    std::vector<uint8_t> enc(ggml_row_bytes(t, ne0) * blk.rows);
    rows_to_cache_type(t, want.data(), int64_t(blk.rows), ne0, enc.data());
    for (uint64_t r = 0; r < blk.rows; ++r) dequantize_row(t, enc.data() + r * ggml_row_bytes(t, ne0), w2.data() + r * uint64_t(ne0), ne0);
  }
  double num = 0, den = 0;
  size_t same = 0;
  for (size_t i = 0; i < std::min(got.size(), w2.size()); ++i) {
    num += (double(got[i]) - w2[i]) * (double(got[i]) - w2[i]);
    den += double(got[i]) * got[i];
    same += got[i] == w2[i];
  }
  c.n = got.size();
  c.rel_rms = den > 0 ? std::sqrt(num / den) : (num > 0 ? 1.0 : 0.0);
  c.identical = c.n ? 100.0 * double(same) / double(c.n) : 100.0;
  return c;
}


// The decoder's own state of a short prompt on slot 0: the layout the bridge writes its files in.
Dsv4State probe_like(test::Stack& st) {
  if (st.post_decoder("/completion", {{"prompt", tokens_of(1, 40)}, {"n_predict", 0}, {"id_slot", 0}}).status != 200 ||
      st.post_decoder("/slots/0?action=save", {{"filename", "probe.bin"}}).status != 200)
    throw std::runtime_error("the decoder's probe failed");
  return parse_dsv4_state_file(st.slot_dir + "/probe.bin");
}

// The state of `tokens` the engine and recipe make over the whole prompt in process, laid out as `like`.
std::vector<uint8_t> one_piece_state(const Deepseek4Recipe& recipe, const Deepseek4CpuEngine& engine, const Dsv4State& like,
                                     const std::vector<int32_t>& tokens, GgmlType kt) {
  std::vector<Dsv4LayerBytes> layers;
  engine.forward(tokens, kt, [&](int l, const float* x, int64_t n) { layers.push_back(recipe.to_bytes(recipe.sections(l, x, n, kt), kt)); });
  return write_dsv4_state(like, tokens, uint32_t(recipe.config().window), layers);
}

// Every section of two states of the same tokens, as values: the worst relative RMS difference (b the
// reference); each above `bound` fails the calling test.
double worst_section_rel_rms(const Dsv4State& a_st, const Dsv4State& b_st, int64_t head_dim, double bound) {
  const auto sa = a_st.sections(), sn = b_st.sections();
  EXPECT_EQ(sa.size(), sn.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(sa.size(), sn.size()); ++i) {
    EXPECT_EQ(sa[i].kind, sn[i].kind);
    EXPECT_EQ(sa[i].layer, sn[i].layer);
    if (sa[i].block.bytes() != sn[i].block.bytes()) { ADD_FAILURE() << to_string(sa[i].kind) << " layer " << sa[i].layer << ": sizes differ"; continue; }
    const auto t = GgmlType(sn[i].block.type);
    const int64_t ne0 = t == GgmlType::F32 ? int64_t(sn[i].block.row_bytes / 4) : int64_t(sn[i].block.ne0 ? sn[i].block.ne0 : uint64_t(head_dim));
    std::vector<float> a(size_t(sn[i].block.rows * uint64_t(ne0))), b(a.size());
    for (uint64_t rr = 0; rr < sn[i].block.rows; ++rr) {
      dequantize_row(t, a_st.storage.data() + sa[i].block.offset + rr * sa[i].block.row_bytes, a.data() + rr * uint64_t(ne0), ne0);
      dequantize_row(t, b_st.storage.data() + sn[i].block.offset + rr * sn[i].block.row_bytes, b.data() + rr * uint64_t(ne0), ne0);
    }
    double num = 0, den = 0;
    for (size_t j = 0; j < a.size(); ++j) { num += (double(a[j]) - b[j]) * (double(a[j]) - b[j]); den += double(b[j]) * b[j]; }
    const double rel = den > 0 ? std::sqrt(num / den) : 0.0;
    if (rel > worst) {
      worst = rel;
      std::printf("  worst so far: layer %u %s rel RMS %.2e\n", sa[i].layer, to_string(sa[i].kind), rel);
    }
    EXPECT_LT(rel, bound) << to_string(sa[i].kind) << " layer " << sa[i].layer;
  }
  return worst;
}

}  // namespace

// Layer 0 from the decoder's own embedding: every section the recipe makes against the server's file
// (tolerance class: plain f32 sums and expf, not the decoder's SIMD order), and a recipe made from another
// model's weights, which no bound may accept.
TEST(Deepseek4State, RecipeLayer0SectionsMatchTheDecodersOwn) {
  for (const std::string preset : {"tiny", "tiny-hca"}) {
    const std::string model = "deepseek4-" + preset;
    MakeModelOptions other;  // the same shapes and ratios, other weights
    other.arch = "deepseek4"; other.preset = preset; other.seed = 77; other.out = test::temp_dir("deepseek4-other");
    other.vocab_dir = test::llama_src() + "/models";
    make_model(other);
    for (const std::string cache : {"f16", "q8_0"}) {
      test::Stack st(decoder_only(test::models_dir() + "/" + model, cache));
      const int T = 300;
      const auto toks = tokens_of(5, T);
      auto r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", false}});
      ASSERT_EQ(r.status, 200) << r.body;
      ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "s.bin"}}).status, 200);
      const Dsv4State s = parse_dsv4_state_file(st.slot_dir + "/s.bin");
      const GgmlType kt = cache == "f16" ? GgmlType::F16 : GgmlType::Q8_0;
      for (const std::string& recipe_gguf : {std::string(st.decoder_gguf), other.out + "/decoder-f32.gguf"}) {
        const bool own = recipe_gguf == st.decoder_gguf;
        Deepseek4Recipe recipe(recipe_gguf);
        const auto x = recipe.layer0_input(toks);
        const auto sec = recipe.sections(0, x.data(), T, kt);
        std::vector<std::pair<std::string, Compare>> rows;
        for (const auto& stm : s.swa.streams)
          if (stm.cell_count) rows.push_back({"window", compare(s.storage, [&] { auto b = stm.layers[0]; b.ne0 = uint64_t(recipe.config().head_dim); return b; }(), sec.window)});
        auto first = [](const std::vector<uint32_t>& ids, const std::vector<Dsv4Block>& b) -> const Dsv4Block& {
          if (ids.empty() || ids[0] != 0) throw std::runtime_error("the decoder's state has no layer-0 section of this kind");
          return b[0];
        };
        if (sec.ratio == 4) {
          rows.push_back({"csa", compare(s.storage, first(s.csa.layer_ids, s.csa.layers), sec.pool)});
          rows.push_back({"lid", compare(s.storage, first(s.lid.layer_ids, s.lid.layers), sec.lid)});
          rows.push_back({"csa-kv-ring", compare(s.storage, first(s.csa_ring.layer_ids, s.csa_ring.kv), sec.ring_kv)});
          rows.push_back({"csa-score-ring", compare(s.storage, first(s.csa_ring.layer_ids, s.csa_ring.score), sec.ring_score)});
          rows.push_back({"lid-kv-ring", compare(s.storage, first(s.lid_ring.layer_ids, s.lid_ring.kv), sec.lid_kv)});
          rows.push_back({"lid-score-ring", compare(s.storage, first(s.lid_ring.layer_ids, s.lid_ring.score), sec.lid_score)});
        } else {
          ASSERT_EQ(sec.ratio, 128);
          rows.push_back({"hca", compare(s.storage, first(s.hca.layer_ids, s.hca.layers), sec.pool)});
          rows.push_back({"hca-kv-ring", compare(s.storage, first(s.hca_ring.layer_ids, s.hca_ring.kv), sec.ring_kv)});
          rows.push_back({"hca-score-ring", compare(s.storage, first(s.hca_ring.layer_ids, s.hca_ring.score), sec.ring_score)});
        }
        for (const auto& [name, c] : rows) {
          std::printf("DSV4 RECIPE %s cache=%s %s layer 0 %-15s %6zu values: %8.4f%% identical, rel RMS %.2e\n", model.c_str(), cache.c_str(),
                      own ? "own   " : "OTHER ", name.c_str(), c.n, c.identical, c.rel_rms);
          if (own) EXPECT_LT(c.rel_rms, cache == "f16" ? 2e-3 : 3e-2) << name;
          else EXPECT_GT(c.rel_rms, 0.2) << name << ": another model's weights must not pass";
        }
      }
    }
  }
}

// Every layer: the CPU engine's forward gives each layer's residual streams, the recipe each layer's
// sections, against the decoder's own state. Deeper layers carry the engine's differences from the decoder
// (plain f32 sums, the SIMD expf, the fused hyper-connection ops): the tolerance class.
TEST(Deepseek4State, EngineAndRecipeGiveEveryLayersSectionsWithinTheToleranceClass) {
  for (const std::string cache : {"f16", "q8_0"}) {
    test::Stack st(decoder_only(test::models_dir() + "/deepseek4-tiny", cache));
    const int T = 300;
    const auto toks = tokens_of(6, T);
    auto r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", false}});
    ASSERT_EQ(r.status, 200) << r.body;
    ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "s.bin"}}).status, 200);
    const Dsv4State s = parse_dsv4_state_file(st.slot_dir + "/s.bin");
    const GgmlType kt = cache == "f16" ? GgmlType::F16 : GgmlType::Q8_0;
    Deepseek4Recipe recipe(st.decoder_gguf);
    Deepseek4CpuEngine engine(recipe);
    const int64_t D = recipe.config().head_dim;
    auto find = [](const std::vector<uint32_t>& ids, const std::vector<Dsv4Block>& b, int l) -> const Dsv4Block* {
      for (size_t i = 0; i < ids.size(); ++i)
        if (ids[i] == uint32_t(l)) return &b[i];
      return nullptr;
    };
    double worst = 0;
    engine.forward(toks, kt, [&](int l, const float* x, int64_t n) {
      const auto sec = recipe.sections(l, x, n, kt);
      std::vector<std::pair<std::string, Compare>> rows;
      for (const auto& stm : s.swa.streams)
        if (stm.cell_count) {
          auto b = stm.layers[size_t(l)];
          b.ne0 = uint64_t(D);
          rows.push_back({"window", compare(s.storage, b, sec.window)});
        }
      if (const auto* b = find(s.csa.layer_ids, s.csa.layers, l)) rows.push_back({"csa", compare(s.storage, *b, sec.pool)});
      if (const auto* b = find(s.hca.layer_ids, s.hca.layers, l)) rows.push_back({"hca", compare(s.storage, *b, sec.pool)});
      if (const auto* b = find(s.lid.layer_ids, s.lid.layers, l)) rows.push_back({"lid", compare(s.storage, *b, sec.lid)});
      if (const auto* b = find(s.csa_ring.layer_ids, s.csa_ring.kv, l)) rows.push_back({"csa-kv-ring", compare(s.storage, *b, sec.ring_kv)});
      if (const auto* b = find(s.hca_ring.layer_ids, s.hca_ring.kv, l)) rows.push_back({"hca-kv-ring", compare(s.storage, *b, sec.ring_kv)});
      if (const auto* b = find(s.lid_ring.layer_ids, s.lid_ring.score, l)) rows.push_back({"lid-score-ring", compare(s.storage, *b, sec.lid_score)});
      for (const auto& [name, c] : rows) {
        std::printf("DSV4 ENGINE+RECIPE cache=%s layer %d %-15s %6zu values: %8.4f%% identical, rel RMS %.2e\n", cache.c_str(), l, name.c_str(), c.n,
                    c.identical, c.rel_rms);
        worst = std::max(worst, c.rel_rms);
        // Tolerance class: the rows of most tokens agree to ~1e-4, but a near-tie in a discrete choice (an
        // expert of the biased top-k routing, a row of the indexer's top-k) can go the other way for a token, whose
        // rows then differ by O(1) from that layer on (measured, 2026-12-02, AVX-512: f16 <= 1.4e-2 with 90.6%
        // of layer 3's values identical; q8_0 <= 7.1e-3, the decoder's flash attention quantizing the query too).
        EXPECT_LT(c.rel_rms, 6e-2) << "layer " << l << " " << name;
      }
    });
    std::printf("DSV4 ENGINE+RECIPE cache=%s: worst rel RMS %.2e over every layer and section\n", cache.c_str(), worst);
  }
}

// The bridge for DeepSeek-V4 without the wire: the engine and the recipe make every section of the first
// T-1 tokens, `write_dsv4_state` lays them out as the decoder's own probe file, llama-server restores it and
// computes only the last token (cache_n = T-1, prompt_n = 1), and the state it then holds matches the one it
// makes natively for the T tokens, section by section.
TEST(Deepseek4State, BridgedStateFromTheEngineRestoresAndTheDecoderContinuesAsNatively) {
  for (const std::string cache : {"f16", "q8_0"}) {
    test::Stack st(decoder_only(test::models_dir() + "/deepseek4-tiny", cache));
    const GgmlType kt = cache == "f16" ? GgmlType::F16 : GgmlType::Q8_0;
    // the layout, learned from a short prompt of the decoder's own
    const Dsv4State like = probe_like(st);
    const int T = 517;  // T-1 = 516: 129 CSA rows, 4 HCA rows, the window full; the last token completes a 4-block
    const auto toks = tokens_of(42, T);
    const std::vector<int32_t> head(toks.begin(), toks.end() - 1);
    Deepseek4Recipe recipe(st.decoder_gguf);
    Deepseek4CpuEngine engine(recipe);
    std::vector<Dsv4LayerBytes> layers;
    engine.forward(head, kt, [&](int l, const float* x, int64_t n) { layers.push_back(recipe.to_bytes(recipe.sections(l, x, n, kt), kt)); });
    const auto bytes = write_dsv4_state(like, head, uint32_t(recipe.config().window), layers);
    {
      std::ofstream f(st.slot_dir + "/bridged.bin", std::ios::binary);
      f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    }
    ASSERT_EQ(st.post_decoder("/slots/0?action=erase", json::object()).status, 200);
    auto r = st.post_decoder("/slots/0?action=restore", {{"filename", "bridged.bin"}});
    ASSERT_EQ(r.status, 200) << r.body;
    r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}});
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.json()["timings"]["cache_n"].get<int64_t>(), T - 1) << r.json()["timings"].dump();
    EXPECT_EQ(r.json()["timings"]["prompt_n"].get<int64_t>(), 1) << r.json()["timings"].dump();
    ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "after.bin"}}).status, 200);
    ASSERT_EQ(st.post_decoder("/slots/0?action=erase", json::object()).status, 200);
    r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", false}});
    ASSERT_EQ(r.status, 200) << r.body;
    ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "native.bin"}}).status, 200);
    const Dsv4State after = parse_dsv4_state_file(st.slot_dir + "/after.bin"), native = parse_dsv4_state_file(st.slot_dir + "/native.bin");
    ASSERT_EQ(after.cells(), uint32_t(T));
    ASSERT_EQ(native.cells(), uint32_t(T));
    const double worst = worst_section_rel_rms(after, native, recipe.config().head_dim, cache == "f16" ? 2e-3 : 6e-2);
    std::printf("DSV4 BRIDGED cache=%s: %zu bytes written for %d tokens, restored: cache_n %d; after the last token, %zu sections vs native: worst rel RMS %.2e\n",
                cache.c_str(), bytes.size(), T - 1, T - 1, after.sections().size(), worst);
  }
}

// Chunked == one-shot: the recipe fed in chunks that cut the 4- and 128-token blocks anywhere (the carries
// hold the compressors' last tokens) gives every row and ring bit for bit as over the whole prompt.
TEST(Deepseek4Recipe, ChunkedSectionsEqualOneShotForEveryChunkSize) {
  Deepseek4Recipe recipe(test::models_dir() + "/deepseek4-tiny/decoder-f32.gguf");
  Deepseek4CpuEngine engine(recipe);
  const int64_t T = 300, E = recipe.config().hidden;
  const auto toks = tokens_of(8, int(T));
  std::vector<std::vector<float>> xs;
  engine.forward(toks, GgmlType::F16, [&](int, const float* x, int64_t n) { xs.emplace_back(x, x + n * 4 * E); });
  for (const GgmlType kt : {GgmlType::F16, GgmlType::Q8_0})
    for (int l = 0; l < int(xs.size()); ++l) {
      const auto whole = recipe.sections(l, xs[size_t(l)].data(), T, kt);
      for (const int64_t chunk : {1, 3, 5, 64, 127, 129, 300}) {
        Deepseek4Carry carry;
        Deepseek4LayerSections cat;
        for (int64_t p0 = 0; p0 < T; p0 += chunk) {
          const int64_t n = std::min(chunk, T - p0);
          auto part = recipe.sections_chunk(l, xs[size_t(l)].data() + p0 * 4 * E, p0, n, T, kt, carry);
          if (!part.window.empty() && cat.window.empty()) cat.window_first = part.window_first;
          cat.window.insert(cat.window.end(), part.window.begin(), part.window.end());
          cat.pool.insert(cat.pool.end(), part.pool.begin(), part.pool.end());
          cat.lid.insert(cat.lid.end(), part.lid.begin(), part.lid.end());
          if (p0 + n == T) { cat.ring_kv = part.ring_kv; cat.ring_score = part.ring_score; cat.lid_kv = part.lid_kv; cat.lid_score = part.lid_score; }
        }
        EXPECT_EQ(cat.window_first, whole.window_first) << "layer " << l << " chunk " << chunk;
        EXPECT_EQ(cat.window, whole.window) << "layer " << l << " chunk " << chunk;
        EXPECT_EQ(cat.pool, whole.pool) << "layer " << l << " chunk " << chunk;
        EXPECT_EQ(cat.lid, whole.lid) << "layer " << l << " chunk " << chunk;
        EXPECT_EQ(cat.ring_kv, whole.ring_kv) << "layer " << l << " chunk " << chunk;
        EXPECT_EQ(cat.ring_score, whole.ring_score) << "layer " << l << " chunk " << chunk;
        EXPECT_EQ(cat.lid_kv, whole.lid_kv) << "layer " << l << " chunk " << chunk;
        EXPECT_EQ(cat.lid_score, whole.lid_score) << "layer " << l << " chunk " << chunk;
      }
    }
  // out of order is refused, not silently wrong
  Deepseek4Carry carry;
  EXPECT_THROW(recipe.sections_chunk(0, xs[0].data() + 8 * 4 * E, 8, 8, T, GgmlType::F16, carry), std::invalid_argument);
}

// DeepSeek-V4 bridged end to end over real HTTP: the front door learns the decoder's pooled layout from a probe
// and calibrates its layer 0, the prefill server's CPU engine (on the HF checkpoint) and recipe (on the decoder
// GGUF) stream every section, the front door
// writes the T-1 file and llama-server restores it and computes the last token only; the answer equals the
// decoder's native one (greedy, F32 weights on both sides), with f16 and q8_0 caches.
TEST(Deepseek4Bridge, CompleteThroughPrefillServerAndFrontDoorAnswersAsNative) {
  for (const std::string cache : {"f16", "q8_0"}) {
    test::StackOptions so = decoder_only(test::models_dir() + "/deepseek4-tiny", cache);
    so.start_prefill = true;
    so.start_front = true;
    test::Stack st(so);
    // T-1 = 640 ends on the edge of a 4- and a 128-block, 899 inside both
    for (const int T_want : {641, 900}) {
      const json prompt = tokens_of(915 + uint64_t(T_want), T_want);
      // one token per request: a random model's multi-token text can hold broken UTF-8, which llama-server's
      // content parser answers with a 500; after the bridged first step the slot is warm (served natively from
      // the bridged state), the native side recomputes everything (cache_prompt false) every step
      const json prompt_tokens = prompt;
      json first = {{"prompt", prompt}, {"n_predict", 1}, {"temperature", 0}, {"return_tokens", true}};
      auto r = st.post_front("/completion", first);
      ASSERT_EQ(r.status, 200) << r.body << st.logs();
      const json v = r.verdict();
      const int64_t T = v["tokens"].get<int64_t>();
      ASSERT_EQ(int64_t(prompt_tokens.size()), T);
      EXPECT_EQ(v["verdict"], "complete") << v.dump() << st.logs();
      EXPECT_EQ(v["bridged_tokens"].get<int64_t>(), T - 1) << v.dump();
      EXPECT_EQ(r.json()["timings"]["cache_n"].get<int64_t>(), T - 1) << r.json()["timings"].dump();
      EXPECT_EQ(r.json()["timings"]["prompt_n"].get<int64_t>(), 1) << r.json()["timings"].dump();
      EXPECT_GT(v["bytes"].get<int64_t>(), 0);
      ASSERT_TRUE(v.contains("fidelity")) << v.dump();
      // the recipe's plain f32 sums are not the decoder's SIMD order: never bit-identical (the rings are f32)
      EXPECT_EQ(v["fidelity"]["class"], "tolerance") << v.dump();
      auto greedy = [&](bool through_front, json toks, int64_t first_id) {
        std::vector<int64_t> ids;
        if (first_id >= 0) { ids.push_back(first_id); toks.push_back(first_id); }
        while (ids.size() < 12) {
          json b = {{"prompt", toks}, {"n_predict", 1}, {"temperature", 0}, {"return_tokens", true}, {"cache_prompt", through_front}};
          auto x = through_front ? st.post_front("/completion", b) : st.post_decoder("/completion", b);
          if (x.status != 200) { ADD_FAILURE() << x.body; break; }
          if (through_front) {
            EXPECT_EQ(x.verdict()["verdict"], "native: warm") << x.verdict().dump();
          }
          const json out = x.json().value("tokens", json::array());  // the id even where its bytes are not whole UTF-8 yet
          if (out.size() != 1) { ADD_FAILURE() << "no token in " << x.body; break; }
          const int64_t id = out[0].get<int64_t>();
          ids.push_back(id);
          toks.push_back(id);
        }
        return ids;
      };
      ASSERT_EQ(r.json()["tokens"].size(), 1u) << r.body;
      const auto bridged_ids = greedy(true, prompt_tokens, r.json()["tokens"][0].get<int64_t>());
      const auto native_ids = greedy(false, prompt_tokens, -1);
      size_t agree = 0;
      while (agree < std::min(bridged_ids.size(), native_ids.size()) && bridged_ids[agree] == native_ids[agree]) ++agree;
      // f16: the state is within 4e-4 of the native one (rel RMS): greedy is the same for all 12 tokens. q8_0: the
      // decoder's flash attention quantizes the query too (not mirrored), 7e-3; a random model's near-ties may then
      // part the continuations after the first tokens (measured: 12/12 at T 641, 8/12 at T 900): the first must agree.
      if (cache == "f16") EXPECT_EQ(bridged_ids, native_ids) << "the bridged greedy continuation differs from the native one";
      else EXPECT_GE(agree, 1u) << "the bridged first token differs from the native one";
      std::printf("DSV4 E2E cache=%s T=%lld: %s, bridged %lld, cache_n %lld, %lld wire bytes, fidelity %s; greedy: %zu of %zu tokens as native\n", cache.c_str(),
                  (long long)T, v["verdict"].get<std::string>().c_str(), (long long)v["bridged_tokens"].get<int64_t>(),
                  (long long)r.json()["timings"]["cache_n"].get<int64_t>(), (long long)v["bytes"].get<int64_t>(),
                  v["fidelity"]["class"].get<std::string>().c_str(), agree, native_ids.size());
    }
    EXPECT_EQ(st.stray_state_files(), 0u);
  }
}

// The sections' bytes as the cache type's rows, however many rows: a long chunk's pool is encoded in slices on the
// host's cores, and every slice must land where one pass over all the rows would put it.
TEST(Deepseek4Recipe, SectionBytesAreEachRowInTheCacheTypeWhateverTheCount) {
  Deepseek4Recipe recipe(test::models_dir() + "/deepseek4-tiny/decoder-f32.gguf");
  const int64_t D = recipe.config().head_dim, I = recipe.config().index_dim;
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (const int64_t n : {int64_t(1), int64_t(513), int64_t(3001)})
    for (const GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
      Deepseek4LayerSections S;
      S.ratio = 4;
      S.pool.resize(size_t(n * D));
      S.lid.resize(size_t(n * I));
      for (auto& v : S.pool) v = nd(rng);
      for (auto& v : S.lid) v = nd(rng);
      const Dsv4LayerBytes b = recipe.to_bytes(S, kt);
      std::vector<uint8_t> pool(ggml_row_bytes(kt, D) * size_t(n)), lid(ggml_row_bytes(kt, I) * size_t(n));
      rows_to_cache_type(kt, S.pool.data(), n, D, pool.data());
      rows_to_cache_type(kt, S.lid.data(), n, I, lid.data());
      EXPECT_EQ(b.pool, pool) << n << " rows, " << ggml_type_name(kt);
      EXPECT_EQ(b.lid, lid) << n << " rows, " << ggml_type_name(kt);
    }
}

// The fingerprint front door and prefill server compare covers DeepSeek-V4's cache geometry and the weights its
// sections come from: another ratio layout or other weights give another fingerprint.
TEST(Deepseek4Recipe, FingerprintCoversThePooledGeometryAndTheCacheWeights) {
  auto info = [](const std::string& p) { return read_recipe_info(*GgufFile::open(p)); };
  const auto a = info(test::models_dir() + "/deepseek4-tiny/decoder-f32.gguf"), b = info(test::models_dir() + "/deepseek4-tiny-hca/decoder-f32.gguf");
  EXPECT_EQ(a.compress_ratios, (std::vector<int32_t>{4, 128, 0, 4}));
  EXPECT_EQ(b.compress_ratios, (std::vector<int32_t>{128, 4, 0, 4}));
  EXPECT_EQ(a.window, 128);
  EXPECT_EQ(a.index_dim, 128);
  EXPECT_EQ(a.hc_count, 4);
  const auto g = recipe_geometry(a);
  ASSERT_TRUE(g.contains("dsv4")) << g.dump();
  EXPECT_EQ(g["dsv4"]["compress_rope_base"].get<float>(), 160000.0f);
  EXPECT_NE(recipe_fingerprint(a), recipe_fingerprint(b));
  MakeModelOptions o;  // the same preset with other weights
  o.arch = "deepseek4"; o.preset = "tiny"; o.seed = 91; o.out = test::temp_dir("deepseek4-fp");
  o.vocab_dir = test::llama_src() + "/models";
  make_model(o);
  const auto c = info(o.out + "/decoder-f32.gguf");
  EXPECT_EQ(recipe_geometry(c)["dsv4"], g["dsv4"]);
  EXPECT_NE(c.weights_hash, a.weights_hash);
  EXPECT_NE(recipe_fingerprint(c), recipe_fingerprint(a));
}

// make-model's --compress-ratios and --hash-layers (the H200's few-layer real-shape models): the layers and the hash-routed
// count reach the checkpoint and the GGUF; more hash layers than layers is refused.
TEST(Deepseek4Recipe, MakeModelTakesTheRatiosAndTheHashLayerCount) {
  MakeModelOptions o;
  o.arch = "deepseek4"; o.preset = "tiny"; o.seed = 92; o.out = test::temp_dir("deepseek4-hash");
  o.vocab_dir = test::llama_src() + "/models";
  o.compress_ratios = {0, 4, 128};
  o.hash_layers = 2;
  make_model(o);
  auto g = GgufFile::open(o.out + "/decoder-f32.gguf");
  EXPECT_EQ(g->get("deepseek4.hash_layer_count").u, 2u);
  EXPECT_EQ(g->get("deepseek4.attention.compress_ratios").arr.size(), 3u);
  std::ifstream cfg(o.out + "/hf/config.json");
  EXPECT_EQ(nlohmann::json::parse(cfg)["num_hash_layers"].get<int>(), 2);
  o.hash_layers = 4;
  o.out = test::temp_dir("deepseek4-hash-refused");
  EXPECT_THROW(make_model(o), std::invalid_argument);
}

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
    test::Stack st(decoder_only(dir, cache));
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
  test::Stack st(decoder_only(test::models_dir() + "/deepseek4-tiny", "f16"));
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
  // n_predict 0: a random model's greedy bytes can be invalid UTF-8, which llama-server answers with a 500
  // ("does not match the expected Content-only format"); the timings are what this test is about.
  json body = {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}};
  r = st.post_decoder("/completion", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const auto t = r.json()["timings"];
  EXPECT_EQ(t["cache_n"].get<int64_t>(), T - 1) << t.dump();
  EXPECT_EQ(t["prompt_n"].get<int64_t>(), 1) << t.dump();
  // a file of all T tokens under the same T-token prompt: the decoder recomputes everything (fact sheet §5)
  r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "all.bin"}}).status, 200);
  ASSERT_EQ(st.post_decoder("/slots/0?action=erase", json::object()).status, 200);
  ASSERT_EQ(st.post_decoder("/slots/0?action=restore", {{"filename", "all.bin"}}).status, 200);
  r = st.post_decoder("/completion", body);
  ASSERT_EQ(r.status, 200) << r.body;
  std::printf("DSV4 restore: T-1 file -> cache_n %lld prompt_n %lld; T file -> cache_n %lld prompt_n %lld\n",
              (long long)t["cache_n"].get<int64_t>(), (long long)t["prompt_n"].get<int64_t>(),
              (long long)r.json()["timings"]["cache_n"].get<int64_t>(), (long long)r.json()["timings"]["prompt_n"].get<int64_t>());
  EXPECT_EQ(r.json()["timings"]["prompt_n"].get<int64_t>(), T) << r.json()["timings"].dump();
}


// The engine chunk after chunk equals the engine over the whole prompt, bit for bit: every layer's input
// streams and every section, for chunks that cut the 4- and 128-token blocks anywhere.
TEST(Deepseek4Engine, ChunkedPrefillEqualsOneShot) {
  Deepseek4Recipe recipe(test::models_dir() + "/deepseek4-tiny/decoder-f32.gguf");
  Deepseek4CpuEngine engine(recipe);
  const int64_t T = 300, E = recipe.config().hidden;
  const auto toks = tokens_of(12, int(T));
  for (const GgmlType kt : {GgmlType::F16, GgmlType::Q8_0}) {
    std::vector<std::vector<float>> whole;
    engine.forward(toks, kt, [&](int, const float* x, int64_t n) { whole.emplace_back(x, x + n * 4 * E); });
    for (const int64_t chunk : {37, 128, 129}) {
      std::vector<std::vector<float>> cat(whole.size());
      const int64_t done = engine.prefill(toks, chunk, kt, [&](int l, const float* x, int64_t, int64_t n, const Deepseek4LayerSections&) {
        cat[size_t(l)].insert(cat[size_t(l)].end(), x, x + n * 4 * E);
        return true;
      });
      EXPECT_EQ(done, T);
      for (size_t l = 0; l < whole.size(); ++l) EXPECT_EQ(cat[l], whole[l]) << "layer " << l << " chunk " << chunk << " " << ggml_type_name(kt);
    }
  }
}

// The GPU engine's FP8 indexer has its twin in the CPU engine (set_fp8_indexer): the first layer's input is the
// embedding either way; past the first ratio-4 layer (the tiny model's layer 0) the streams part, as the indexer's
// top-8 swaps near-ties, and stay within a few percent of the f32 indexer's (relative RMS; 1.1e-2 to 3.3e-2 measured).
TEST(Deepseek4Engine, Fp8IndexerTwinPartsFromTheF32OnePastTheFirstRatio4Layer) {
  Deepseek4Recipe recipe(test::models_dir() + "/deepseek4-tiny/decoder-f32.gguf");
  ASSERT_EQ(recipe.config().compress_ratios[0], 4);
  Deepseek4CpuEngine engine(recipe);
  const int64_t T = 300;
  const auto toks = tokens_of(13, int(T));
  std::vector<std::vector<float>> x32, x8;
  engine.forward(toks, GgmlType::F16, [&](int, const float* x, int64_t n) { x32.emplace_back(x, x + n * 4 * recipe.config().hidden); });
  engine.set_fp8_indexer(true);
  engine.forward(toks, GgmlType::F16, [&](int, const float* x, int64_t n) { x8.emplace_back(x, x + n * 4 * recipe.config().hidden); });
  ASSERT_EQ(x8.size(), x32.size());
  EXPECT_EQ(x8[0], x32[0]) << "layer 0's input is the embedding";
  for (size_t l = 1; l < x8.size(); ++l) {
    double d2 = 0, r2 = 0;
    for (size_t i = 0; i < x8[l].size(); ++i) {
      d2 += double(x8[l][i] - x32[l][i]) * (x8[l][i] - x32[l][i]);
      r2 += double(x32[l][i]) * x32[l][i];
    }
    const double rel = std::sqrt(d2 / r2);
    std::printf("DSV4 CPU engine, FP8 indexer twin vs f32: layer %zu input rel RMS %.2e\n", l, rel);
    EXPECT_GT(rel, 0.0) << "layer " << l << ": the FP8 twin changed nothing";
    EXPECT_LT(rel, 0.1) << "layer " << l;
  }
}

namespace {
// A capture of `tokens` by the DSV4 CPU backend, framed as the prefill server frames it, into an assembler.
CaptureResult capture_into(PrefillBackend& backend, StateAssembler& as, const std::vector<int32_t>& tokens, GgmlType kt, int64_t chunk,
                           const std::function<void(std::vector<uint8_t>&)>& tamper = {}, int seal_at_emit = 0) {
  int emits = 0;
  wire::PrefillRequest req;
  req.tokens = tokens;
  req.fingerprint = recipe_fingerprint(backend.info());
  req.k_type = req.v_type = kt;
  req.rot_k = req.rot_v = kt == GgmlType::Q8_0;
  return run_capture(backend, req, chunk, EmitFn([&](wire::Bytes&& buf, bool force) {
    if (!force && seal_at_emit && ++emits >= seal_at_emit) return Emit::Seal;  // as the prefill server's full backlog says
    if (!tamper) {
      as.feed(buf.data(), buf.size());
      return Emit::Ok;
    }
    for (size_t off = 0; off < buf.size();) {  // one emit may hold several frames: the tamperer sees each alone
      uint64_t n;
      std::memcpy(&n, buf.data() + off + 24, 8);
      std::vector<uint8_t> f(buf.begin() + std::ptrdiff_t(off), buf.begin() + std::ptrdiff_t(off + wire::kHeaderBytes + n));
      off += wire::kHeaderBytes + n;
      tamper(f);
      as.feed(f.data(), f.size());
    }
    return Emit::Ok;
  }));
}
}  // namespace

// The bridge's wire for DeepSeek-V4: the prefill backend's section frames (chunks cutting the blocks anywhere)
// assembled by the front door's DSV4 assembler give the same file, byte for byte, as the engine and recipe over
// the whole prompt in process; llama-server restores it with one token left to compute.
TEST(Deepseek4Wire, SectionFramesAssembleTheDecodersFileAndItRestores) {
  for (const std::string cache : {"f16", "q8_0"}) {
    test::Stack st(decoder_only(test::models_dir() + "/deepseek4-tiny", cache));
    const GgmlType kt = cache == "f16" ? GgmlType::F16 : GgmlType::Q8_0;
    const Dsv4State like = probe_like(st);
    const int T = 517;
    const auto toks = tokens_of(43, T);
    const std::vector<int32_t> head(toks.begin(), toks.end() - 1);
    Deepseek4Recipe recipe(st.decoder_gguf);
    Deepseek4CpuEngine engine(recipe);
    const auto want = one_piece_state(recipe, engine, like, head, kt);
    auto backend = make_cpu_dsv4_backend(st.decoder_gguf, st.decoder_gguf);
    const std::string fp = recipe_fingerprint(backend->info());
    for (const int64_t chunk : {int64_t(100), int64_t(T)}) {
      const std::string path = st.slot_dir + "/wire.bin";
      uint64_t bytes = 0;
      {
        Dsv4CaptureAssembler as(path, like, head, uint32_t(recipe.config().window), fp);
        const auto r = capture_into(*backend, as, head, kt, chunk);
        ASSERT_EQ(r.status, "complete") << r.reason;
        EXPECT_EQ(as.commit(), T - 1);
        bytes = as.wire_bytes();
      }
      const auto got = read_all(path);
      EXPECT_EQ(got, want) << "chunk " << chunk << ": the wire's file differs from the in-process one";
      std::printf("DSV4 WIRE cache=%s chunk=%lld: %llu wire bytes for a %zu-byte state file of %d tokens (%.3fx)\n", cache.c_str(), (long long)chunk,
                  (unsigned long long)bytes, got.size(), T - 1, double(bytes) / double(got.size()));
    }
    ASSERT_EQ(st.post_decoder("/slots/0?action=erase", json::object()).status, 200);
    auto r = st.post_decoder("/slots/0?action=restore", {{"filename", "wire.bin"}});
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.json().value("n_restored", -1), T - 1);
    r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}});
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.json()["timings"]["cache_n"].get<int64_t>(), T - 1) << r.json()["timings"].dump();
    EXPECT_EQ(r.json()["timings"]["prompt_n"].get<int64_t>(), 1) << r.json()["timings"].dump();
  }
}

// A capture sealed early (the prefill server's backlog full): the backend sends a SEAL with the prefix P of
// complete chunks, then each layer's window rows before P and its rings at P; the front door's assembler makes
// the state of the first P tokens from them and the pool rows sent before. It is the very file the engine and
// recipe make of those P tokens in one piece, byte for byte (seals landing at a chunk's first layer and inside
// it), and llama-server restores it and computes the rest.
TEST(Deepseek4Wire, SealedCaptureGivesTheStateOfItsPrefix) {
  test::Stack st(decoder_only(test::models_dir() + "/deepseek4-tiny", "q8_0"));
  const GgmlType kt = GgmlType::Q8_0;
  const Dsv4State like = probe_like(st);
  const int T = 517;
  const auto toks = tokens_of(45, T);
  const std::vector<int32_t> head(toks.begin(), toks.end() - 1);
  Deepseek4Recipe recipe(st.decoder_gguf);
  Deepseek4CpuEngine engine(recipe);
  auto backend = make_cpu_dsv4_backend(st.decoder_gguf, st.decoder_gguf);
  const std::string fp = recipe_fingerprint(backend->info());
  const int64_t chunk = 100;
  // blocks that carry rows: every layer's first, then only those with pool rows or window rows of the last W
  std::set<int64_t> Ps;
  for (const int seal_at : {4, 6, 9}) {
    const std::string path = st.slot_dir + "/sealed.bin";
    int64_t P = 0;
    {
      Dsv4CaptureAssembler as(path, like, head, uint32_t(recipe.config().window), fp);
      const auto r = capture_into(*backend, as, head, kt, chunk, {}, seal_at);
      ASSERT_EQ(r.status, "partial") << r.reason;
      P = as.commit();
    }
    EXPECT_EQ(P % chunk, 0) << "a seal cuts where every layer finished a chunk";
    EXPECT_GT(P, 0);
    EXPECT_LT(P, T - 1);
    Ps.insert(P);
    const std::vector<int32_t> prefix(head.begin(), head.begin() + P);
    EXPECT_EQ(read_all(path), one_piece_state(recipe, engine, like, prefix, kt)) << "seal at block " << seal_at;
    ASSERT_EQ(st.post_decoder("/slots/0?action=erase", json::object()).status, 200);
    auto rr = st.post_decoder("/slots/0?action=restore", {{"filename", "sealed.bin"}});
    ASSERT_EQ(rr.status, 200) << rr.body;
    rr = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}});
    ASSERT_EQ(rr.status, 200) << rr.body;
    EXPECT_EQ(rr.json()["timings"]["cache_n"].get<int64_t>(), P) << rr.json()["timings"].dump();
    EXPECT_EQ(rr.json()["timings"]["prompt_n"].get<int64_t>(), T - P) << rr.json()["timings"].dump();
    std::printf("DSV4 SEAL at emitted block %d: state of %lld of %d tokens, byte-identical to the one-piece state; restored, the decoder computed %lld\n",
                seal_at, (long long)P, T - 1, (long long)rr.json()["timings"]["prompt_n"].get<int64_t>());
  }
  EXPECT_GE(Ps.size(), 2u) << "the seals should land at different prefixes";
}

// What the DSV4 assembler refuses, each with its reason and no file left: a capture for another model, a frame
// whose payload was altered, a section the decoder's layout does not have for that layer, rows out of order, a
// stream without its rings, a partial trailer.
TEST(Deepseek4Wire, AssemblerRefusesWhatIsNotTheDecodersState) {
  test::Stack st(decoder_only(test::models_dir() + "/deepseek4-tiny", "f16"));
  const Dsv4State like = probe_like(st);
  const auto head = tokens_of(44, 300);
  auto backend = make_cpu_dsv4_backend(st.decoder_gguf, st.decoder_gguf);
  const std::string fp = recipe_fingerprint(backend->info());
  const std::string path = st.slot_dir + "/bad.bin";
  auto header_of = [](const std::vector<uint8_t>& f) {
    wire::FrameHeader h;
    h.kind = wire::FrameKind(f[6]);
    std::memcpy(&h.layer, f.data() + 8, 4);
    std::memcpy(&h.pos0, f.data() + 12, 4);
    return h;
  };
  // re-frames a frame with another header (checksums recomputed: a well-formed frame
  // that says something the decoder's layout does not hold)
  auto reframe = [](std::vector<uint8_t>& f, auto edit) {
    uint64_t n;
    std::memcpy(&n, f.data() + 24, 8);
    wire::FrameHeader h;
    h.kind = wire::FrameKind(f[6]);
    h.type = f[7];
    std::memcpy(&h.layer, f.data() + 8, 4);
    std::memcpy(&h.pos0, f.data() + 12, 4);
    std::memcpy(&h.n_rows, f.data() + 16, 4);
    std::vector<uint8_t> payload(f.begin() + wire::kHeaderBytes, f.begin() + std::ptrdiff_t(wire::kHeaderBytes + n));
    edit(h);
    wire::Bytes out;
    wire::encode_frame(h, payload.data(), payload.size(), out);
    f.assign(out.begin(), out.end());
  };
  struct Case { std::string name, fingerprint, want; std::function<void(std::vector<uint8_t>&)> tamper; };
  int n_frame = 0;
  const std::vector<Case> cases = {
      {"another model", "0000000000000000", "fingerprint mismatch", {}},
      {"altered payload", fp, "checksum", [&](std::vector<uint8_t>& f) { if (++n_frame == 3) f.back() ^= 1; }},
      {"a section the layer has not", fp, "has no hca section",
       [&](std::vector<uint8_t>& f) { if (f[6] == uint8_t(wire::FrameKind::Csa) && header_of(f).layer == 0) reframe(f, [](wire::FrameHeader& h) { h.kind = wire::FrameKind::Hca; }); }},
      {"rows out of order", fp, "out of order",
       [&](std::vector<uint8_t>& f) { if (f[6] == uint8_t(wire::FrameKind::Csa) && header_of(f).pos0 > 0) reframe(f, [](wire::FrameHeader& h) { h.pos0 += 1; }); }},
      {"no rings", fp, "incomplete", [&](std::vector<uint8_t>& f) {
         if (wire::is_section_kind(wire::FrameKind(f[6])) && f[6] >= uint8_t(wire::FrameKind::CsaKvRing)) f.clear();
       }},
  };
  for (const auto& c : cases) {
    n_frame = 0;
    std::string err;
    try {
      Dsv4CaptureAssembler as(path, like, head, 128, c.fingerprint);
      capture_into(*backend, as, head, GgmlType::F16, 100, c.tamper);
      as.commit();
    } catch (const std::exception& e) {
      err = e.what();
    }
    EXPECT_NE(err.find(c.want), std::string::npos) << c.name << ": " << (err.empty() ? "accepted" : err);
    EXPECT_FALSE(std::filesystem::exists(path)) << c.name;
    EXPECT_FALSE(std::filesystem::exists(path + ".partial")) << c.name;
  }
}


// The official layout: the prefill engine runs the FP8 / FP4 HF checkpoint (dequantized), the decoder the GGUF
// llama.cpp's converter makes of it (FP8 -> Q8_0, FP4 experts -> MXFP4, bf16 embedding and head). Bridged end to
// end: complete, cache_n = T-1, and after the last token the decoder's state matches its native one section by
// section within the tolerance class (the engine's FP8 values are not the decoder's requantized Q8_0 ones, and the
// decoder rounds activations to q8_0 before its Q8_0 / MXFP4 products).
TEST(Deepseek4Bridge, OfficialFp8CheckpointAgainstItsConvertedGgufBridgesWithinTheToleranceClass) {
  const std::string dir = test::models_dir() + "/deepseek4-tiny-fp8";
  {  // the converter's types: Q8_0 from FP8, MXFP4 experts, BF16 matrices, F32 vectors, I32 ids
    auto g = GgufFile::open(dir + "/decoder-mxfp4_moe.gguf");
    EXPECT_EQ(g->tensor("blk.0.attn_q_a.weight").type, GgmlType::Q8_0);
    EXPECT_EQ(g->tensor("blk.0.ffn_gate_exps.weight").type, GgmlType::MXFP4);
    EXPECT_EQ(g->tensor("token_embd.weight").type, GgmlType::BF16);
    EXPECT_EQ(g->tensor("blk.0.attn_norm.weight").type, GgmlType::F32);
    EXPECT_EQ(g->tensor("blk.0.ffn_gate_tid2eid.weight").type, GgmlType::I32);
    // FP4 -> MXFP4 is lossless: the decoder's expert values are the checkpoint's, bit for bit
    auto ck = Deepseek4Checkpoint::open(dir + "/hf");
    const auto& ti = g->tensor("blk.1.ffn_down_exps.weight");
    EXPECT_EQ(g->to_f32(ti), ck->gguf_f32("blk.1.ffn_down_exps.weight"));
    // FP8 -> Q8_0 is a requantization: within Q8_0's rounding of the checkpoint's values
    const auto q = g->to_f32(g->tensor("blk.0.attn_kv.weight")), f = ck->gguf_f32("blk.0.attn_kv.weight");
    ASSERT_EQ(q.size(), f.size());
    double num = 0, den = 0;
    for (size_t i = 0; i < q.size(); ++i) { num += (double(q[i]) - f[i]) * (double(q[i]) - f[i]); den += double(f[i]) * f[i]; }
    EXPECT_LT(std::sqrt(num / den), 1e-2);
    EXPECT_GT(num, 0.0);
    // `pdbridge convert` writes the same file make-model wrote
    const std::string out = test::temp_dir("dsv4-convert");
    ConvertOptions co;
    co.hf_dir = dir + "/hf";
    co.out = out;
    co.vocab_gguf = test::llama_src() + "/models/ggml-vocab-llama-bpe.gguf";
    co.name = "pdbridge-deepseek4-tiny";
    convert_model(co);
    EXPECT_EQ(read_all(out + "/decoder-mxfp4_moe.gguf"), read_all(dir + "/decoder-mxfp4_moe.gguf"));
  }
  test::StackOptions so = decoder_only(dir, "f16");
  so.decoder_type = "mxfp4_moe";
  so.start_prefill = true;
  so.start_front = true;
  test::Stack st(so);
  const int T = 641;
  const json prompt = tokens_of(77, T);
  auto r = st.post_front("/completion", {{"prompt", prompt}, {"n_predict", 0}});
  ASSERT_EQ(r.status, 200) << r.body << st.logs();
  const json v = r.verdict();
  EXPECT_EQ(v["verdict"], "complete") << v.dump() << st.logs();
  EXPECT_EQ(v["bridged_tokens"].get<int64_t>(), T - 1);
  EXPECT_EQ(r.json()["timings"]["cache_n"].get<int64_t>(), T - 1) << r.json()["timings"].dump();
  EXPECT_EQ(v["fidelity"]["class"], "tolerance") << v.dump();
  ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "after.bin"}}).status, 200);
  ASSERT_EQ(st.post_decoder("/slots/0?action=erase", json::object()).status, 200);
  ASSERT_EQ(st.post_decoder("/completion", {{"prompt", prompt}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", false}}).status, 200);
  ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "native.bin"}}).status, 200);
  const Dsv4State after = parse_dsv4_state_file(st.slot_dir + "/after.bin"), native = parse_dsv4_state_file(st.slot_dir + "/native.bin");
  ASSERT_EQ(after.cells(), uint32_t(T));
  // The engine runs the checkpoint's FP8 / FP4 values, the decoder its Q8_0 requantization of them (each weight
  // within 1e-2, above): two slightly different models, whose states part a little more with every layer (measured
  // 5.8e-2 at the last layer of 4). Another model's rows differ by ~1.4 (layer 0 test); the bound sits between.
  const double worst = worst_section_rel_rms(after, native, Deepseek4Config::preset("tiny").head_dim, 0.15);
  std::printf("DSV4 FP8 checkpoint -> MXFP4/Q8_0 decoder T=%d: %s, cache_n %lld, %lld wire bytes, fidelity %s (layer 0 K rel RMS %.2e); after the last "
              "token vs native: worst section rel RMS %.2e\n",
              T, v["verdict"].get<std::string>().c_str(), (long long)r.json()["timings"]["cache_n"].get<int64_t>(), (long long)v["bytes"].get<int64_t>(),
              v["fidelity"]["class"].get<std::string>().c_str(), v["fidelity"]["k_rel_rms"].get<double>(), worst);
}

// The prefill server refuses a checkpoint whose config is not the decoder's, naming the field.
TEST(Deepseek4Bridge, PrefillServerRefusesACheckpointOfAnotherModel) {
  const auto mism = config_mismatches(test::models_dir() + "/deepseek4-tiny-hca/hf", test::models_dir() + "/deepseek4-tiny/decoder-f32.gguf");
  ASSERT_FALSE(mism.empty());
  std::string all;
  for (const auto& m : mism) all += m + "; ";
  EXPECT_NE(all.find("compress_ratios"), std::string::npos) << all;
  EXPECT_NE(all.find("yarn"), std::string::npos) << all;
  EXPECT_TRUE(config_mismatches(test::models_dir() + "/deepseek4-tiny/hf", test::models_dir() + "/deepseek4-tiny/decoder-f32.gguf").empty());
  EXPECT_TRUE(config_mismatches(test::models_dir() + "/deepseek4-tiny-fp8/hf", test::models_dir() + "/deepseek4-tiny-fp8/decoder-mxfp4_moe.gguf").empty());
}

}  // namespace pdb

namespace pdb {

// DeepSeek-V4-Flash's real layer shapes (hidden 4096, 64 heads of 512, 256 FP4 experts, indexer 64 x 128), in a
// checkpoint of a few layers of the official layout made where disk and memory hold it (the device:
// scripts/device/dsv4_real.sh; `make-model --preset v4-flash --compress-ratios 4,128 --hf-dtype fp8`), converted as
// llama.cpp's converter does. The decoder loads and runs it; its state's sections have the sizes the layout
// predicts (the fact sheet's ~6.9 KB per token for the 43-layer model is 21 x 320 + 20 x 8 bytes in f16); the
// recipe's layer-0 sections (a ratio-4 layer: window, CSA, LID, rings) match the decoder's within the tolerance
// class. Skipped (saying so) where no such model is given: CI's machines cannot hold one.
TEST(Deepseek4RealShapes, DecoderStateAndRecipeLayer0AtTheModelsShapes) {
  const char* env = std::getenv("PDBRIDGE_DSV4_MODEL");
  if (!env || !*env) GTEST_SKIP() << "PDBRIDGE_DSV4_MODEL (a make-model --preset v4-flash directory) is not set: measured on the device";
  const std::string dir = env;
  for (const std::string cache : {"f16", "q8_0"}) {
    test::StackOptions so = decoder_only(dir, cache);
    so.decoder_type = "mxfp4_moe";
    so.decoder_extra = {"--threads", std::to_string(std::max(2u, std::thread::hardware_concurrency()))};
    test::Stack st(so);
    const int T = 1024;
    const auto toks = tokens_of(21, T);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = st.post_decoder("/completion", {{"prompt", toks}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", false}});
    ASSERT_EQ(r.status, 200) << r.body;
    const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "s.bin"}}).status, 200);
    const Dsv4State s = parse_dsv4_state_file(st.slot_dir + "/s.bin");
    Deepseek4Recipe recipe(st.decoder_gguf);
    const auto& c = recipe.config();
    std::printf("DSV4 REAL cache=%s: %s; the decoder prefilled %d tokens in %.1f s\n", cache.c_str(), s.describe().c_str(), T, prefill_s);
    uint64_t pooled = 0;
    for (const auto& sec : s.sections()) {
      const bool pool = sec.kind == Dsv4SectionKind::Csa || sec.kind == Dsv4SectionKind::Hca || sec.kind == Dsv4SectionKind::Lid;
      if (pool) pooled += sec.block.bytes();
      std::printf("DSV4 REAL cache=%s layer %u ratio %d %-14s %5llu rows x %6llu bytes%s\n", cache.c_str(), sec.layer, c.compress_ratios[sec.layer],
                  to_string(sec.kind), (unsigned long long)sec.block.rows, (unsigned long long)sec.block.row_bytes,
                  pool ? fmt::format(" = {:.1f} bytes per token", double(sec.block.bytes()) / T).c_str() : "");
    }
    const GgmlType kt = cache == "f16" ? GgmlType::F16 : GgmlType::Q8_0;
    const double csa_lid = double(ggml_row_bytes(kt, c.head_dim) + ggml_row_bytes(kt, c.index_dim)) / 4, hca = double(ggml_row_bytes(kt, c.head_dim)) / 128;
    int n4 = 0, n128 = 0;
    for (int32_t ratio : c.compress_ratios) n4 += ratio == 4, n128 += ratio == 128;
    EXPECT_EQ(pooled, uint64_t(n4 * csa_lid * T + n128 * hca * T + 0.5)) << "pool bytes per token";
    std::printf("DSV4 REAL cache=%s: pooled sections %.1f bytes per token (ratio-4 layer %.0f, ratio-128 layer %.0f); the 43-layer model "
                "(21 + 20 layers): %.0f bytes per token beyond the windows\n",
                cache.c_str(), double(pooled) / T, csa_lid, hca, 21 * csa_lid + 20 * hca);
    ASSERT_EQ(c.compress_ratios.at(0), 4) << "layer 0 must be a ratio-4 layer (every section kind but HCA is then checked exactly)";
    const auto x = recipe.layer0_input(toks);
    const auto sec = recipe.sections(0, x.data(), T, kt);
    std::vector<std::pair<std::string, Compare>> rows;
    for (const auto& stm : s.swa.streams)
      if (stm.cell_count) rows.push_back({"window", compare(s.storage, [&] { auto b = stm.layers[0]; b.ne0 = uint64_t(c.head_dim); return b; }(), sec.window)});
    rows.push_back({"csa", compare(s.storage, s.csa.layers.at(0), sec.pool)});
    rows.push_back({"lid", compare(s.storage, s.lid.layers.at(0), sec.lid)});
    rows.push_back({"csa-kv-ring", compare(s.storage, s.csa_ring.kv.at(0), sec.ring_kv)});
    rows.push_back({"lid-score-ring", compare(s.storage, s.lid_ring.score.at(0), sec.lid_score)});
    for (const auto& [name, cmp] : rows) {
      std::printf("DSV4 REAL cache=%s layer 0 %-15s %8zu values: %8.4f%% identical, rel RMS %.2e\n", cache.c_str(), name.c_str(), cmp.n, cmp.identical,
                  cmp.rel_rms);
      EXPECT_LT(cmp.rel_rms, cache == "f16" ? 2e-2 : 3e-2) << name;  // the front door's calibration bounds
    }
  }
}

}  // namespace pdb

namespace pdb {

// DeepSeek-V4's bridge declining, each time served natively with the reason in the verdict and no file left: the
// prefill server down, and a prefill server of another model (its fingerprint is not the decoder's).
TEST(Deepseek4Bridge, DeclinesWithTheReasonAndServesNatively) {
  const std::string tiny = test::models_dir() + "/deepseek4-tiny";
  struct Case { std::string name, want; bool start_prefill; std::string other; };
  for (const Case& c : {Case{"prefill down", "prefill server", false, ""},
                        Case{"another model's prefill", "fingerprint", true, test::models_dir() + "/deepseek4-tiny-hca"}}) {
    test::StackOptions so = decoder_only(tiny, "f16");
    so.start_front = true;
    so.start_prefill = c.start_prefill;
    if (!c.other.empty()) {
      so.recipe_gguf = c.other + "/decoder-f32.gguf";
      so.hf_dir = c.other + "/hf";
    }
    test::Stack st(so);
    const json prompt = tokens_of(501, 700);
    json body = {{"prompt", prompt}, {"n_predict", 1}, {"temperature", 0}, {"return_tokens", true}};
    auto r = st.post_front("/completion", body);
    ASSERT_EQ(r.status, 200) << r.body;
    const std::string v = r.verdict().value("verdict", "");
    EXPECT_EQ(v.rfind("declined: ", 0), 0u) << c.name << ": " << r.verdict().dump();
    EXPECT_NE(v.find(c.want), std::string::npos) << c.name << ": " << r.verdict().dump();
    EXPECT_EQ(r.verdict()["bridged_tokens"].get<int64_t>(), 0);
    EXPECT_LT(r.json()["timings"]["cache_n"].get<int64_t>(), 10) << "served natively";
    body["cache_prompt"] = false;
    auto n = st.post_decoder("/completion", body);
    ASSERT_EQ(n.status, 200) << n.body;
    EXPECT_EQ(r.json()["tokens"], n.json()["tokens"]) << c.name << ": the native answer";
    EXPECT_EQ(st.stray_state_files(), 0u) << c.name;
    std::printf("DSV4 DECLINE %s: %s\n", c.name.c_str(), v.c_str());
  }
}

// A capture sealed early through the real processes: the prefill server's backlog (1 MiB) fills on a slow link, it
// seals, the front door mounts the prefix B it assembled and llama-server computes the other T - B tokens; the
// verdict says `partial B/T` and the answer is the native one. The decoder runs two slots.
TEST(Deepseek4Bridge, PartialSealOverHttpMountsThePrefixAndTheDecoderComputesTheRest) {
  test::StackOptions so = decoder_only(test::models_dir() + "/deepseek4-tiny", "f16");
  so.start_prefill = true;
  so.start_front = true;
  so.ctx = 16384;
  so.parallel = 2;  // the sequence in one of two slot streams: the state a slot saves, and restores, is still its own
  so.prefill_extra = {"--memory-limit-mb", "1", "--link-gbps", "0.0001", "--chunk", "64"};
  test::Stack st(so);
  const json prompt = tokens_of(777, 8000);
  json body = {{"prompt", prompt}, {"n_predict", 1}, {"temperature", 0}, {"return_tokens", true}};
  auto r = st.post_front("/completion", body);
  ASSERT_EQ(r.status, 200) << r.body;
  const json v = r.verdict();
  ASSERT_EQ(v.value("verdict", "").rfind("partial ", 0), 0u) << v.dump() << st.logs();
  const int64_t T = v["tokens"].get<int64_t>(), B = v["bridged_tokens"].get<int64_t>();
  EXPECT_EQ(T, int64_t(prompt.size()));
  EXPECT_GT(B, 0);
  EXPECT_LT(B, T - 1);
  const auto t = r.json()["timings"];
  EXPECT_EQ(t["cache_n"].get<int64_t>(), B) << t.dump();
  EXPECT_EQ(t["prompt_n"].get<int64_t>(), T - B) << t.dump();
  body["cache_prompt"] = false;
  auto n = st.post_decoder("/completion", body);
  ASSERT_EQ(n.status, 200) << n.body;
  EXPECT_EQ(r.json()["tokens"], n.json()["tokens"]) << "the answer after a partial bridge is the native one";
  EXPECT_EQ(st.stray_state_files(), 0u);
  std::printf("DSV4 PARTIAL over HTTP: %s (cache_n %lld, prompt_n %lld)\n", v["verdict"].get<std::string>().c_str(),
              (long long)t["cache_n"].get<int64_t>(), (long long)t["prompt_n"].get<int64_t>());
}

}  // namespace pdb
