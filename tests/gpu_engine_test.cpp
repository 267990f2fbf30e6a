// The CUDA backend against the CPU backend and against the real llama-server: GPU recipe rows vs CPU
// recipe rows on the same hidden states, the GPU forward vs the CPU forward layer by layer, and a
// bridge served end to end with `pdbridge prefill --device cuda`. Skipped (saying why) without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "arch/architectures.h"
#include "arch/backends.h"
#include "cuda/device.h"
#include "formats/numeric.h"
#include "cache/assembler.h"
#include "model/cpu_engine.h"
#include "numerics/reference_ops.h"
#include "prefill/backend.h"
#include "prefill/capture.h"
#include "support/stack.h"
#include "tools/make_model.h"
#include "formats/state_diff.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include "cuda/common.cuh"
#include "cuda/gemm.cuh"
#include "model/cuda_engine.h"
#include "model/cuda_moe_ffn.h"
#include "recipes/recipe_gpu.h"
#endif

namespace pdb {
namespace {


// deepseek2 `small` (DeepSeek-V2's head widths, which the GPU's MLA attention takes) with its decoder
// GGUFs, made once per test process; its model directory.
const std::string& deepseek2_small_dir() {
  static const std::string dir = [] {
    MakeModelOptions o;
    o.arch = "deepseek2"; o.preset = "small"; o.seed = 7; o.out = test::temp_dir("deepseek2-small"); o.hf_dtype = "f32";
    o.gguf_types = {"f32", "f16", "q8_0"};
    o.vocab_dir = test::llama_src() + "/models";
    o.llama_bin = test::llama_bin();
    make_model(o);
    return o.out;
  }();
  return dir;
}


int64_t f16_ulp_distance(uint16_t a, uint16_t b) {
  auto ord = [](uint16_t x) { return (x & 0x8000) ? -int64_t(x & 0x7fff) : int64_t(x); };
  return std::llabs(ord(a) - ord(b));
}

}  // namespace

// Same hidden states through both recipes; rows compared as the decoder stores them (f16).
TEST(GpuRecipe, RowsMatchTheCpuRecipeOnTheSameHiddenStates) {
  PDB_SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  struct Case { std::string model, gguf; double min_pct; };
  cuda::Gemm gemm;
  for (const Case& c : {Case{"llama-tiny", "f32", 99.0}, Case{"llama-tiny", "f16", 99.0}, Case{"llama-tiny", "q8_0", 97.0},
                       Case{"llama-tiny", "q4_0", 97.0}, Case{"qwen3-tiny", "f32", 99.0}, Case{"qwen3-tiny", "q8_0", 97.0}}) {
    auto recipe = Recipe::load(test::models_dir() + "/" + c.model + "/decoder-" + c.gguf + ".gguf", 2);
    const auto& in = recipe->info();
    const int64_t rows = 300, pos0 = 1000, E = in.n_embd, C = in.n_embd_kv();
    GpuRecipe gpu(*recipe, gemm, rows);
    std::mt19937 g(std::random_device{}());
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> h(size_t(rows * E));
    for (auto& x : h) x = d(g);
    cuda::DeviceBuffer dh(h.size() * 4), dk(size_t(rows * C) * 4), dv(size_t(rows * C) * 4);
    dh.upload(h.data(), h.size() * 4);
    size_t same = 0, total = 0;
    int64_t worst = 0;
    for (int layer = 0; layer < in.n_layer; ++layer) {
      std::vector<float> ck(size_t(rows * C)), cv(ck.size()), gk(ck.size()), gv(ck.size());
      // each layer further along (the GPU recipe's table of positions grows, then is read from its middle)
      const int64_t p0 = pos0 + (layer % 2 ? 4500 * layer : 0);
      recipe->kv_f32(layer, h.data(), rows, p0, host_simd_width() ? host_simd_width() : 8, ck.data(), cv.data());
      gpu.set_positions(p0, rows, nullptr);
      gpu.kv_f32(layer, dh.as<float>(), rows, nullptr, dk.as<float>(), dv.as<float>());
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      dk.download(gk.data(), gk.size() * 4);
      dv.download(gv.data(), gv.size() * 4);
      for (size_t i = 0; i < ck.size(); ++i)
        for (auto [a, b] : {std::pair{ck[i], gk[i]}, std::pair{cv[i], gv[i]}}) {
          const int64_t u = f16_ulp_distance(f32_to_fp16(a), f32_to_fp16(b));
          same += u == 0;
          worst = std::max(worst, u);
          ++total;
        }
    }
    const double pct = 100.0 * double(same) / double(total);
    std::printf("GPU RECIPE %s %s: %.4f%% of f16 cache elements identical to the CPU recipe, worst %lld ulp\n", c.model.c_str(), c.gguf.c_str(),
                pct, (long long)worst);
    EXPECT_GE(pct, c.min_pct);
    EXPECT_LE(worst, 16);  // measured 3-11 on the H200 (2026-11-30): sums in another order, near-zero elements
  }
#endif
}

// The residual stream entering every layer, GPU engine (bf16) vs CPU engine (f32).
TEST(CudaEngine, ForwardTracksTheCpuEngineLayerByLayer) {
  PDB_SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  // qwen3moe: grouped expert products; deepseek2 `small`: decompressed MLA attention (192/128) and routed + shared experts
  for (const std::string& dir : {test::models_dir() + "/llama-tiny", test::models_dir() + "/qwen3-tiny", test::models_dir() + "/qwen3moe-tiny",
                                 deepseek2_small_dir()}) {
    const std::string hf = dir + "/hf", model = dir.substr(dir.find_last_of('/') + 1);
    CpuEngine cpu(hf, 2);
    CudaEngine gpu(hf, 2);
    const int64_t T = 700;
    auto tokens = test::random_token_ids(std::random_device{}(), int(T), int(cpu.config().vocab_size));
    const int64_t E = cpu.config().hidden_size, L = cpu.config().num_layers;
    std::vector<std::vector<float>> want(size_t(L), std::vector<float>(size_t(T * E))), got = want;
    cpu.prefill(tokens, 256, 0, [&](int l, const float* h, int64_t rows, int64_t p0) { std::copy_n(h, rows * E, want[size_t(l)].begin() + p0 * E); });
    gpu.prefill(tokens, 300, [&](int l, const float* dh, int64_t rows, int64_t p0, cudaStream_t s) {
      PDB_CUDA_CHECK(cudaMemcpyAsync(got[size_t(l)].data() + p0 * E, dh, size_t(rows * E) * 4, cudaMemcpyDeviceToHost, s));
      PDB_CUDA_CHECK(cudaStreamSynchronize(s));
    });
    for (int64_t l = 0; l < L; ++l) {
      const double e = ref::rel_error(got[size_t(l)], want[size_t(l)]);
      std::printf("CUDA ENGINE %s layer %lld input: rel err vs CPU engine %.2e\n", model.c_str(), (long long)l, e);
      EXPECT_LT(e, l == 0 ? 1e-7 : 3e-2);
    }
  }
#endif
}

// The decoder's GGUF as the GPU engine's model (issue 35): an F16 GGUF of an f16 checkpoint gives the checkpoint's
// forward bit for bit; quantized GGUFs (kept quantized on the device, expanded per layer) track the CPU engine from
// the same GGUF as the checkpoint engines track each other, in less device memory than the checkpoint's.
TEST(CudaEngine, FromTheGgufTracksTheCpuEngineFromTheSameGguf) {
  PDB_SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  auto hidden = [](CudaEngine& e, const std::vector<int32_t>& tokens) {
    const int64_t E = e.config().hidden_size, L = e.config().num_layers, T = int64_t(tokens.size());
    std::vector<std::vector<float>> got(size_t(L), std::vector<float>(size_t(T * E)));
    e.prefill(tokens, 300, [&](int l, const float* dh, int64_t rows, int64_t p0, cudaStream_t s) {
      PDB_CUDA_CHECK(cudaMemcpyAsync(got[size_t(l)].data() + p0 * E, dh, size_t(rows * E) * 4, cudaMemcpyDeviceToHost, s));
      PDB_CUDA_CHECK(cudaStreamSynchronize(s));
    });
    return got;
  };
  {
    const std::string dir = test::models_dir() + "/llama-tiny-h16";
    CudaEngine ck(dir + "/hf", 2), gg(dir + "/decoder-f16.gguf", 2);
    EXPECT_NE(gg.weights_note().find("GGUF"), std::string::npos) << gg.weights_note();
    const auto tokens = test::random_token_ids(std::random_device{}(), 500, int(ck.config().vocab_size));
    const auto a = hidden(ck, tokens), b = hidden(gg, tokens);
    for (size_t l = 0; l < a.size(); ++l) EXPECT_EQ(std::memcmp(a[l].data(), b[l].data(), a[l].size() * 4), 0) << "llama-tiny-h16 layer " << l;
  }
  struct Case { std::string dir, gguf; };
  for (const Case& c : {Case{test::models_dir() + "/llama-tiny", "q4_0"}, Case{test::models_dir() + "/llama-tiny", "q8_0"},
                       Case{test::models_dir() + "/qwen3-tiny", "q8_0"}, Case{test::models_dir() + "/qwen3moe-tiny", "q8_0"},
                       Case{deepseek2_small_dir(), "q8_0"}}) {
    const std::string gguf = c.dir + "/decoder-" + c.gguf + ".gguf", model = c.dir.substr(c.dir.find_last_of('/') + 1);
    CpuEngine cpu(gguf, 2);
    CudaEngine gpu(gguf, 2), gpu_ck(c.dir + "/hf", 2);
    EXPECT_NE(gpu.weights_note().find("expanded per layer"), std::string::npos) << gpu.weights_note();
    EXPECT_LT(gpu.weight_bytes(), gpu_ck.weight_bytes()) << model << ": " << gpu.weights_note();
    if (c.gguf == "q4_0") {  // the memory cap: below what is allocated, refused; above it, a prompt fits or not by its size
      const size_t in_use = cuda::device_bytes_in_use();
      EXPECT_THROW(gpu.set_memory_cap(in_use / 2), std::runtime_error);
      gpu.set_memory_cap(in_use + (size_t(256) << 20));  // under the check's 512 MiB margin: nothing fits
      EXPECT_THROW(gpu.check_fits(700, 300), std::runtime_error);
      gpu.set_memory_cap(in_use + (size_t(4) << 30));
      EXPECT_NO_THROW(gpu.check_fits(700, 300));
      gpu.set_memory_cap(0);
    }
    const int64_t T = 700, E = cpu.config().hidden_size;
    const auto tokens = test::random_token_ids(std::random_device{}(), int(T), int(cpu.config().vocab_size));
    std::vector<std::vector<float>> want(size_t(cpu.config().num_layers), std::vector<float>(size_t(T * E)));
    cpu.prefill(tokens, 256, 0, [&](int l, const float* h, int64_t rows, int64_t p0) { std::copy_n(h, rows * E, want[size_t(l)].begin() + p0 * E); });
    const auto got = hidden(gpu, tokens);
    for (size_t l = 0; l < want.size(); ++l) {
      const double e = ref::rel_error(got[l], want[l]);
      std::printf("CUDA ENGINE FROM GGUF %s %s layer %zu input: rel err vs the CPU engine from the GGUF %.2e\n", model.c_str(), c.gguf.c_str(), l, e);
      EXPECT_LT(e, l == 0 ? 1e-7 : 3e-2) << model << " " << c.gguf << " layer " << l;
    }
  }
#endif
}

// deepseek2's GPU recipe: the cache row [rms_norm(latent) * w | RoPE(k_pe)], no V, against the CPU recipe.
TEST(GpuRecipe, MlaRowsMatchTheCpuRecipeOnTheSameHiddenStates) {
  PDB_SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  cuda::Gemm gemm;
  for (const std::string gguf : {"f32", "q8_0"}) {
    auto recipe = Recipe::load(test::models_dir() + "/deepseek2-tiny/decoder-" + gguf + ".gguf", 2);
    const auto& in = recipe->info();
    ASSERT_TRUE(in.mla());
    const int64_t rows = 300, pos0 = 1000, E = in.n_embd, C = in.n_embd_kv();
    GpuRecipe gpu(*recipe, gemm, rows);
    std::mt19937 g(std::random_device{}());
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> h(size_t(rows * E));
    for (auto& x : h) x = d(g);
    cuda::DeviceBuffer dh(h.size() * 4), dk(size_t(rows * C) * 4), dv(4);
    dh.upload(h.data(), h.size() * 4);
    CacheSpec spec;
    spec.k_type = spec.v_type = GgmlType::F32;
    spec.simd_width = host_simd_width() ? host_simd_width() : 8;
    size_t same = 0, total = 0;
    int64_t worst = 0;
    for (int layer = 0; layer < in.n_layer; ++layer) {
      std::vector<uint8_t> kb, vb;
      recipe->kv_rows(layer, h.data(), rows, pos0, spec, kb, vb);
      EXPECT_TRUE(vb.empty());
      std::vector<float> ck(size_t(rows * C)), gk(ck.size());
      std::memcpy(ck.data(), kb.data(), ck.size() * 4);
      gpu.set_positions(pos0, rows, nullptr);
      gpu.kv_f32(layer, dh.as<float>(), rows, nullptr, dk.as<float>(), dv.as<float>());
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      dk.download(gk.data(), gk.size() * 4);
      for (size_t i = 0; i < ck.size(); ++i) {
        const int64_t u = f16_ulp_distance(f32_to_fp16(ck[i]), f32_to_fp16(gk[i]));
        same += u == 0;
        worst = std::max(worst, u);
        ++total;
      }
    }
    const double pct = 100.0 * double(same) / double(total);
    std::printf("GPU RECIPE deepseek2-tiny %s: %.4f%% of f16 cache elements identical to the CPU recipe, worst %lld ulp\n", gguf.c_str(), pct,
                (long long)worst);
    EXPECT_GE(pct, gguf == "f32" ? 99.0 : 97.0);
    EXPECT_LE(worst, 16);
  }
#endif
}

// A block-FP8 checkpoint runs its products in FP8 (block-scaled cuBLASLt, activations quantized per
// 1x128 block) and still tracks the CPU engine, which dequantizes the same weights exactly.
TEST(CudaEngine, Fp8CheckpointRunsBlockScaledProductsAndTracksTheCpuEngine) {
  PDB_SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  const std::string hf = test::make_hf_checkpoint("fp8-engine", "qwen3", "tiny", 9, "fp8");
  CpuEngine cpu(hf, 2);
  CudaEngine gpu(hf, 2);
  std::printf("FP8 ENGINE: %s\n", gpu.weights_note().c_str());
  ASSERT_TRUE(gpu.fp8().has_value()) << gpu.weights_note();
  const int64_t T = 520, E = cpu.config().hidden_size, L = cpu.config().num_layers;
  auto tokens = test::random_token_ids(std::random_device{}(), int(T), int(cpu.config().vocab_size));
  std::vector<std::vector<float>> want(size_t(L), std::vector<float>(size_t(T * E))), got = want;
  cpu.prefill(tokens, 256, 0, [&](int l, const float* h, int64_t rows, int64_t p0) { std::copy_n(h, rows * E, want[size_t(l)].begin() + p0 * E); });
  gpu.prefill(tokens, 200, [&](int l, const float* dh, int64_t rows, int64_t p0, cudaStream_t s) {
    PDB_CUDA_CHECK(cudaMemcpyAsync(got[size_t(l)].data() + p0 * E, dh, size_t(rows * E) * 4, cudaMemcpyDeviceToHost, s));
    PDB_CUDA_CHECK(cudaStreamSynchronize(s));
  });
  for (int64_t l = 0; l < L; ++l) {
    const double e = ref::rel_error(got[size_t(l)], want[size_t(l)]);
    std::printf("FP8 ENGINE layer %lld input: rel err vs CPU engine %.2e\n", (long long)l, e);
    EXPECT_LT(e, l == 0 ? 1e-7 : 1e-1);  // e4m3 activations: 3 mantissa bits, averaged over each product
  }
#endif
}

// The engine's fp8 K/V option (e4m3 rows + a scale per head row, head_dim 128 on sm_90) against the
// same engine with bf16 K/V, layer by layer, on the `small` preset (head_dim 128); refused with a
// clear message for head_dim 64.
TEST(CudaEngine, Fp8KvTracksBf16KvAndIsRefusedWhereItCannotRun) {
  PDB_SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  // The fused fp8 kernel is ours: the bf16 and expanded rows go through our bf16 kernel too (not cuDNN's), so
  // that the paths differ only in the K/V values they read, not in the attention's summation order.
  setenv("PDBRIDGE_ATTN", "ours", 1);
  struct Unset { ~Unset() { unsetenv("PDBRIDGE_ATTN"); } } unset;
  try {
    CudaEngine tiny(test::models_dir() + "/llama-tiny/hf", 2, true);
    ADD_FAILURE() << "fp8 K/V accepted for head_dim 64";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 128"), std::string::npos) << e.what();
  }
  const std::string hf = test::make_hf_checkpoint("fp8-kv", "llama", "small", 5, "bf16");
  CudaEngine bf(hf, 2), f8(hf, 2, true);
  EXPECT_NE(f8.weights_note().find("fp8 K/V"), std::string::npos) << f8.weights_note();
  const int64_t T = 1500, E = bf.config().hidden_size, L = bf.config().num_layers;
  auto tokens = test::random_token_ids(std::random_device{}(), int(T), int(bf.config().vocab_size));
  std::vector<std::vector<float>> want(size_t(L), std::vector<float>(size_t(T * E))), got = want;
  auto grab = [&](std::vector<std::vector<float>>& into) {
    return [&into, E](int l, const float* dh, int64_t rows, int64_t p0, cudaStream_t s) {
      PDB_CUDA_CHECK(cudaMemcpyAsync(into[size_t(l)].data() + p0 * E, dh, size_t(rows * E) * 4, cudaMemcpyDeviceToHost, s));
      PDB_CUDA_CHECK(cudaStreamSynchronize(s));
    };
  };
  bf.prefill(tokens, 512, grab(want));
  f8.prefill(tokens, 512, grab(got));
  // The fused kernel (PDBRIDGE_FP8KV_FUSED=1) reads the same values as the expanded rows: the two paths
  // agree far more closely than either with bf16 K/V (only the attention kernels' summation order differs).
  setenv("PDBRIDGE_FP8KV_FUSED", "1", 1);
  CudaEngine fused(hf, 2, true);
  unsetenv("PDBRIDGE_FP8KV_FUSED");
  EXPECT_NE(fused.weights_note().find("fused"), std::string::npos) << fused.weights_note();
  EXPECT_EQ(f8.weights_note().find("fused"), std::string::npos) << f8.weights_note();
  auto got_fused = want;
  fused.prefill(tokens, 512, grab(got_fused));
  for (int64_t l = 0; l < L; ++l) {
    const double e = ref::rel_error(got[size_t(l)], want[size_t(l)]);
    const double ef = ref::rel_error(got_fused[size_t(l)], want[size_t(l)]);
    const double between = ref::rel_error(got_fused[size_t(l)], got[size_t(l)]);
    std::printf("FP8 K/V layer %lld input: rel err vs bf16 K/V %.2e (fused kernel %.2e; expanded vs fused %.2e)\n", (long long)l, e, ef,
                between);
    EXPECT_LT(e, l <= 1 ? (l == 0 ? 1e-7 : 5e-2) : 1e-1);  // e4m3 K/V: 3 mantissa bits, averaged by attention
    EXPECT_LT(ef, l <= 1 ? (l == 0 ? 1e-7 : 5e-2) : 1e-1);
    if (l >= 2) {
      EXPECT_LT(between, 0.5 * e) << "the two fp8 paths should read the same K/V values";
    }
  }
#endif
}

// `pdbridge prefill --device cuda` behind the front door, llama-server as the decoder: the bridge is
// complete, the decoder's cache hit is real, and the bridged state is close to the decoder's own.
TEST(CudaBridge, ServesTheBridgeEndToEndWithARealCacheHit) {
  PDB_SKIP_WITHOUT_GPU();
  struct Case { std::string dir, gguf; };
  for (const Case& c : {Case{test::models_dir() + "/llama-tiny", "f32"}, Case{test::models_dir() + "/llama-tiny", "q8_0"},
                       Case{test::models_dir() + "/qwen3moe-tiny", "f32"}, Case{deepseek2_small_dir(), "f32"}}) {
    const std::string& gguf = c.gguf;
    test::StackOptions so;
    so.model_dir = c.dir;
    so.decoder_type = gguf;
    so.prefill_extra = {"--device", "cuda"};
    test::Stack st(so);
    const std::string prompt = test::random_text(std::random_device{}(), 1200);
    nlohmann::json body = {{"prompt", prompt}, {"n_predict", 24}, {"temperature", 0}};
    auto r = st.post_front("/completion", body);
    ASSERT_EQ(r.status, 200) << r.body << st.logs();
    auto v = r.verdict();
    ASSERT_EQ(v.value("verdict", ""), "complete") << v.dump() << st.logs();
    const int64_t T = v["tokens"].get<int64_t>();
    const auto timings = r.json()["timings"];
    EXPECT_GE(timings["cache_n"].get<int64_t>(), T - 1) << timings.dump();
    EXPECT_LE(timings["prompt_n"].get<int64_t>(), 1) << timings.dump();
    body["cache_prompt"] = false;
    body["id_slot"] = 0;
    auto n = st.post_decoder("/completion", body);
    ASSERT_EQ(n.status, 200);
    const bool same = n.json()["content"] == r.json()["content"];
    std::printf("CUDA BRIDGE %s %s: %lld tokens complete, cache_n %lld, answer %s native\n", c.dir.c_str(), gguf.c_str(), (long long)T,
                (long long)timings["cache_n"].get<int64_t>(), same ? "==" : "!=");
  }
}

// `pdbridge prefill --device cuda --model decoder.gguf` (no checkpoint, no --recipe): the bridge is complete, the
// decoder's cache hit real. The default --kv-rows auto takes the engine's rows for the F16 file (its half products)
// and the recipe's for the quantized ones.
TEST(CudaBridge, ServesTheBridgeFromTheDecodersGgufAlone) {
  PDB_SKIP_WITHOUT_GPU();
  for (const std::string type : {"q4_0", "q8_0", "f16"}) {
    test::StackOptions so = test::gguf_alone_stack_options(type == "f16" ? "llama-tiny-h16" : "llama-tiny", type);
    so.prefill_extra = {"--device", "cuda"};
    test::Stack st(so);
    EXPECT_NE(st.logs().find(type == "f16" ? "cache rows from the engine's K/V products" : "cache rows recomputed by the decoder's recipe"),
              std::string::npos)
        << st.logs();
    const std::string prompt = test::random_text(std::random_device{}(), 1500);
    nlohmann::json body = {{"prompt", prompt}, {"n_predict", 16}, {"temperature", 0}};
    auto r = st.post_front("/completion", body);
    ASSERT_EQ(r.status, 200) << r.body << st.logs();
    ASSERT_EQ(r.verdict().value("verdict", ""), "complete") << r.verdict().dump() << st.logs();
    const auto timings = r.json()["timings"];
    EXPECT_GE(timings["cache_n"].get<int64_t>(), r.verdict()["tokens"].get<int64_t>() - 1) << timings.dump();
    body["cache_prompt"] = false;
    body["id_slot"] = 0;
    auto n = st.post_decoder("/completion", body);
    ASSERT_EQ(n.status, 200);
    std::printf("CUDA BRIDGE FROM GGUF llama-tiny %s: complete, answer %s native\n", type.c_str(),
                n.json()["content"] == r.json()["content"] ? "==" : "!=");
  }
}

// The GPU-bridged state against the state llama-server saves itself (the parity table's GPU rows).
TEST(CudaParity, BridgedStateAgainstTheDecodersOwn) {
  PDB_SKIP_WITHOUT_GPU();
  struct Case { std::string model, gguf, cache; };
  for (const Case& c : {Case{"llama-tiny", "f32", "f16"}, Case{"qwen3-tiny", "f32", "f16"}, Case{"llama-tiny", "f32", "q8_0"},
                       Case{"llama-tiny-h16", "f16", "f16"}, Case{"qwen3moe-tiny", "f32", "f16"}, Case{"qwen3moe-tiny", "f32", "q8_0"},
                       Case{"deepseek2-small", "f32", "f16"}, Case{"deepseek2-small", "q8_0", "q8_0"}}) {
    const std::string mdir = c.model == "deepseek2-small" ? deepseek2_small_dir() : test::models_dir() + "/" + c.model;
    test::Stack st(test::parity_stack_options(mdir, c.gguf, c.cache));
    const int T = 700;
    auto tokens = test::random_token_ids(std::random_device{}(), T, 100000);
    std::shared_ptr<const Recipe> recipe = Recipe::load(st.decoder_gguf, 2);
    auto backend = make_cuda_backend(mdir + "/hf", recipe, 2, 256);
    auto [native, ours, fid] = test::native_and_bridged_states(st, *backend, tokens, 256);
    auto layer0 = diff_states(native, ours, 1);
    auto all = diff_states(native, ours);
    ASSERT_TRUE(all.same_layout) << all.layout_note;
    double worst_rel = 0;
    std::string worst_tensor;
    for (const auto& t : all.tensors)
      if (t.rel_rms() >= worst_rel) { worst_rel = t.rel_rms(); worst_tensor = t.name; }
    std::printf("CUDA PARITY %s %s cache=%s decoder class %s (%s) layer0: %.4f%% identical, max ulp %lld | all: %.4f%% identical, max ulp %lld, max |d| %.3g, "
                "worst rel RMS %.3g (%s)\n",
                c.model.c_str(), c.gguf.c_str(), c.cache.c_str(), to_string(fid.cls), fid.isa.c_str(), layer0.pct_identical(), (long long)layer0.max_ulp(), all.pct_identical(),
                (long long)all.max_ulp(), all.max_abs(), worst_rel, worst_tensor.c_str());
    // The tolerance class (parity_test.cpp): the GPU engine's bf16 forward is not the decoder's arithmetic, so deeper
    // layers are bounded by their error's RMS relative to the values'. Not by the largest single element: on these
    // random MoE models a routing choice that flips between the two forwards moves single elements by ~0.4-0.55 on
    // fresh prompts (measured on the H200, 2026-12-03), which no summation-order bound describes.
    EXPECT_GE(layer0.pct_identical(), 99.0);
    EXPECT_LE(worst_rel, 0.05) << worst_tensor;
  }
}

// --kv-rows engine: the engine's own K/V products (of the decoder's GGUF) as the cache rows, against the decoder's own
// state and against the recipe's rows in the same run (deepseek2: its latent's product, normed and roped by the recipe). The engine's products take bf16 activations and bf16-expanded
// weights where the CPU decoder takes Q8/f16 ones: the tolerance class (rel RMS), not the mirrored one. Bounds: layer
// 0 within 1% RMS of the decoder's (bf16 rounding of the normed rows and the weights is ~0.3% per element), every
// layer within parity's 5%.
// Half products (an F16 GGUF): the rows are read inside the q|k|v product (rows wider than K's), in one pass for an
// f16 cache and through copies for a q8_0 one.
TEST(CudaParity, EngineKvRowsFromTheDecodersGguf) {
  PDB_SKIP_WITHOUT_GPU();
  struct Case { std::string model, gguf, cache; ProductNumerics numerics = ProductNumerics::bf16; };
  for (const Case& c : {Case{"llama-tiny", "q4_0", "f16"}, Case{"qwen3-tiny", "q8_0", "f16"}, Case{"llama-tiny", "f16", "q8_0"},
                       Case{"qwen3moe-tiny", "q8_0", "f16"}, Case{"deepseek2-small", "q8_0", "f16"},
                       Case{"llama-tiny-h16", "f16", "f16", ProductNumerics::half}, Case{"llama-tiny-h16", "f16", "q8_0", ProductNumerics::half},
                       Case{"deepseek2-small", "f16", "f16", ProductNumerics::half}}) {
    const std::string mdir = c.model == "deepseek2-small" ? deepseek2_small_dir() : test::models_dir() + "/" + c.model;
    test::Stack st(test::parity_stack_options(mdir, c.gguf, c.cache));
    const int T = 700;
    auto tokens = test::random_token_ids(std::random_device{}(), T, 100000);
    std::shared_ptr<const Recipe> recipe = Recipe::load(st.decoder_gguf, 2);
    double rel[2][2] = {};  // [decoder rows, engine rows][layer 0, worst layer]
    ParsedState bridged[2];
    for (int engine_rows = 0; engine_rows < 2; ++engine_rows) {
      auto backend = make_cuda_backend(st.decoder_gguf, recipe, 2, 256, false, 1, false, 0, engine_rows == 1, c.numerics);
      if (engine_rows) EXPECT_NE(backend->weights().find("engine's K/V products"), std::string::npos) << backend->weights();
      auto [native, ours, fid] = test::native_and_bridged_states(st, *backend, tokens, 256);
      bridged[engine_rows] = ours;
      const auto layer0 = diff_states(native, ours, 1), all = diff_states(native, ours);
      ASSERT_TRUE(all.same_layout) << all.layout_note;
      for (const auto& t : layer0.tensors) rel[engine_rows][0] = std::max(rel[engine_rows][0], t.rel_rms());
      for (const auto& t : all.tensors) rel[engine_rows][1] = std::max(rel[engine_rows][1], t.rel_rms());
      std::printf("CUDA KV ROWS %s %s cache=%s %s products, rows from the %s: layer0 %.4f%% identical, rel RMS %.3g | worst layer rel RMS %.3g\n",
                  c.model.c_str(), c.gguf.c_str(), c.cache.c_str(), product_numerics_name(c.numerics), engine_rows ? "engine" : "recipe", layer0.pct_identical(),
                  rel[engine_rows][0], rel[engine_rows][1]);
    }
    EXPECT_LE(rel[1][0], 0.01) << c.model << " " << c.gguf;
    EXPECT_LE(rel[1][1], 0.05) << c.model << " " << c.gguf;
    // --kv-rows auto's case: the recipe's products, made once. Layer 0's rows are the same up to summation order; deeper
    // layers within a few half ulps RMS (one is 4.9e-4 relative). On two H100 calls (session 47) all layers were once
    // 100% identical, once 44.7% (llama-tiny-h16) and 28.6% (deepseek2-small), both states then equally close to the
    // decoder's to four digits; what differed between those two backends' deeper layers was not isolated.
    if (c.numerics == ProductNumerics::half && c.cache == "f16") {
      const auto first = diff_states(bridged[0], bridged[1], 1), all = diff_states(bridged[0], bridged[1]);
      double worst = 0;
      for (const auto& t : all.tensors) worst = std::max(worst, t.rel_rms());
      std::printf("CUDA KV ROWS %s engine's rows against the recipe's: layer0 %.4f%% identical | all %.4f%% identical, worst rel RMS %.3g\n",
                  c.model.c_str(), first.pct_identical(), all.pct_identical(), worst);
      EXPECT_GE(first.pct_identical(), 99.0) << c.model << ": layer 0's rows under half products are the recipe's up to summation order";
      EXPECT_LE(worst, 2e-3) << c.model << ": deeper layers' rows within a few half ulps of the recipe's";
    }
  }
}

// --numerics: the engine's products of the decoder's GGUF rounded as each decoder class rounds them, against the CPU
// decoder's own state (llama-server on this host's CPU) and against bf16 products in the same run. Half products of an
// F16 GGUF are the decoder's own weights exactly with activations in half, as ggml-cpu converts them for F16 weights:
// they must come at least 2x closer than bf16's (measured 3x on the H200). The q8 activations of the cpu class are
// held to the tolerance class only: where the engine's attention (bf16) moves a product's inputs by more than a
// fraction of a Q8 step, quantizing them again adds a second rounding (measured on the needle model: docs/RESULTS.md).
TEST(CudaParity, DecoderNumericsFollowTheCpuDecoder) {
  PDB_SKIP_WITHOUT_GPU();
  struct Case { std::string model, gguf, cache, numerics; };
  for (const Case& c : {Case{"llama-tiny", "q8_0", "f16", "cpu"}, Case{"llama-tiny", "q4_0", "f16", "cpu"}, Case{"qwen3-tiny", "q8_0", "f16", "cpu"},
                       Case{"llama-tiny-h16", "f16", "f16", "half"}, Case{"qwen3moe-tiny", "q8_0", "f16", "cpu"}}) {
    const std::string mdir = test::models_dir() + "/" + c.model;
    test::Stack st(test::parity_stack_options(mdir, c.gguf, c.cache));
    auto tokens = test::random_token_ids(std::random_device{}(), 700, 100000);
    std::shared_ptr<const Recipe> recipe = Recipe::load(st.decoder_gguf, 2);
    double worst[2] = {}, mean[2] = {};
    for (int follow = 0; follow < 2; ++follow) {
      const ProductNumerics n = follow ? parse_product_numerics(c.numerics) : ProductNumerics::bf16;
      auto backend = make_cuda_backend(st.decoder_gguf, recipe, 2, 256, false, 1, false, 0, false, n);
      if (follow) EXPECT_NE(backend->weights().find("products ("), std::string::npos) << backend->weights();
      auto [native, ours, fid] = test::native_and_bridged_states(st, *backend, tokens, 256);
      const auto all = diff_states(native, ours);
      ASSERT_TRUE(all.same_layout) << all.layout_note;
      for (const auto& t : all.tensors) {
        worst[follow] = std::max(worst[follow], t.rel_rms());
        mean[follow] += t.rel_rms() / double(all.tensors.size());
      }
      std::printf("CUDA NUMERICS %s %s cache=%s %s products: mean rel RMS %.3g, worst %.3g\n", c.model.c_str(), c.gguf.c_str(),
                  c.cache.c_str(), product_numerics_name(n), mean[follow], worst[follow]);
    }
    if (c.numerics == "half") EXPECT_LT(mean[1], 0.5 * mean[0]) << c.model << " " << c.gguf << ": half products no closer to the decoder than bf16's";
    EXPECT_LE(worst[1], 0.05) << c.model << " " << c.gguf;
  }
}

// --numerics is refused where it cannot follow the decoder, before anything loads onto a GPU; auto resolves per GGUF.
TEST(CudaBridge, DecoderNumericsOnlyFromTheDecodersGguf) {
  const std::string mdir = test::models_dir() + "/llama-tiny";
  BackendOptions o{.model = mdir + "/hf", .recipe = mdir + "/decoder-q8_0.gguf", .device = "cuda", .numerics = "cpu"};
  auto refused = [&](const std::string& needle) {
    try {
      architecture("llama").make_backend(o);
      ADD_FAILURE() << "accepted " << o.model << " " << o.device << " " << o.numerics;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused("needs --model to be the decoder's GGUF");
  o.model = o.recipe;
  o.device = "cpu";
  refused("is for --device cuda");
  o.device = "cuda";
  o.numerics = "metal";
  refused("bf16, half (Metal), cpu (ggml-cpu) or cuda (ggml-cuda)");
  // auto: half products for a GGUF of float layer weights, bf16 for a quantized one, a checkpoint or the CPU
  o.numerics = "auto";
  EXPECT_EQ(resolve_numerics(o), ProductNumerics::bf16);  // q8_0
  o.model = mdir + "/decoder-f16.gguf";
  EXPECT_EQ(resolve_numerics(o), ProductNumerics::half);
  o.model = mdir + "/decoder-f32.gguf";
  EXPECT_EQ(resolve_numerics(o), ProductNumerics::half);
  o.device = "cpu";
  EXPECT_EQ(resolve_numerics(o), ProductNumerics::bf16);
  o.device = "cuda";
  o.model = mdir + "/hf";
  EXPECT_EQ(resolve_numerics(o), ProductNumerics::bf16);
}

// --kv-rows engine is refused where the engine's K/V are not the decoder's rows, before anything loads onto a GPU.
TEST(CudaBridge, EngineKvRowsOnlyFromTheDecodersGguf) {
  const std::string mdir = test::models_dir() + "/llama-tiny";
  BackendOptions o{.model = mdir + "/hf", .recipe = mdir + "/decoder-q8_0.gguf", .device = "cuda", .kv_rows = "engine"};
  auto refused = [&](const std::string& needle) {
    try {
      architecture("llama").make_backend(o);
      ADD_FAILURE() << "accepted " << o.model << " " << o.device;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused("needs --model to be the decoder's GGUF");
  o.model = mdir + "/decoder-q4_0.gguf";
  refused("not the decoder's");
  o.device = "cpu";
  refused("for --device cuda");
  o.kv_rows = "mine";
  refused("auto, decoder or engine");
}

// --kv-rows auto: the engine's rows only where they are the recipe's arithmetic (the GGUF itself, F16 q/k/v, half
// products); everything else keeps the recipe's. Decided before anything loads onto a GPU.
TEST(CudaBridge, EngineKvRowsUnderAutoOnlyWhereTheyAreTheRecipes) {
  const std::string h16 = test::models_dir() + "/llama-tiny-h16/decoder-f16.gguf", q8 = test::models_dir() + "/llama-tiny/decoder-q8_0.gguf";
  auto recipe_of = [](const std::string& g) { return Recipe::load(g, 1)->info(); };
  BackendOptions o{.model = h16, .recipe = h16, .device = "cuda", .kv_rows = "auto"};
  EXPECT_TRUE(kv_rows_from_engine(o, ProductNumerics::half, recipe_of(h16)));
  EXPECT_FALSE(kv_rows_from_engine(o, ProductNumerics::bf16, recipe_of(h16))) << "bf16 products are not the decoder's";
  o.device = "cpu";
  EXPECT_FALSE(kv_rows_from_engine(o, ProductNumerics::half, recipe_of(h16)));
  o = BackendOptions{.model = q8, .recipe = q8, .device = "cuda", .kv_rows = "auto"};
  EXPECT_FALSE(kv_rows_from_engine(o, ProductNumerics::half, recipe_of(q8))) << "Q8_0 q/k/v: the recipe's Q8 activations";
  o = BackendOptions{.model = test::models_dir() + "/llama-tiny-h16/hf", .recipe = h16, .device = "cuda", .kv_rows = "auto"};
  EXPECT_FALSE(kv_rows_from_engine(o, ProductNumerics::half, recipe_of(h16))) << "a checkpoint's products";
  o.kv_rows = "decoder";
  o.model = h16;
  EXPECT_FALSE(kv_rows_from_engine(o, ProductNumerics::half, recipe_of(h16)));
  // MLA: its latent rows are kv_a's product, F16 in the F16 GGUF (the recipe's product under half products)
  const std::string d16 = test::models_dir() + "/deepseek2-tiny/decoder-f16.gguf", d8 = test::models_dir() + "/deepseek2-tiny/decoder-q8_0.gguf";
  o = BackendOptions{.model = d16, .recipe = d16, .device = "cuda", .kv_rows = "auto"};
  EXPECT_FALSE(kv_rows_from_engine(o, ProductNumerics::half, recipe_of(d16))) << "not the default for MLA (measured no faster)";
  setenv("PDBRIDGE_MLA_AUTO_ROWS", "1", 1);
  EXPECT_TRUE(kv_rows_from_engine(o, ProductNumerics::half, recipe_of(d16))) << "deepseek2's F16 kv_a";
  EXPECT_FALSE(kv_rows_from_engine(o, ProductNumerics::bf16, recipe_of(d16)));
  o = BackendOptions{.model = d8, .recipe = d8, .device = "cuda", .kv_rows = "auto"};
  EXPECT_FALSE(kv_rows_from_engine(o, ProductNumerics::half, recipe_of(d8))) << "deepseek2's Q8_0 kv_a";
  unsetenv("PDBRIDGE_MLA_AUTO_ROWS");
}

// The CUDA engine's chunk where none is asked for: 4,096 tokens, a MoE block's doubled until its routed experts
// average 512 rows (chunk x top-k / experts), at most 16,384. Also: BackendOptions and the bench leave it to the engine.
TEST(CudaEngine, DefaultChunkGivesTheRoutedExpertsAbout512Rows) {
  EXPECT_EQ(CudaMoeFfn::full_products_chunk(128, 8), 8192) << "Qwen3-30B-A3B";
  EXPECT_EQ(CudaMoeFfn::full_products_chunk(64, 6), 8192) << "DeepSeek-V2-Lite";
  EXPECT_EQ(CudaMoeFfn::full_products_chunk(256, 8), 16384) << "DeepSeek-V3";
  EXPECT_EQ(CudaMoeFfn::full_products_chunk(8, 2), 4096) << "Mixtral";
  EXPECT_EQ(CudaMoeFfn::full_products_chunk(512, 2), 16384) << "capped";
  EXPECT_EQ(BackendOptions{}.chunk, 0);
}

}  // namespace pdb
