// cuDNN's fused attention (attention_cudnn.h) against the f64 twin, and the same-run speed of our kernels and cuDNN's
// (issue 36's A/B). Runs where a GPU and cuDNN are present; skips, saying which is missing, elsewhere.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "cuda/device.h"
#include "numerics/reference_ops.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include <cuda_bf16.h>

#include "cuda/attention.cuh"
#include "cuda/attention_cudnn.h"
#include "cuda/kernel_test_support.h"
#endif

namespace pdb {
#ifdef PDBRIDGE_HAVE_CUDA
using namespace test_kernels;

// Chunks at the start of a prompt and in its middle (the mask's diagonal at the bottom right), ragged lengths, GQA
// groups of 1-4, head_dim 64 and 128, and MLA's 192-wide keys with 128-wide values. Keys past the last hold NaN.
TEST(CudaAttention, CudnnMatchesTheF64TwinForEveryShapeAndChunk) {
  SKIP_WITHOUT_GPU_AND_CUDNN();
  struct Case { int H, KV, D, DV; int64_t pos0, n_q; };
  for (const Case c : {Case{8, 2, 128, 128, 0, 300}, Case{8, 8, 128, 128, 0, 129}, Case{4, 1, 128, 128, 200, 137}, Case{4, 2, 128, 128, 300, 400},
                       Case{8, 2, 64, 64, 64, 64}, Case{4, 4, 192, 128, 100, 77}, Case{32, 8, 128, 128, 4096, 1024}}) {
    const int64_t cap = c.pos0 + c.n_q + 5;
    auto q = round_bf16(randn(size_t(c.n_q * c.H * c.D)));
    auto k = round_bf16(randn(size_t(c.KV * cap * c.D)));
    auto v = round_bf16(randn(size_t(c.KV * cap * c.DV)));
    for (int h = 0; h < c.KV; ++h)
      for (int64_t j = c.pos0 + c.n_q; j < cap; ++j) {
        for (int d = 0; d < c.D; ++d) k[size_t((h * cap + j) * c.D + d)] = NAN;
        for (int d = 0; d < c.DV; ++d) v[size_t((h * cap + j) * c.DV + d)] = NAN;
      }
    const float scale = 1.0f / std::sqrt(float(c.D));
    std::vector<float> ref;
    ref::causal_attention(q, k, v, ref, c.n_q, c.pos0, c.H, c.KV, c.D, cap, scale, c.DV);
    auto dq = to_device_bf16(q), dk = to_device_bf16(k), dv = to_device_bf16(v);
    cuda::AttentionShape s{c.n_q, c.pos0, c.H, c.KV, c.D, cap, scale, c.DV == c.D ? 0 : c.DV};
    auto dout = poisoned(ref.size() * 2);
    try {
      cuda::causal_attention_cudnn(dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(), dout.as<__nv_bfloat16>(), s, nullptr);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "H=" << c.H << " KV=" << c.KV << " D=" << c.D << "/" << c.DV << " pos0=" << c.pos0 << " n_q=" << c.n_q << ": " << e.what();
      continue;
    }
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const double err = ref::rel_error(from_device_bf16(dout, ref.size()), ref);
    std::printf("cudnn attention H=%d KV=%d D=%d/%d pos0=%lld n_q=%lld: rel err %.2e (%s)\n", c.H, c.KV, c.D, c.DV, (long long)c.pos0,
                (long long)c.n_q, err, cuda::cudnn_attention_stats().last_engine.c_str());
    EXPECT_LT(err, 1e-2);
  }
}

// The plan's queries padded to a bucket of 256 rows (q_rows: the buffers hold more): the real rows are the twin's while
// the q rows past n_q hold NaN and the cache's rows past the keys hold other finite values (as the engine keeps them),
// and a second chunk length in the same bucket builds no plan of its own.
TEST(CudaAttention, CudnnBucketedQueriesMatchTheTwinAndShareOnePlan) {
  SKIP_WITHOUT_GPU_AND_CUDNN();
  struct Case { int H, KV; int64_t pos0, n_q, other_n_q; };
  for (const Case c : {Case{8, 2, 0, 300, 290}, Case{4, 1, 200, 137, 140}, Case{8, 2, 4096, 1000, 1020}}) {
    const int D = 128;
    const int64_t q_rows = 1024 + 512, cap = c.pos0 + q_rows;
    auto k = round_bf16(randn(size_t(c.KV * cap * D)));
    auto v = round_bf16(randn(size_t(c.KV * cap * D)));
    auto dk = to_device_bf16(k), dv = to_device_bf16(v);
    const float scale = 1.0f / std::sqrt(float(D));
    int64_t plans_before = 0;
    for (const int64_t n_q : {c.n_q, c.other_n_q}) {
      auto q = round_bf16(randn(size_t(q_rows * c.H * D)));
      for (size_t i = size_t(n_q * c.H * D); i < q.size(); ++i) q[i] = NAN;
      std::vector<float> ref;
      ref::causal_attention(std::vector<float>(q.begin(), q.begin() + n_q * c.H * D), k, v, ref, n_q, c.pos0, c.H, c.KV, D, cap, scale, D);
      auto dq = to_device_bf16(q);
      auto dout = poisoned(size_t(q_rows * c.H * D) * 2);
      cuda::AttentionShape s{n_q, c.pos0, c.H, c.KV, D, cap, scale, 0, q_rows};
      if (n_q == c.n_q) plans_before = cuda::cudnn_attention_stats().plans;
      cuda::causal_attention_cudnn(dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(), dout.as<__nv_bfloat16>(), s, nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      const double err = ref::rel_error(from_device_bf16(dout, ref.size()), ref);
      std::printf("cudnn attention, bucketed: H=%d KV=%d pos0=%lld n_q=%lld (buffers %lld rows): rel err %.2e\n", c.H, c.KV, (long long)c.pos0,
                  (long long)n_q, (long long)q_rows, err);
      EXPECT_LT(err, 1e-2) << "n_q " << n_q;
    }
    EXPECT_EQ(cuda::cudnn_attention_stats().plans - plans_before, 1) << "two chunk lengths in one bucket: one plan";
  }
}

// Same run, same inputs: our default kernel and cuDNN's at Llama-8B's attention shape (32 heads, 8 KV heads, head
// 128), a whole prompt in one call and in the engine's 4096-query chunks. Opt-in (PDBRIDGE_BENCH_ATTN=1, lengths in
// PDBRIDGE_BENCH_ATTN_T, default 8192,32768,131072); JSON lines to PDBRIDGE_BENCH_OUT when set.
TEST(CudaAttentionBench, OursAndCudnnSameRun) {
  if (!std::getenv("PDBRIDGE_BENCH_ATTN")) GTEST_SKIP() << "a benchmark: PDBRIDGE_BENCH_ATTN=1 runs it";
  SKIP_WITHOUT_GPU_AND_CUDNN();
  std::vector<int64_t> lengths = {8192, 32768, 131072};
  if (const char* e = std::getenv("PDBRIDGE_BENCH_ATTN_T")) {
    lengths.clear();
    for (std::string t, s = e; !s.empty();) {
      const size_t comma = s.find(',');
      t = s.substr(0, comma);
      lengths.push_back(std::stoll(t));
      s = comma == std::string::npos ? "" : s.substr(comma + 1);
    }
  }
  std::ofstream out;
  if (const char* p = std::getenv("PDBRIDGE_BENCH_OUT")) out.open(p, std::ios::app);
  const int H = 32, KV = 8, D = 128;
  const int64_t chunk = 4096;
  for (const int64_t T : lengths) {
    auto dq = to_device_bf16(randn(size_t(T * H * D))), dk = to_device_bf16(randn(size_t(KV * T * D))), dv = to_device_bf16(randn(size_t(KV * T * D)));
    cuda::DeviceBuffer dout(size_t(T * H * D) * 2);
    const double flops = 4.0 * H * D * double(T) * double(T + 1) / 2;
    for (const bool chunked : {false, true}) {
      auto run = [&](bool cudnn) {
        for (int64_t p0 = 0; p0 < T; p0 += chunked ? chunk : T) {
          const int64_t n = chunked ? std::min(chunk, T - p0) : T;
          cuda::AttentionShape s{n, p0, H, KV, D, T, 1.0f / std::sqrt(float(D))};
          const auto* q = dq.as<__nv_bfloat16>() + p0 * H * D;
          auto* o = dout.as<__nv_bfloat16>() + p0 * H * D;
          if (cudnn) cuda::causal_attention_cudnn(q, dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(), o, s, nullptr);
          else cuda::causal_attention(q, dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(), o, s, nullptr, cuda::AttentionTuning{});
        }
      };
      double ms[2] = {0, 0};
      for (const bool cudnn : {false, true}) {
        const double build0 = cuda::cudnn_attention_stats().plan_build_ms;
        run(cudnn);  // warm-up: cuDNN's plans are built here
        run(cudnn);
        PDB_CUDA_CHECK(cudaDeviceSynchronize());
        const double build_ms = cuda::cudnn_attention_stats().plan_build_ms - build0;
        ms[cudnn] = mean_ms(T >= 131072 ? 2 : 5, [&] { run(cudnn); });
        const char* name = cudnn ? "cudnn" : "ours";
        std::printf("ATTN BENCH T=%lld %s %s: %.3f ms, %.0f TFLOP/s%s\n", (long long)T, chunked ? "chunks of 4096" : "one call", name, ms[cudnn],
                    flops / (ms[cudnn] * 1e-3) / 1e12, cudnn ? (", plans built in " + std::to_string(int(build_ms)) + " ms, " + cuda::cudnn_attention_stats().last_engine).c_str() : "");
        if (out)
          out << "{\"bench\":\"attention\",\"T\":" << T << ",\"chunked\":" << (chunked ? "true" : "false") << ",\"kernel\":\"" << name
              << "\",\"ms\":" << ms[cudnn] << ",\"tflops\":" << flops / (ms[cudnn] * 1e-3) / 1e12 << ",\"plan_build_ms\":" << (cudnn ? build_ms : 0)
              << ",\"device\":\"" << cuda::device_summary() << "\"}\n";
      }
      std::printf("ATTN BENCH T=%lld %s: cuDNN / ours = %.2fx\n", (long long)T, chunked ? "chunks of 4096" : "one call", ms[0] / ms[1]);
    }
  }
}
#endif

}  // namespace pdb
