// DeepSeek-V4's GPU engine (model/cuda_engine_dsv4.h) against its CPU twin (model/cpu_engine_dsv4.h) section by
// section, the bridge served with `pdbridge prefill --device cuda` into the real llama-server, and (PDBRIDGE_BENCH=1)
// the real V4-Flash layer shapes timed per layer kind on the GPU. Skipped (saying why) without a GPU.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cuda/device.h"
#include "formats/gguf.h"
#include "formats/hf_deepseek4.h"
#include "model/cpu_engine_dsv4.h"
#include "arch/deepseek4_backend.h"
#include "recipes/deepseek4.h"
#include "support/stack.h"
#include "support/test_env.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include "model/cuda_engine_dsv4.h"
#endif

namespace pdb {
namespace {
using json = nlohmann::json;

std::vector<int32_t> random_tokens(uint64_t seed, int n) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(int32_t(1000 + g() % 100000));
  return t;
}

double rel_rms(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * double(a[i] - b[i]);
    den += double(b[i]) * double(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

using SectionsByChunk = std::map<std::pair<int64_t, int>, Deepseek4LayerSections>;  // (pos0, layer)

}  // namespace

// Both engines over the same prompt in chunks that cut 4- and 128-blocks: every section of every layer and chunk
// (window rows, CSA / HCA / LID blocks, the four rings) from the GPU against the CPU engine's. Layer 0's sections
// come from the decoder's embedding through the recipe's arithmetic on both sides (f32 products or the same
// Q8_0 integer products): equal within f32 rounding (Q8_0: within its activation codes' flips). Deeper ones carry the GPU engine's bf16 products (the
// tolerance class): within a few percent, bounded here with the measured worst case's margin. Both indexers of the
// GPU engine: the default FP8 one against the CPU engine's FP8 twin, the bf16 one (PDBRIDGE_DSV4_INDEXER=bf16)
// against the decoder's f32 indexer.
TEST(Deepseek4Cuda, TracksTheCpuEngineSectionBySection) {
  PDB_SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  struct Case { std::string model, decoder; GgmlType kt; };
  for (const Case& k : {Case{"deepseek4-tiny", "decoder-f32.gguf", GgmlType::F16}, Case{"deepseek4-tiny", "decoder-f32.gguf", GgmlType::Q8_0},
                        Case{"deepseek4-tiny-fp8", "decoder-mxfp4_moe.gguf", GgmlType::F16}}) {
    const std::string dir = test::models_dir() + "/" + k.model;
    const Deepseek4Recipe recipe(dir + "/" + k.decoder);
    const Deepseek4Weights w = dsv4_engine_weights(dir + "/hf");
    Deepseek4CpuEngine cpu(recipe, &w);
    Deepseek4CudaEngine gpu(recipe, w);
    const auto tokens = random_tokens(77, 600);
    for (const bool fp8_indexer : {true, false}) {
      cpu.set_fp8_indexer(fp8_indexer);
      if (fp8_indexer) unsetenv("PDBRIDGE_DSV4_INDEXER");
      else setenv("PDBRIDGE_DSV4_INDEXER", "bf16", 1);
      const int64_t chunk = 202;  // cuts blocks of 4 and of 128
      SectionsByChunk want, got;
      cpu.prefill(tokens, chunk, k.kt, [&](int l, const float*, int64_t p0, int64_t, const Deepseek4LayerSections& s) {
        want[{p0, l}] = s;
        return true;
      });
      gpu.prefill(tokens, chunk, k.kt, [&](int l, const float*, int64_t p0, int64_t, const Deepseek4LayerSections& s) {
        got[{p0, l}] = s;
        return true;
      });
      ASSERT_EQ(got.size(), want.size());
      // Layer 0: f32 section weights give the same values within f32 rounding; Q8_0 ones multiply the activation's
      // Q8_0 codes, and where the two sides' attention inputs differ by an ulp at a rounding boundary a code flips
      // (one step of amax/127 in that element): measured worst 1.3e-3 on the H200
      const bool q8_sections = recipe.gguf().tensor("blk.0.attn_kv.weight").type == GgmlType::Q8_0;
      const double layer0_bound = q8_sections ? 5e-3 : 1e-4;
      std::map<int, double> worst;
      for (const auto& [key, a] : want) {
        const auto& b = got.at(key);
        const int l = key.second;
        ASSERT_EQ(b.ratio, a.ratio);
        // the GPU hands over the chunk's last min(rows, W) window rows; the CPU every position's
        const int64_t D = recipe.config().head_dim, n_cpu = int64_t(a.window.size()) / D, n_gpu = std::min<int64_t>(n_cpu, recipe.config().window);
        EXPECT_EQ(b.window_first, a.window_first + n_cpu - n_gpu);
        const std::vector<float> cpu_tail(a.window.end() - n_gpu * D, a.window.end());
        EXPECT_EQ(b.pool_first, a.pool_first) << "layer " << l << " chunk at " << key.first;
        EXPECT_EQ(b.lid_first, a.lid_first);
        for (const auto& [name, x, y] : {std::tuple<const char*, const std::vector<float>&, const std::vector<float>&>{"window", b.window, cpu_tail},
                                         {"pool", b.pool, a.pool}, {"lid", b.lid, a.lid}, {"ring_kv", b.ring_kv, a.ring_kv},
                                         {"ring_score", b.ring_score, a.ring_score}, {"lid_kv", b.lid_kv, a.lid_kv}, {"lid_score", b.lid_score, a.lid_score}}) {
          ASSERT_EQ(x.size(), y.size()) << name << " of layer " << l << " chunk at " << key.first;
          if (x.empty()) continue;
          const double e = rel_rms(x, y);
          worst[l] = std::max(worst[l], e);
          EXPECT_LE(e, l == 0 ? layer0_bound : 0.1) << name << " of layer " << l << " chunk at " << key.first << " (" << k.model << ", " << ggml_type_name(k.kt) << ")";
        }
      }
      std::printf("DSV4 GPU vs CPU engine, %s, %s cache, %s indexer, T 600 in chunks of %lld:", k.model.c_str(), ggml_type_name(k.kt).c_str(),
                  fp8_indexer ? "FP8" : "bf16 (the CPU's f32)", (long long)chunk);
      for (const auto& [l, e] : worst) std::printf(" layer %d %.2e", l, e);
      std::printf("\n%s\nDSV4 experts: %s\n", gpu.weights_note().c_str(), gpu.experts_note().c_str());
    }
    unsetenv("PDBRIDGE_DSV4_INDEXER");
  }
#endif
}

// `pdbridge prefill --device cuda` behind the front door, the real llama-server as the decoder: the bridge is
// complete (T-1 tokens restored, the last computed), and the answer tracks the native one: the first token
// equal, the greedy continuation and the top-10 log-probabilities reported (the GPU engine's bf16 products put
// the deeper layers' sections within ~1e-2 of the CPU engine's: a random model's near-ties may part later tokens).
// Issue 35 on the GPU: `pdbridge prefill --device cuda --model decoder.gguf` with no checkpoint and no --recipe, the
// FP4 experts from the GGUF's MXFP4 tensors: complete, the decoder's cache hit real, and the first answer token the
// decoder's own. The GPU engine is the tolerance class: later greedy tokens of a random tiny model may part (measured
// on the H200: 6 of 12 equal on one prompt), so they are reported, not asserted.
TEST(Deepseek4CudaBridge, FromItsGgufAlone) {
  PDB_SKIP_WITHOUT_GPU();
  struct Case { const char* model; const char* type; };
  for (const Case& c : {Case{"deepseek4-tiny", "f32"}, Case{"deepseek4-tiny-fp8", "mxfp4_moe"}}) {
    test::StackOptions so = test::gguf_alone_stack_options(c.model, c.type);
    so.ctx = 4096;
    so.prefill_extra = {"--device", "cuda"};
    test::Stack st(so);
    json body = {{"prompt", test::random_text(4101, 600)}, {"n_predict", 12}, {"temperature", 0}, {"return_tokens", true}};
    auto r = st.post_front("/completion", body);
    ASSERT_EQ(r.status, 200) << r.body << st.logs();
    EXPECT_EQ(r.verdict().value("verdict", ""), "complete") << c.model << " " << r.verdict().dump() << st.logs();
    EXPECT_GE(r.json()["timings"]["cache_n"].get<int64_t>(), r.verdict()["tokens"].get<int64_t>() - 1) << r.json()["timings"].dump();
    body["cache_prompt"] = false;
    body["id_slot"] = 0;
    auto n = st.post_decoder("/completion", body);
    ASSERT_EQ(n.status, 200) << n.body;
    const auto ours = r.json()["tokens"], native = n.json()["tokens"];
    ASSERT_FALSE(ours.empty()) << r.body;
    ASSERT_FALSE(native.empty()) << n.body;
    EXPECT_EQ(ours[0], native[0]) << c.model;
    size_t same = 0;
    while (same < ours.size() && same < native.size() && ours[same] == native[same]) ++same;
    std::printf("DSV4 GPU bridge from %s's GGUF alone: complete, first %zu of %zu greedy tokens as native\n", c.model, same, native.size());
  }
}

TEST(Deepseek4CudaBridge, CompleteWithTheGpuPrefillAndAnswersAsNative) {
  PDB_SKIP_WITHOUT_GPU();
  struct Case { std::string model, decoder, cache; };
  for (const Case& k : {Case{"deepseek4-tiny", "f32", "f16"}, Case{"deepseek4-tiny-fp8", "mxfp4_moe", "q8_0"}}) {
    test::StackOptions so;
    so.model_dir = test::models_dir() + "/" + k.model;
    so.decoder_type = k.decoder;
    so.cache_type = k.cache;
    so.parallel = 1;
    so.ctx = 4096;
    so.prefill_extra = {"--device", "cuda"};
    test::Stack st(so);
    for (const int T_want : {641, 900}) {
      const auto toks = random_tokens(4242 + uint64_t(T_want), T_want);
      const json prompt = toks;
      auto ask = [&](bool through_front, const json& p, int n_probs) {
        json b = {{"prompt", p}, {"n_predict", 1}, {"temperature", 0}, {"return_tokens", true}, {"cache_prompt", through_front}, {"n_probs", n_probs}};
        return through_front ? st.post_front("/completion", b) : st.post_decoder("/completion", b);
      };
      auto r = ask(true, prompt, 10);
      ASSERT_EQ(r.status, 200) << r.body << st.logs();
      const json v = r.verdict();
      EXPECT_EQ(v["verdict"], "complete") << v.dump() << st.logs();
      EXPECT_EQ(v["bridged_tokens"].get<int64_t>(), T_want - 1) << v.dump();
      EXPECT_EQ(r.json()["timings"]["cache_n"].get<int64_t>(), T_want - 1) << r.json()["timings"].dump();
      EXPECT_EQ(r.json()["timings"]["prompt_n"].get<int64_t>(), 1);
      auto n = ask(false, prompt, 10);
      ASSERT_EQ(n.status, 200) << n.body;
      // top-10 log-probabilities of the first token: the KL divergence over the native top 10 (where both list them)
      auto top = [](const json& reply) {
        std::map<int64_t, double> m;
        const json cp = reply.value("completion_probabilities", json::array());
        if (!cp.empty())
          for (const auto& e : cp[0].value("top_logprobs", json::array())) m[e["id"].get<int64_t>()] = e["logprob"].get<double>();
        return m;
      };
      const auto tb = top(r.json()), tn = top(n.json());
      double kl = 0;
      int shared = 0;
      for (const auto& [id, lp] : tn)
        if (tb.count(id)) { kl += std::exp(lp) * (lp - tb.at(id)); ++shared; }
      const int64_t first_b = r.json()["tokens"][0].get<int64_t>(), first_n = n.json()["tokens"][0].get<int64_t>();
      EXPECT_EQ(first_b, first_n) << "the bridged first token differs from the native one";
      EXPECT_GE(shared, 5) << "the bridged and native top-10 share too few tokens";
      // greedy: 8 more tokens each way (the bridged slot is warm, the native side recomputes)
      auto greedy = [&](bool through_front, int64_t first_id) {
        std::vector<int64_t> ids{first_id};
        json p = prompt;
        p.push_back(first_id);
        while (ids.size() < 8) {
          auto x = ask(through_front, p, 0);
          if (x.status != 200) { ADD_FAILURE() << x.body; break; }
          const int64_t id = x.json()["tokens"][0].get<int64_t>();
          ids.push_back(id);
          p.push_back(id);
        }
        return ids;
      };
      const auto gb = greedy(true, first_b), gn = greedy(false, first_n);
      size_t agree = 0;
      while (agree < std::min(gb.size(), gn.size()) && gb[agree] == gn[agree]) ++agree;
      std::printf("DSV4 GPU bridge %s (decoder %s, cache %s) T=%d: %s, cache_n %lld; first token %s; KL(native||bridged) over %d shared of top-10 %.2e; "
                  "greedy %zu of %zu as native\n",
                  k.model.c_str(), k.decoder.c_str(), k.cache.c_str(), T_want, v["verdict"].get<std::string>().c_str(),
                  (long long)r.json()["timings"]["cache_n"].get<int64_t>(), first_b == first_n ? "equal" : "differs", shared, kl, agree, gn.size());
    }
    EXPECT_EQ(st.stray_state_files(), 0u);
  }
}

// PDBRIDGE_BENCH=1: DeepSeek-V4-Flash's real layer shapes with random weights made on the GPU (FP4 experts, bf16
// dense matrices, Q8_0 section projections), one layer of each kind (ratio 0 hash-routed, 4, 128), every layer
// computed, per-phase device times at PDBRIDGE_DSV4_BENCH_TOKENS (default 8192,32768,131072); the whole model's
// prefill throughput extrapolated over its 43 layers (2 ratio-0, 21 ratio-4, 20 ratio-128). JSON lines to
// PDBRIDGE_BENCH_OUT (or stdout).
TEST(Deepseek4CudaBench, RealShapeLayersPerKind) {
  PDB_SKIP_WITHOUT_GPU();
  if (!std::getenv("PDBRIDGE_BENCH")) GTEST_SKIP() << "a benchmark: PDBRIDGE_BENCH=1";
#ifdef PDBRIDGE_HAVE_CUDA
  Deepseek4Config c = Deepseek4Config::preset("v4-flash");
  c.vocab = 129280;
  c.layers = 3;
  c.compress_ratios = {0, 4, 128};
  c.hash_layers = 1;
  const int64_t chunk = std::getenv("PDBRIDGE_DSV4_BENCH_CHUNK") ? std::atoll(std::getenv("PDBRIDGE_DSV4_BENCH_CHUNK")) : 4096;
  std::vector<int64_t> lengths = {8192, 32768, 131072};
  if (const char* e = std::getenv("PDBRIDGE_DSV4_BENCH_TOKENS")) {
    lengths.clear();
    std::stringstream ss(e);
    for (std::string t; std::getline(ss, t, ',');) lengths.push_back(std::stoll(t));
  }
  auto env_or = [](const char* name, const char* fallback) {
    const char* e = std::getenv(name);
    return std::string(e && *e ? e : fallback);
  };
  auto eng = Deepseek4CudaEngine::random(c, 7);
  // the paths of the run (the A/B switches: the fused attention and indexer, or the gathered keys and S; the experts'
  // path as the engine took it)
  const std::string experts = eng->experts_note();
  const bool fp4_products = experts.find("read the MXFP4 codes") != std::string::npos;
  const json paths = {{"attention", env_or("PDBRIDGE_DSV4_ATTN", "wgmma")}, {"indexer", env_or("PDBRIDGE_DSV4_INDEXER", "fused")},
                      {"indexer_a", env_or("PDBRIDGE_DSV4_INDEXER_A", "keys")}, {"topk", env_or("PDBRIDGE_DSV4_TOPK", "warps")},
                      {"fp4_tile", env_or("PDBRIDGE_DSV4_FP4_TILE", "outputs256")}, {"fp4_fuse", env_or("PDBRIDGE_DSV4_FP4_FUSE", "1")}, {"mix", env_or("PDBRIDGE_DSV4_MIX", "auto")}, {"f32", env_or("PDBRIDGE_DSV4_F32", "tf32x3")},
                      {"moe_gemm", env_or("PDBRIDGE_MOE_GEMM", "loop")},
                      {"fp4_expansion", fp4_products ? "none" : env_or("PDBRIDGE_DSV4_EXPAND", "side_stream")},
                      {"moe_experts", experts.find("as FP8 products") != std::string::npos ? "fp8"
                                      : fp4_products                                        ? "bf16 products reading FP4"
                                                                                            : "bf16"}};
  std::printf("DSV4 bench: %s; %.1f GB of weights for %lld layers; %s\n", cuda::device_summary().c_str(), double(eng->weight_bytes()) / 1e9,
              (long long)c.layers, eng->weights_note().c_str());
  FILE* out = stdout;
  if (const char* p = std::getenv("PDBRIDGE_BENCH_OUT")) out = std::fopen(p, "a");
  ASSERT_NE(out, nullptr);
  const int64_t E = c.hidden, D = c.head_dim, H = c.heads, Lq = c.q_lora, G = c.out_groups, R = c.out_lora, F = c.expert_ff;
  for (const int64_t T : lengths) {
    const auto tokens = random_tokens(uint64_t(T), int(T));
    Deepseek4CudaEngine::Profile warm, prof;
    eng->prefill(std::vector<int32_t>(tokens.begin(), tokens.begin() + std::min<int64_t>(T, chunk)), chunk, GgmlType::F16,
                 [](int, const float*, int64_t, int64_t, const Deepseek4LayerSections&) { return true; }, {}, true, &warm);
    if (T == lengths.front()) std::printf("DSV4 bench: %s\n", eng->experts_note().c_str());
    const auto w0 = std::chrono::steady_clock::now();
    const int64_t done = eng->prefill(tokens, chunk, GgmlType::F16, [](int, const float*, int64_t, int64_t, const Deepseek4LayerSections&) { return true; },
                                      {}, true, &prof);
    const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count();
    ASSERT_EQ(done, T);
    // what the run spent outside its layers' phases (the chunks' embedding and RoPE tables, per prompt, not per
    // layer): added once to the extrapolation
    double layers_ms = 0;
    for (int64_t l = 0; l < c.layers; ++l)
      for (int p = 0; p < Deepseek4CudaEngine::kPhases; ++p)
        if (!Deepseek4CudaEngine::Profile::part_of_another(p)) layers_ms += prof.ms[size_t(l)][size_t(p)];
    const double per_prompt_ms = std::max(0.0, wall_ms - layers_ms);
    double model_ms = per_prompt_ms;
    for (int64_t l = 0; l < c.layers; ++l) {
      const int ratio = prof.ratio[size_t(l)];
      const int count = ratio == 0 ? 2 : ratio == 4 ? 21 : 20;
      double layer_ms = 0;
      json phases;
      for (int p = 0; p < Deepseek4CudaEngine::kPhases; ++p) {
        if (!Deepseek4CudaEngine::Profile::part_of_another(p)) layer_ms += prof.ms[size_t(l)][size_t(p)];  // parts of (or beside) another phase: not twice
        phases[Deepseek4CudaEngine::Profile::phase_name(p)] = prof.ms[size_t(l)][size_t(p)];
      }
      model_ms += count * layer_ms;
      // the layer's products, summed over the prompt's tokens (2 flops per multiply-add)
      double flops = 0;
      const double cw = ratio == 4 ? 2.0 * D : ratio == 128 ? double(D) : 0.0;
      for (int64_t t = 0; t < T; t += 64) {  // sampled every 64 tokens
        double f = 2.0 * (double(E) * Lq + double(Lq) * H * D + double(H) * D * R + double(G) * R * E + 3.0 * E * F * (c.experts_used + 1) +
                          double(E) * D + 2.0 * E * cw + double(E) * c.experts);
        double nk = double(std::min<int64_t>(c.window, t + 1));
        if (ratio == 4) {
          f += 2.0 * (double(Lq) * c.index_heads * c.index_dim + 4.0 * E * c.index_dim + double(c.index_heads) * c.index_dim * double((t + 1) / 4));
          nk += double(std::min<int64_t>(c.index_top_k, (t + 1) / 4));
        } else if (ratio == 128) {
          nk += double((t + 1) / 128);
        }
        f += 4.0 * H * D * nk;
        flops += 64 * f;
      }
      const json row = {{"bench", "dsv4_layer"}, {"tokens", T}, {"chunk", chunk}, {"ratio", ratio}, {"layer_ms", layer_ms}, {"phases_ms", phases},
                        {"tflops", flops / (layer_ms * 1e-3) / 1e12}, {"layers_of_this_kind", count}, {"paths", paths}, {"device", cuda::device_summary()}};
      std::fprintf(out, "%s\n", row.dump().c_str());
      std::printf("DSV4 bench T=%lld ratio %d: %.1f ms per layer (%.0f TFLOP/s) %s\n", (long long)T, ratio, layer_ms,
                  flops / (layer_ms * 1e-3) / 1e12, phases.dump().c_str());
    }
    const json row = {{"bench", "dsv4_model_extrapolated"}, {"tokens", T}, {"chunk", chunk}, {"model_ms", model_ms}, {"wall_ms_3_layers", wall_ms},
                      {"per_prompt_ms", per_prompt_ms},
                      {"tokens_per_s", double(T) / (model_ms * 1e-3)}, {"layers", 43}, {"paths", paths}, {"device", cuda::device_summary()}};
    std::fprintf(out, "%s\n", row.dump().c_str());
    std::printf("DSV4 bench T=%lld %s: 43 layers extrapolated %.0f ms (%.0f of it per prompt, outside the layers; 3 layers ran in %.0f ms wall) -> %.0f tok/s\n",
                (long long)T, paths.dump().c_str(), model_ms, per_prompt_ms, wall_ms, double(T) / (model_ms * 1e-3));
    std::fflush(out);
  }
  if (out != stdout) std::fclose(out);
#endif
}

}  // namespace pdb
