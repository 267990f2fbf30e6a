// cuDNN's MoE grouped matmul (grouped_gemm_cudnn.h) and cuBLAS's batched products over the engine's padded chunks
// against the f64 products of each expert, and the same-run speed of the expert products every way the engine can run
// them (issue 36's A/B). Runs where a GPU (and for cuDNN's, cuDNN) is present; skips, saying which is missing, elsewhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "numerics/reference_ops.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include <cuda_bf16.h>

#include "cuda/grouped_gemm.cuh"
#include "cuda/grouped_gemm_cudnn.h"
#include "cuda/kernel_test_support.h"
#include "model/cuda_moe_ffn.h"
#include "model/moe_padding.h"
#endif

namespace pdb {
#ifdef PDBRIDGE_HAVE_CUDA
using namespace test_kernels;

namespace {
// Expert e's rows start at first[e]; y[r] = x[index ? index[r] : r] . w[e]^T in f64.
std::vector<float> expert_products(const std::vector<float>& x, const std::vector<int32_t>* index, const std::vector<float>& w,
                                   const std::vector<int32_t>& first, int64_t rows, int64_t in, int64_t out) {
  std::vector<float> y(size_t(rows * out));
  const int64_t E = int64_t(first.size());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r1 = e + 1 < E ? first[size_t(e + 1)] : rows;
    for (int64_t r = first[size_t(e)]; r < r1; ++r) {
      const int64_t src = index ? (*index)[size_t(r)] : r;
      for (int64_t o = 0; o < out; ++o) {
        double acc = 0;
        for (int64_t i = 0; i < in; ++i) acc += double(x[size_t(src * in + i)]) * double(w[size_t((e * out + o) * in + i)]);
        y[size_t(r * out + o)] = float(acc);
      }
    }
  }
  return y;
}
}  // namespace

// The engine's padded layout with two chunk sizes (skewed experts: the large ones in chunks of 512 and their
// remainders in chunks of 192 as the small ones are, an empty expert, one of a single row): every padded row, each
// multiplied by its expert's weights, equals the f64 product. Needs a GPU only.
TEST(CudaGroupedGemm, ChunksOfTwoSizesMatchEachExpertsF64Product) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
  const int64_t in = 256, out = 384;
  const std::vector<int32_t> counts = {700, 700, 0, 700, 700, 140, 140, 140, 140, 1, 140, 140, 140, 140};
  const int64_t E = int64_t(counts.size());
  const PaddedExperts pad = pad_experts(counts.data(), E, INT32_MAX, 1);
  ASSERT_EQ(pad.classes.size(), 2u) << "these counts take a large and a small chunk size";
  auto w = round_bf16(randn(size_t(E * out * in), 0.05f));
  auto x = round_bf16(randn(size_t(pad.rows * in)));
  const auto want = expert_products(x, nullptr, w, pad.offsets, pad.rows, in, out);
  auto dw = to_device_bf16(w), dx = to_device_bf16(x);
  auto dy = poisoned(size_t(pad.rows * out) * 2);
  cuda::GroupedGemm grouped;
  grouped.xwt_chunks(dx.get(), dw.get(), dy.get(), chunk_spans(pad), in, out, cuda::DType::BF16, nullptr);
  PDB_CUDA_CHECK(cudaDeviceSynchronize());
  const double err = ref::rel_error(from_device_bf16(dy, want.size()), want);
  std::printf("chunks of %lld and %lld over %lld experts, %lld padded rows: rel err %.2e\n", (long long)pad.classes[0].cap,
              (long long)pad.classes[1].cap, (long long)E, (long long)pad.rows, err);
  EXPECT_LT(err, 1e-2);
}

// Uneven experts: empty ones (the first, the last, one between), one with a single row, the rest random; with and
// without the gather index; widths of qwen3moe's gate|up and down at a small scale.
TEST(CudaGroupedGemm, CudnnMatchesEachExpertsF64Product) {
  SKIP_WITHOUT_GPU_AND_CUDNN();
  const int64_t E = 9, in = 256, out = 384, tokens = 150;
  const std::vector<int64_t> counts = {0, 37, 1, 120, 0, 64, 200, 29, 0};
  std::vector<int32_t> first;
  int64_t rows = 0;
  for (int64_t c : counts) {
    first.push_back(int32_t(rows));
    rows += c;
  }
  auto w = round_bf16(randn(size_t(E * out * in), 0.05f));
  auto dw = to_device_bf16(w);
  cuda::DeviceBuffer dfirst(first.size() * 4);
  dfirst.upload(first.data(), first.size() * 4);
  for (const bool gather : {false, true}) {
    std::vector<int32_t> route(static_cast<size_t>(rows));
    for (auto& i : route) i = int32_t(rng()() % tokens);
    auto x = round_bf16(randn(size_t((gather ? tokens : rows) * in)));
    const auto want = expert_products(x, gather ? &route : nullptr, w, first, rows, in, out);
    auto dx = to_device_bf16(x);
    cuda::DeviceBuffer dindex(route.size() * 4);
    dindex.upload(route.data(), route.size() * 4);
    auto dy = poisoned(size_t(rows * out) * 2);
    cuda::MoeGroupedShape s{rows, E, in, out, gather ? tokens : 0};
    try {
      cuda::moe_grouped_xwt_cudnn(dx.as<__nv_bfloat16>(), gather ? dindex.as<int32_t>() : nullptr, dw.as<__nv_bfloat16>(), dfirst.as<int32_t>(),
                                  dy.as<__nv_bfloat16>(), s, nullptr);
    } catch (const std::exception& e) {
      // A cuDNN without the operation (9.19 as PyTorch ships it, on the H200: the descriptor type is unknown to it)
      // is a missing peer, not a wrong result; anything else fails.
      if (std::string(e.what()).find("creating a descriptor failed") != std::string::npos) GTEST_SKIP() << "this cuDNN has no MoE grouped matmul: " << e.what();
      ADD_FAILURE() << (gather ? "gather: " : "grouped rows: ") << e.what();
      continue;
    }
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const double err = ref::rel_error(from_device_bf16(dy, want.size()), want);
    std::printf("cudnn MoE grouped matmul %s, %lld rows over %lld experts: rel err %.2e (%s)\n", gather ? "gather" : "grouped rows", (long long)rows,
                (long long)E, err, cuda::cudnn_moe_stats().last_engine.c_str());
    EXPECT_LT(err, 1e-2);
  }
}

// Same run, same inputs: the expert products of one MoE layer (gate|up then down) for a chunk of tokens through
// cuBLAS's grouped call, one cuBLAS product per expert, one strided batched product over experts padded to the
// largest one's rows, and cuDNN (grouped rows, and reading the tokens through the index). Routing: uniform at random,
// then skewed (expert e drawn with weight (e+1)^-0.6: the largest expert ~3x the mean). Shapes: Qwen3-30B-A3B (128
// experts, top 8, 2048 -> 2 x 768) and DeepSeek-V2-Lite (64, top 6, 2048 -> 2 x 1408). TFLOP/s count the routed
// rows only. Opt-in (PDBRIDGE_BENCH_MOE=1); the chunk's tokens in PDBRIDGE_BENCH_MOE_T (default 4096, the engine's
// chunk; comma separated), the ways in PDBRIDGE_BENCH_MOE_WAYS; JSON lines to PDBRIDGE_BENCH_OUT.
TEST(CudaGroupedGemmBench, CublasAndCudnnSameRun) {
  if (!std::getenv("PDBRIDGE_BENCH_MOE")) GTEST_SKIP() << "a benchmark: PDBRIDGE_BENCH_MOE=1 runs it";
  SKIP_WITHOUT_GPU_AND_CUDNN();
  std::ofstream jout;
  if (const char* p = std::getenv("PDBRIDGE_BENCH_OUT")) jout.open(p, std::ios::app);
  struct Shape { const char* name; int64_t E, k, H, F; };
  auto list = [](const char* env, const char* fallback) {
    std::vector<std::string> v;
    std::string s = std::getenv(env) ? std::getenv(env) : fallback;
    for (size_t at = 0; at <= s.size();) {
      const size_t comma = std::min(s.find(',', at), s.size());
      if (comma > at) v.push_back(s.substr(at, comma - at));
      at = comma + 1;
    }
    return v;
  };
  const auto ways = list("PDBRIDGE_BENCH_MOE_WAYS", "grouped,loop,padded,chunks-one,chunks,cudnn,cudnn-gather");
  for (const std::string& tokens : list("PDBRIDGE_BENCH_MOE_T", "4096"))  // the chunk's tokens (the engine's --chunk)
  for (const Shape sh : {Shape{"qwen3-30b-a3b", 128, 8, 2048, 768}, Shape{"deepseek-v2-lite", 64, 6, 2048, 1408}})
  for (const bool skewed : {false, true}) {
    const int64_t T = std::stoll(tokens);
    const int64_t g = T * sh.k;
    std::vector<double> cdf;
    for (int64_t e = 0; e < sh.E; ++e) cdf.push_back((cdf.empty() ? 0.0 : cdf.back()) + (skewed ? std::pow(double(e + 1), -0.6) : 1.0));
    std::vector<int64_t> counts(size_t(sh.E), 0);
    std::vector<int32_t> index;  // token of each grouped row, expert after expert
    std::vector<std::vector<int32_t>> by_expert(size_t(sh.E));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int64_t> picks;
      while (int64_t(picks.size()) < sh.k) {
        const double u = double(rng()()) / 4294967296.0 * cdf.back();
        const int64_t e = std::min<int64_t>(sh.E - 1, std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
        if (std::find(picks.begin(), picks.end(), e) == picks.end()) picks.push_back(e);
      }
      for (int64_t e : picks) by_expert[size_t(e)].push_back(int32_t(t));
    }
    std::vector<int32_t> first;
    int64_t largest = 0;
    for (int64_t e = 0; e < sh.E; ++e) {
      first.push_back(int32_t(index.size()));
      counts[size_t(e)] = int64_t(by_expert[size_t(e)].size());
      largest = std::max(largest, counts[size_t(e)]);
      index.insert(index.end(), by_expert[size_t(e)].begin(), by_expert[size_t(e)].end());
    }
    const int64_t cap = (largest + 63) / 64 * 64;
    std::vector<int32_t> counts32(counts.begin(), counts.end());
    const PaddedExperts pad = pad_experts(counts32.data(), sh.E, INT32_MAX, 1), one = pad_experts(counts32.data(), sh.E, INT32_MAX, 1, false);
    const char* routing = skewed ? "skewed" : "uniform";
    std::printf("MOE BENCH T=%lld %s %s routing: %lld rows, largest expert %lld (mean %.0f), padded to %lld: %.0f%% padding; chunks of %lld: %.0f%%; "
                "chunks of %lld and %lld: %.0f%%\n",
                (long long)T, sh.name, routing, (long long)g, (long long)largest, double(g) / double(sh.E), (long long)cap, 100.0 * (double(cap * sh.E) / double(g) - 1),
                (long long)one.cap(), 100.0 * (double(one.rows) / double(g) - 1), (long long)pad.cap(),
                (long long)(pad.classes.size() > 1 ? pad.classes[1].cap : 0), 100.0 * (double(pad.rows) / double(g) - 1));
    std::fflush(stdout);
    auto dx = to_device_bf16(randn(size_t(T * sh.H)));
    const int64_t ymax = std::max({g, cap * sh.E, pad.rows, one.rows});
    auto dxg = to_device_bf16(randn(size_t(ymax * sh.H)));
    auto dgu = to_device_bf16(randn(size_t(sh.E * 2 * sh.F * sh.H), 0.02f));
    auto ddown = to_device_bf16(randn(size_t(sh.E * sh.H * sh.F), 0.02f));
    auto dact = to_device_bf16(randn(size_t(ymax * sh.F)));
    cuda::DeviceBuffer dy1(size_t(ymax * 2 * sh.F) * 2), dy2(size_t(ymax * sh.H) * 2), dfirst(first.size() * 4), dindex(index.size() * 4);
    dfirst.upload(first.data(), first.size() * 4);
    dindex.upload(index.data(), index.size() * 4);
    const double flops = 2.0 * double(g) * double(sh.H) * double(2 * sh.F) + 2.0 * double(g) * double(sh.F) * double(sh.H);
    cuda::GroupedGemm grouped(false), loop(true);
    auto run = [&](const std::string& way) {
      if (way == "cudnn" || way == "cudnn-gather") {
        const bool gather = way == "cudnn-gather";
        cuda::moe_grouped_xwt_cudnn(gather ? dx.as<__nv_bfloat16>() : dxg.as<__nv_bfloat16>(), gather ? dindex.as<int32_t>() : nullptr,
                                    dgu.as<__nv_bfloat16>(), dfirst.as<int32_t>(), dy1.as<__nv_bfloat16>(), {g, sh.E, sh.H, 2 * sh.F, gather ? T : 0}, nullptr);
        cuda::moe_grouped_xwt_cudnn(dact.as<__nv_bfloat16>(), nullptr, ddown.as<__nv_bfloat16>(), dfirst.as<int32_t>(), dy2.as<__nv_bfloat16>(),
                                    {g, sh.E, sh.F, sh.H, 0}, nullptr);
        return;
      }
      if (way == "chunks" || way == "chunks-one") {  // the engine's default: model/moe_padding.h's chunks (one size or two)
        const PaddedExperts& pp = way == "chunks" ? pad : one;
        padded_products(grouped, pp, sh.E, dxg.get(), dgu.get(), dy1.get(), sh.H, 2 * sh.F, nullptr);
        padded_products(grouped, pp, sh.E, dact.get(), ddown.get(), dy2.get(), sh.F, sh.H, nullptr);
        return;
      }
      if (way == "padded") {
        grouped.xwt_padded(dxg.get(), dgu.get(), dy1.get(), cap, sh.E, sh.H, 2 * sh.F, cuda::DType::BF16, nullptr);
        grouped.xwt_padded(dact.get(), ddown.get(), dy2.get(), cap, sh.E, sh.F, sh.H, cuda::DType::BF16, nullptr);
        return;
      }
      std::vector<cuda::GroupedProduct> up(size_t(sh.E)), down(size_t(sh.E));
      for (int64_t e = 0; e < sh.E; ++e) {
        const int64_t off = first[size_t(e)], n = counts[size_t(e)];
        up[size_t(e)] = {dxg.as<__nv_bfloat16>() + off * sh.H, dgu.as<__nv_bfloat16>() + e * 2 * sh.F * sh.H, dy1.as<__nv_bfloat16>() + off * 2 * sh.F, n};
        down[size_t(e)] = {dact.as<__nv_bfloat16>() + off * sh.F, ddown.as<__nv_bfloat16>() + e * sh.H * sh.F, dy2.as<__nv_bfloat16>() + off * sh.H, n};
      }
      auto& gg = way == "loop" ? loop : grouped;
      gg.xwt(up, sh.H, 2 * sh.F, cuda::DType::BF16, nullptr);
      gg.xwt(down, sh.F, sh.H, cuda::DType::BF16, nullptr);
    };
    for (const std::string& way : ways) {
      try {
        run(way);
        run(way);
      } catch (const std::exception& e) {
        std::printf("MOE BENCH T=%lld %s %s %s: refused: %s\n", (long long)T, sh.name, routing, way.c_str(), e.what());
        continue;
      }
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      const double ms = mean_ms(20, [&] { run(way); }), tf = flops / (ms * 1e-3) / 1e12;
      std::printf("MOE BENCH T=%lld %s %s %s: %.3f ms per layer's expert products, %.0f TFLOP/s%s\n", (long long)T, sh.name, routing, way.c_str(), ms, tf,
                  way.rfind("cudnn", 0) == 0 ? (" (" + cuda::cudnn_moe_stats().last_engine + ")").c_str() : "");
      std::fflush(stdout);  // a time limit that cuts the run short keeps the rows measured
      if (jout)
        jout << "{\"bench\":\"moe_products\",\"shape\":\"" << sh.name << "\",\"routing\":\"" << routing << "\",\"tokens\":" << T << ",\"way\":\"" << way << "\",\"ms\":" << ms
             << ",\"tflops\":" << tf << ",\"device\":\"" << cuda::device_summary() << "\"}\n";
    }
  }
}
#endif

}  // namespace pdb
