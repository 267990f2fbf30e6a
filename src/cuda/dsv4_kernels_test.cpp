// DeepSeek-V4's kernels against their CPU twins (numerics/deepseek4_blocks.h) on fresh random inputs: the lightning
// indexer (cuda/dsv4_indexer.cuh against dsv4_indexer_select: the weighted ReLU scores of every visible block, and
// the top-k set, where a block may differ only where its score ties the k-th within the products' rounding), the
// sparse attention (cuda/dsv4_attention.cuh against dsv4_attend), the mixes, the rotation and MXFP4. Skips without
// a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <random>
#include <set>
#include <string>

#include "cuda/device.h"
#include "formats/ggml_types.h"
#include "formats/numeric.h"
#include "numerics/deepseek4_blocks.h"
#include "recipes/recipe.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include "cuda/common.cuh"
#include "cuda/dsv4.cuh"
#include "cuda/dsv4_attention.cuh"
#include "cuda/dsv4_indexer.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/f32_narrow.cuh"
#include "cuda/f32_tensor.cuh"
#include "cuda/gemm.cuh"
#include "cuda/moe.cuh"
#include "cuda/q8_gemm.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/kernel_test_support.h"
#endif

namespace pdb {

#ifdef PDBRIDGE_HAVE_CUDA
// sum over heads of |w[t][h]| max(0, q[t][h] . k[b]) for every (t, b < n_blocks), in f64
static std::vector<double> indexer_term_magnitudes(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& w, int64_t n_q, int heads,
                                            int dim, int64_t n_blocks) {
  std::vector<double> out(size_t(n_q * n_blocks), 0.0);
  for (int64_t t = 0; t < n_q; ++t)
    for (int h = 0; h < heads; ++h) {
      const float* qr = q.data() + (t * heads + h) * dim;
      for (int64_t b = 0; b < n_blocks; ++b) {
        double dot = 0;
        for (int i = 0; i < dim; ++i) dot += double(qr[i]) * k[size_t(b * dim + i)];
        out[size_t(t * n_blocks + b)] += std::fabs(double(w[size_t(t * heads + h)])) * std::max(0.0, dot);
      }
    }
  return out;
}
#endif

TEST(CudaKernels, Dsv4IndexerScoresAndTopKMatchTheCpuTwin) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  struct Case { int heads; int64_t n_q, pos0; int top_k; };
  // few blocks visible (every one taken, then -1), many (the selection proper), V4-Flash's 64 heads; each case
  // through the GEMM path and, where they take the head count, the fused scores in bf16 and in FP8 (the FP8 path
  // against the scores of its operands' values; an odd n_q: a part-filled block; 4 to 32 heads: a query's rows padded)
  for (const Case c : {Case{4, 40, 0, 8}, Case{8, 64, 1000, 32}, Case{64, 16, 4000, 512}, Case{16, 100, 2000, 64}, Case{64, 71, 3000, 512},
                       Case{32, 9, 100, 16}}) {
    const int dim = 128;
    const int64_t n_blocks = (c.pos0 + c.n_q) / 4;
    const auto q = round_bf16(randn(size_t(c.n_q * c.heads * dim))), k = round_bf16(randn(size_t(n_blocks * dim)));
    auto w = randn(size_t(c.n_q * c.heads), 0.1f);
    auto dq = to_device_bf16(q), dk = to_device_bf16(k), dw = to_device_f32(w);
    // the FP8 path's operands as the CPU twin makes them: the reference scores are those of their values
    std::vector<uint8_t> q8(q.size()), k8(k.size());
    std::vector<float> q8s(size_t(c.n_q * c.heads)), k8s(static_cast<size_t>(n_blocks)), q8v(q.size()), k8v(k.size());
    dsv4_indexer_fp8_rows(q.data(), c.n_q * c.heads, dim, q8.data(), q8s.data(), q8v.data());
    dsv4_indexer_fp8_rows(k.data(), n_blocks, dim, k8.data(), k8s.data(), k8v.data());
    // the FP8 keys kernel sums the heads in bf16 products: each ReLU term rounded to bf16 (within 2^-8 of it), the
    // weights kept to ~16 bits by a hi + lo split; its bound adds 2^-8 (1 + 2^-6) of the sum of the terms' magnitudes
    std::vector<double> magnitude;  // [n_q x n_blocks]: sum over heads of |w| max(0, q . k), of the FP8 operands' values
    for (const std::string path : {"GEMM + ReLU sum", "fused", "fused FP8, queries from shared memory", "fused FP8, queries as register fragments",
                                   "fused FP8, keys as A, heads summed by products"}) {
      const bool fp8 = path.rfind("fused FP8", 0) == 0, keys = path.find("keys as A") != std::string::npos;
      if (fp8) setenv("PDBRIDGE_DSV4_INDEXER_A", keys ? "keys" : path == "fused FP8, queries from shared memory" ? "smem" : "registers", 1);
      else unsetenv("PDBRIDGE_DSV4_INDEXER_A");
      if (keys && magnitude.empty()) magnitude = indexer_term_magnitudes(q8v, k8v, w, c.n_q, c.heads, dim, n_blocks);
      if (path == "fused" && !cuda::indexer_scores_supported(c.heads, dim)) continue;
      if (fp8 && !cuda::indexer_scores_fp8_supported(c.heads, dim)) continue;
      // the bound on the scores, of the row's largest: f32 accumulation on the bf16 paths; Hopper's FP8 wgmma adds
      // in the tensor core with fewer bits than f32 (DeepSeek-V3's report: about 14), 2.5e-4 to 7.9e-4 measured with
      // 8-64 heads, up to 2.5e-3 with 4 (the random inputs differ per run; a few heads' sums cancel more of the
      // products the accumulation rounded, against a smaller largest score)
      const double tol = fp8 ? (c.heads < 8 ? 5e-3 : 2e-3) : 1e-4;
      const std::vector<float>& qr = fp8 ? q8v : q;
      const std::vector<float>& kr = fp8 ? k8v : k;
      auto scores = poisoned(size_t(c.n_q * n_blocks) * 4);
      cuda::DeviceBuffer idx(size_t(c.n_q * c.top_k) * 4);
      const cuda::IndexerShape sh{c.n_q, c.pos0, c.heads, n_blocks, 4, c.top_k};
      if (fp8) {
        // q from f32 (the engine's rotated queries), the rows from bf16 (its cached LID rows)
        auto dqf = to_device_f32(q);
        cuda::DeviceBuffer dq8(q.size()), dk8(k.size()), dq8s(q8s.size() * 4), dk8s(k8s.size() * 4);
        cuda::indexer_fp8_rows(dqf.as<float>(), c.n_q * c.heads, dim, dq8.as<uint8_t>(), dq8s.as<float>(), nullptr);
        cuda::indexer_fp8_rows(dk.as<__nv_bfloat16>(), n_blocks, dim, dk8.as<uint8_t>(), dk8s.as<float>(), nullptr);
        cuda::indexer_scores_fp8(dq8.as<uint8_t>(), dq8s.as<float>(), dk8.as<uint8_t>(), dk8s.as<float>(), dw.as<float>(), scores.as<float>(), sh, dim,
                                 nullptr);
        PDB_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<uint8_t> g8(q8.size()), gk8(k8.size());
        std::vector<float> g8s(q8s.size()), gk8s(k8s.size());
        dq8.download(g8.data(), g8.size());
        dk8.download(gk8.data(), gk8.size());
        dq8s.download(g8s.data(), g8s.size() * 4);
        dk8s.download(gk8s.data(), gk8s.size() * 4);
        EXPECT_EQ(g8, q8) << "e4m3 codes of q";
        EXPECT_EQ(gk8, k8) << "e4m3 codes of the rows";
        EXPECT_EQ(g8s, q8s) << "scales of q";
        EXPECT_EQ(gk8s, k8s) << "scales of the rows";
      } else if (path == "fused") {
        cuda::indexer_scores(dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(), dw.as<float>(), scores.as<float>(), sh, dim, nullptr);
      } else {
        cuda::DeviceBuffer s(size_t(c.n_q * c.heads * n_blocks) * 4);
        cuda::Gemm gemm;
        gemm.xwt(cuda::DType::BF16, dq.get(), dk.get(), cuda::DType::F32, s.get(), c.n_q * c.heads, dim, n_blocks, 0.0f, nullptr);
        cuda::indexer_weighted_relu(s.as<float>(), dw.as<float>(), scores.as<float>(), sh, nullptr);
        PDB_CUDA_CHECK(cudaDeviceSynchronize());
      }
      cuda::indexer_topk(scores.as<float>(), idx.as<int32_t>(), sh, nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      const auto gs = from_device_f32(scores, size_t(c.n_q * n_blocks));
      std::vector<int32_t> gi(size_t(c.n_q * c.top_k));
      idx.download(gi.data(), gi.size() * 4);
      double worst = 0;
      int differing = 0;
      for (int64_t t = 0; t < c.n_q; ++t) {
        const int64_t visible = std::min(n_blocks, (c.pos0 + t + 1) / 4);
        std::vector<float> cs;
        const auto want = dsv4_indexer_select(qr.data() + t * c.heads * dim, w.data() + t * c.heads, kr.data(), c.heads, dim, visible, c.top_k, &cs);
        float scale = 1e-30f;
        for (float v : cs) scale = std::max(scale, std::fabs(v));
        double bf16_sum = 0;  // the keys kernel's rounding allowance: for a score, and the row's largest (the swaps')
        for (int64_t b = 0; b < n_blocks; ++b) {
          const float g = gs[size_t(t * n_blocks + b)];
          if (b >= visible) { EXPECT_TRUE(std::isinf(g) && g < 0) << "t " << t << " b " << b; continue; }
          ASSERT_FALSE(std::isnan(g)) << "t " << t << " b " << b << ": not written";
          const double allowance = keys ? std::ldexp(magnitude[size_t(t * n_blocks + b)], -8) * (1 + std::ldexp(1.0, -6)) : 0.0;
          bf16_sum = std::max(bf16_sum, allowance);
          worst = std::max(worst, (std::fabs(g - cs[size_t(b)]) - allowance) / scale);
        }
        std::vector<int64_t> got;
        for (int j = 0; j < c.top_k; ++j) {
          const int32_t v = gi[size_t(t * c.top_k + j)];
          if (j < int(want.size())) {
            ASSERT_GE(v, 0) << "t " << t;
            got.push_back(v);
          } else {
            EXPECT_EQ(v, -1) << "t " << t << ": past the visible blocks";
          }
        }
        ASSERT_TRUE(std::is_sorted(got.begin(), got.end())) << "t " << t;
        if (got == want) continue;
        // where the two differ, the blocks must tie the k-th score within the products' rounding
        std::vector<float> sorted = cs;
        std::sort(sorted.begin(), sorted.end(), std::greater<float>());
        const float kth = sorted[std::min(sorted.size(), size_t(c.top_k)) - 1];
        std::set<int64_t> a(got.begin(), got.end()), b(want.begin(), want.end());
        for (int64_t x : a)
          if (!b.count(x)) { ++differing; EXPECT_LT(std::fabs(cs[size_t(x)] - kth), tol * scale + 2 * bf16_sum) << "t " << t << " took " << x; }
        for (int64_t x : b) {
          if (!a.count(x)) { EXPECT_LT(std::fabs(cs[size_t(x)] - kth), tol * scale + 2 * bf16_sum) << "t " << t << " left " << x; }
        }
      }
      std::printf("DSV4 indexer (%s) H=%d n_q=%lld pos0=%lld top_k=%d: scores rel err %.2e (of the row's largest), %d near-tie swaps\n",
                  path.c_str(), c.heads, (long long)c.n_q, (long long)c.pos0, c.top_k, worst, differing);
      EXPECT_LT(worst, tol);
      unsetenv("PDBRIDGE_DSV4_INDEXER_A");
    }
  }
#endif
}

// The top-k alone, bit for bit against its twin (dsv4_indexer_top_k) on given scores: the three kernels (by warps, the
// default; PDBRIDGE_DSV4_TOPK=global and =smem), on Gaussian scores of both signs, on scores of five values (thousands
// tie the k-th: the lower indices must win), where fewer than top_k are visible, and on rows longer than shared memory
// holds (the shared-memory kernel declines them and the warps' one runs).
TEST(CudaKernels, Dsv4IndexerTopKMatchesItsCpuTwin) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  struct Case { int64_t n_q, pos0, n_blocks; int top_k; bool ties; };
  const int64_t longest = cuda::indexer_topk_smem_blocks();
  ASSERT_GT(longest, 8192) << "the shared-memory top-k should hold a 32K prompt's rows";
  std::mt19937 rng(std::random_device{}());
  for (const Case c : {Case{64, 30000, 8192, 512, false}, Case{48, 11000, 3000, 512, true}, Case{40, 0, 10, 8, false}, Case{33, 2000, 520, 512, true},
                       Case{5, 4 * longest - 2, longest + 700, 512, false}, Case{7, 4 * longest - 4, longest + 3, 64, true}}) {
    std::vector<float> sc(size_t(c.n_q * c.n_blocks), -INFINITY);
    std::normal_distribution<float> gauss(0.0f, 1.0f);
    std::uniform_int_distribution<int> five(-1, 3);
    for (auto& v : sc) v = c.ties ? 0.5f * float(five(rng)) : gauss(rng);
    for (auto& v : sc) v = v == 0.0f ? 0.0f : v;  // no -0: the twin's < does not order it below +0
    auto dsc = to_device_f32(sc);
    const cuda::IndexerShape sh{c.n_q, c.pos0, 64, c.n_blocks, 4, c.top_k};
    for (const char* way : {"global", "smem", "warps"}) {
      setenv("PDBRIDGE_DSV4_TOPK", way, 1);
      cuda::DeviceBuffer idx(size_t(c.n_q * c.top_k) * 4);
      cuda::indexer_topk(dsc.as<float>(), idx.as<int32_t>(), sh, nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<int32_t> gi(size_t(c.n_q * c.top_k));
      idx.download(gi.data(), gi.size() * 4);
      int wrong = 0;
      for (int64_t t = 0; t < c.n_q; ++t) {
        const int64_t visible = std::min(c.n_blocks, (c.pos0 + t + 1) / 4);
        const auto want = dsv4_indexer_top_k(sc.data() + t * c.n_blocks, visible, c.top_k);
        for (int j = 0; j < c.top_k; ++j) {
          const int64_t w = j < int(want.size()) ? want[size_t(j)] : -1;
          if (gi[size_t(t * c.top_k + j)] != w && wrong++ < 5)
            ADD_FAILURE() << way << " n_blocks " << c.n_blocks << " t " << t << " j " << j << ": " << gi[size_t(t * c.top_k + j)]
                          << ", the twin " << w;
        }
      }
      EXPECT_EQ(wrong, 0) << way << " n_blocks " << c.n_blocks << (c.ties ? ", ties" : "");
    }
    unsetenv("PDBRIDGE_DSV4_TOPK");
  }
#endif
}

// The fused sparse attention against its CPU twin (dsv4_attend) on fresh random inputs, for each kind of layer:
// a window that starts before position 0, the ratio-128 pool's visible blocks, the indexer's choices with -1 past
// them; V4-Flash's 64 heads of 512, 16 of 512 and the tiny model's 4 of 64 (padded to a block's 64 rows). Both
// kernels: mma.sync, and wgmma (512 wide) on an sm_90 GPU.
TEST(CudaKernels, Dsv4SparseAttentionMatchesItsCpuTwin) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  // q_sd 6: logits of sd 6, so a query's running max keeps rising (the wgmma kernel rescales O only then);
  // 200 queries from position 20: windows that start before position 0 and indexer choices of -1 across many blocks
  struct Case { int heads, dim, ratio; int64_t t0, nq; int top_k; float q_sd = 1.0f; };
  for (const Case c : {Case{64, 512, 4, 3000, 6, 512}, Case{64, 512, 4, 3000, 6, 512, 6.0f}, Case{64, 512, 128, 1900, 5, 0, 6.0f}, Case{64, 512, 4, 20, 200, 512},
                       Case{64, 512, 4, 20, 9, 512}, Case{16, 512, 4, 2500, 3, 512}, Case{64, 512, 128, 1900, 5, 0}, Case{64, 512, 0, 3, 4, 0},
                       Case{4, 64, 4, 600, 40, 8}, Case{4, 64, 128, 700, 33, 0}, Case{4, 64, 0, 0, 130, 0}}) {
    const int W = 128, H = c.heads, D = c.dim;
    const int64_t win_first = std::max<int64_t>(0, c.t0 - W + 1);
    const int64_t win_rows = c.t0 + c.nq - win_first;
    const int64_t n_pool = c.ratio ? (c.t0 + c.nq) / c.ratio : 0;
    const auto q = round_bf16(randn(size_t(c.nq * H * D), c.q_sd));  // logits of sd q_sd after the 1/sqrt(D)
    const auto win = round_bf16(randn(size_t(win_rows * D)));
    const auto pool = round_bf16(randn(size_t(std::max<int64_t>(n_pool, 1) * D)));
    const auto sinks = randn(size_t(H));
    std::vector<int32_t> idx(size_t(c.nq * std::max(c.top_k, 1)), -1);
    if (c.ratio == 4)
      for (int64_t i = 0; i < c.nq; ++i) {  // a random ascending choice of the visible blocks, -1 past them
        const int64_t visible = (c.t0 + i + 1) / 4;
        std::vector<int32_t> all(static_cast<size_t>(visible));
        for (int64_t b = 0; b < visible; ++b) all[size_t(b)] = int32_t(b);
        std::shuffle(all.begin(), all.end(), rng());
        all.resize(std::min<size_t>(all.size(), size_t(c.top_k)));
        std::sort(all.begin(), all.end());
        std::copy(all.begin(), all.end(), idx.begin() + i * c.top_k);
      }
    auto dq = to_device_bf16(q), dwin = to_device_bf16(win), dpool = to_device_bf16(pool), dsinks = to_device_f32(sinks);
    cuda::DeviceBuffer didx(idx.size() * 4);
    didx.upload(idx.data(), idx.size() * 4);
    cuda::Dsv4SparseAttention a;
    a.q = dq.as<__nv_bfloat16>();
    a.win = dwin.as<__nv_bfloat16>();
    a.win_first = win_first;
    a.pool = dpool.as<__nv_bfloat16>();
    a.n_pool = n_pool;
    a.idx = c.ratio == 4 ? didx.as<int32_t>() : nullptr;
    a.sinks = dsinks.as<float>();
    a.top_k = c.top_k;
    a.ratio = c.ratio;
    a.W = W;
    a.H = H;
    a.D = D;
    a.t0 = c.t0;
    a.nq = c.nq;
    a.scale = 1.0f / std::sqrt(float(D));
    ASSERT_TRUE(cuda::dsv4_sparse_attention_supported(H, D));
    // the mma.sync kernel, and on an sm_90 GPU the wgmma one where it takes the width
    for (const bool wgmma : {false, true}) {
      if (wgmma && !cuda::dsv4_sparse_attention_wgmma_supported(H, D)) continue;
      auto out = poisoned(size_t(c.nq * H * D) * 2);
      if (wgmma) cuda::dsv4_sparse_attention_wgmma(a, out.as<__nv_bfloat16>(), nullptr);
      else cuda::dsv4_sparse_attention(a, out.as<__nv_bfloat16>(), nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = from_device_bf16(out, size_t(c.nq * H * D));
      double err2 = 0, ref2 = 0, worst = 0;
      std::vector<float> want(size_t(H * D));
      for (int64_t i = 0; i < c.nq; ++i) {
        const int64_t t = c.t0 + i;
        std::vector<const float*> keys;
        for (int64_t p = std::max<int64_t>(0, t - W + 1); p <= t; ++p) keys.push_back(win.data() + (p - win_first) * D);
        if (c.ratio == 128)
          for (int64_t b = 0; b < std::min(n_pool, (t + 1) / 128); ++b) keys.push_back(pool.data() + b * D);
        if (c.ratio == 4)
          for (int j = 0; j < c.top_k; ++j)
            if (const int32_t b = idx[size_t(i * c.top_k + j)]; b >= 0) keys.push_back(pool.data() + int64_t(b) * D);
        dsv4_attend(q.data() + i * H * D, keys, sinks.data(), H, D, a.scale, want.data());
        for (int64_t e = 0; e < H * D; ++e) {
          const double g = got[size_t(i * H * D + e)], w = want[size_t(e)];
          ASSERT_FALSE(std::isnan(g)) << "query " << i << " element " << e;
          err2 += (g - w) * (g - w);
          ref2 += w * w;
          worst = std::max(worst, std::fabs(g - w));
        }
      }
      const double rel = std::sqrt(err2 / std::max(ref2, 1e-30));
      std::printf("DSV4 sparse attention (%s) H=%d D=%d ratio %d t0=%lld nq=%lld q_sd %.0f: rel RMS %.2e, worst abs %.2e\n", wgmma ? "wgmma" : "mma.sync", H, D, c.ratio,
                  (long long)c.t0, (long long)c.nq, c.q_sd, rel, worst);
      // bf16 P and bf16 output against f32: a few parts in 1e3
      EXPECT_LT(rel, 8e-3);
    }
  }
#endif
}

}  // namespace pdb

namespace pdb {

// A benchmark, run on request (PDBRIDGE_BENCH=1; the H200 figures in docs/RESULTS.md): the sparse attention's two
// kernels in the same process at V4-Flash's shapes (64 heads of 512, window 128, top-512), the last 4096-query chunk
// of a T-token prompt for each layer kind; device time by CUDA events (median of 10 after a warm-up) and TFLOP/s
// of the keys each query sees (4 H D FLOP per query and key: S and P V).
TEST(CudaBench, Dsv4SparseAttentionKernels) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
  const char* on = std::getenv("PDBRIDGE_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "a benchmark: PDBRIDGE_BENCH=1 runs it";
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  const int H = 64, D = 512, W = 128, K = 512;
  const int64_t NQ = 4096;
  for (const int64_t T : {int64_t(32768), int64_t(131072)}) {
    const int64_t t0 = T - NQ;
    auto dq = to_device_bf16(round_bf16(randn(size_t(NQ * H * D), 1.0f)));
    auto dwin = to_device_bf16(round_bf16(randn(size_t((NQ + W) * D))));
    auto dpool = to_device_bf16(round_bf16(randn(size_t(T / 4) * D)));
    auto dsinks = to_device_f32(randn(size_t(H)));
    std::vector<int32_t> idx(size_t(NQ * K));
    std::mt19937 g(7);
    for (int64_t i = 0; i < NQ; ++i)  // K distinct visible blocks per query, ascending
      for (int j = 0; j < K; ++j) idx[size_t(i * K + j)] = int32_t(j * ((t0 + i + 1) / 4 / K) + int(g() % 2));
    cuda::DeviceBuffer didx(idx.size() * 4), out(size_t(NQ * H * D) * 2);
    didx.upload(idx.data(), idx.size() * 4);
    for (const int ratio : {4, 128, 0}) {
      cuda::Dsv4SparseAttention a;
      a.q = dq.as<__nv_bfloat16>();
      a.win = dwin.as<__nv_bfloat16>();
      a.win_first = t0 - W;
      a.pool = dpool.as<__nv_bfloat16>();
      a.n_pool = ratio == 4 ? T / 4 : ratio == 128 ? T / 128 : 0;
      a.idx = ratio == 4 ? didx.as<int32_t>() : nullptr;
      a.sinks = dsinks.as<float>();
      a.top_k = K, a.ratio = ratio, a.W = W, a.H = H, a.D = D, a.t0 = t0, a.nq = NQ;
      a.scale = 1.0f / std::sqrt(float(D));
      double keys = 0;
      for (int64_t i = 0; i < NQ; ++i) {
        const int64_t t = t0 + i;
        keys += W + (ratio == 4 ? std::min<int64_t>((t + 1) / 4, K) : ratio == 128 ? std::min<int64_t>((t + 1) / 128, a.n_pool) : 0);
      }
      for (const bool wgmma : {false, true}) {
        if (wgmma && !cuda::dsv4_sparse_attention_wgmma_supported(H, D)) continue;
        auto run = [&] {
          if (wgmma) cuda::dsv4_sparse_attention_wgmma(a, out.as<__nv_bfloat16>(), nullptr);
          else cuda::dsv4_sparse_attention(a, out.as<__nv_bfloat16>(), nullptr);
        };
        const double med = median_ms(10, run);
        std::printf("DSV4 SPARSE ATTENTION T=%lld ratio %d (%s): %.3f ms for %lld queries, %.0f keys each, %.0f TFLOP/s\n", (long long)T, ratio,
                    wgmma ? "wgmma" : "mma.sync", med, (long long)NQ, keys / double(NQ), 4.0 * H * D * keys / (med * 1e-3) / 1e12);
        std::fflush(stdout);
      }
    }
  }
#endif
}

// The hyper-connection mixes' narrow f32 products (cuda/f32_narrow.cuh) against the f64 product: both widths, rows
// past a tile's end, one k-step and several (the stages' rotation), and a row count that fills the GPU.
TEST(CudaKernels, F32NarrowProductsMatchTheF64Product) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  struct Case { int64_t rows, k, n; };
  // one split, and k split in 2 to 8 (PDBRIDGE_DSV4_MIX=split: each split's sum in order, then the splits added)
  for (const Case& c : {Case{200, 32, 24}, Case{300, 160, 48}, Case{17000, 96, 48}, Case{130, 4096, 24}, Case{300, 2048, 48}})
  for (const int splits : {1, 2, 4, 8}) {
    if ((c.k / 32) % splits) continue;
    const auto x = randn(size_t(c.rows * c.k)), w = randn(size_t(c.n * c.k), 0.05f);
    auto dx = to_device_f32(x), dw = to_device_f32(w);
    ASSERT_TRUE(cuda::f32_narrow_supported(dx.as<float>(), dw.as<float>(), c.k, c.n));
    auto dy = poisoned(size_t(c.rows * c.n) * 4);
    auto parts = poisoned(size_t(splits * c.rows * c.n) * 4);
    cuda::f32_narrow_xwt(dx.as<float>(), dw.as<float>(), dy.as<float>(), c.rows, c.k, c.n, nullptr, parts.as<float>(), splits);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const auto y = from_device_f32(dy, size_t(c.rows * c.n));
    double worst = 0;
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t o = 0; o < c.n; ++o) {
        double want = 0, magnitude = 0;
        for (int64_t i = 0; i < c.k; ++i) {
          const double term = double(x[size_t(r * c.k + i)]) * w[size_t(o * c.k + i)];
          want += term;
          magnitude += std::fabs(term);
        }
        const double got = y[size_t(r * c.n + o)];
        ASSERT_TRUE(std::isfinite(got)) << "row " << r << " output " << o << " (rows " << c.rows << ")";
        // an f32 sum of k terms in order: each addition rounds within 2^-24 of the running sum
        worst = std::max(worst, std::fabs(got - want) / (magnitude * double(c.k) * std::ldexp(1.0, -24) + 1e-30));
      }
    std::printf("F32 NARROW %lld x %lld -> %lld, %d split(s): worst error %.3f of the f32 sum's bound\n", (long long)c.rows, (long long)c.k,
                (long long)c.n, splits, worst);
    EXPECT_LE(worst, 1.0) << c.rows << " x " << c.k << " -> " << c.n << ", " << splits << " splits";
  }
  EXPECT_THROW(cuda::f32_narrow_xwt(nullptr, nullptr, nullptr, 10, 96, 24, nullptr, nullptr, 2), std::invalid_argument) << "3 k-steps in 2 splits";
  EXPECT_FALSE(cuda::f32_narrow_supported(nullptr, nullptr, 4096, 32)) << "a width it has no tile for";
  EXPECT_FALSE(cuda::f32_narrow_supported(nullptr, nullptr, 100, 24)) << "k not of 32-steps";
#endif
}

// The f32 products on the tensor cores (cuda/f32_tensor.cuh: 3xTF32) against the f64 product: the mixes' widths, the
// router's, other widths of 8 (the tiny models' routers), rows and outputs past a tile, one k-step and many. Each
// output within the f32 sum's bound; over all outputs the RMS error within 4x that of an f32 sum in k order (worked
// out here) plus 2^-22 of the terms' magnitude, where one TF32 product would be ~2^-11 of each term: the products are
// as accurate as f32 ones. And inputs of 17 significant bits (no TF32 holds them) give the exact sums.
TEST(CudaKernels, F32TensorProductsMatchTheF64Product) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  // variant (f32_tensor_xwt): 0 the default, 2 no per-stage sums (its RMS only printed: the tensor cores' own
  // accumulation, measured)
  struct Case { int64_t rows, k, n; int variant; int splits = 1; };
  std::vector<Case> cases;
  for (const int v : {0, 2})
    for (const Case& c : {Case{200, 64, 24, v}, Case{300, 192, 48, v}, Case{17000, 128, 48, v}, Case{130, 16384, 24, v}, Case{150, 16384, 48, v},
                          Case{520, 4096, 256, v}, Case{77, 64, 8, v}, Case{300, 256, 136, v}})
      cases.push_back(c);
  for (const Case& c : {Case{200, 32, 24, 0}, Case{300, 160, 48, 0}}) cases.push_back(c);
  // k split (the server's chunks): each split's sum, then the splits added in order
  for (const Case& c : {Case{130, 16384, 24, 0, 8}, Case{150, 16384, 48, 0, 4}, Case{520, 4096, 256, 0, 2}, Case{300, 512, 136, 0, 2}}) cases.push_back(c);
  for (const Case& c : cases) {
    const auto x = randn(size_t(c.rows * c.k)), w = randn(size_t(c.n * c.k), 0.05f);
    auto dx = to_device_f32(x), dw = to_device_f32(w);
    auto dy = poisoned(size_t(c.rows * c.n) * 4), parts = poisoned(size_t(c.splits * c.rows * c.n) * 4);
    ASSERT_TRUE(cuda::f32_tensor_supported(dx.as<float>(), dw.as<float>(), dy.as<float>(), c.k, c.n));
    cuda::f32_tensor_xwt(dx.as<float>(), dw.as<float>(), dy.as<float>(), c.rows, c.k, c.n, nullptr, parts.as<float>(), c.splits, c.variant);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const auto y = from_device_f32(dy, size_t(c.rows * c.n));
    double worst = 0, sq = 0, sq_f32 = 0;
    for (int64_t r = 0; r < c.rows; ++r)
      for (int64_t o = 0; o < c.n; ++o) {
        double want = 0, magnitude = 0;
        float in_order = 0.0f;
        for (int64_t i = 0; i < c.k; ++i) {
          const float a = x[size_t(r * c.k + i)], b = w[size_t(o * c.k + i)];
          want += double(a) * b;
          magnitude += std::fabs(double(a) * b);
          in_order = std::fma(a, b, in_order);
        }
        const double got = y[size_t(r * c.n + o)];
        ASSERT_TRUE(std::isfinite(got)) << "row " << r << " output " << o << " (rows " << c.rows << ")";
        worst = std::max(worst, std::fabs(got - want) / (magnitude * double(c.k) * std::ldexp(1.0, -24) + 1e-30));
        sq += std::pow((got - want) / magnitude, 2);
        sq_f32 += std::pow((double(in_order) - want) / magnitude, 2);
      }
    const double count = double(c.rows * c.n), rms = std::sqrt(sq / count), rms_f32 = std::sqrt(sq_f32 / count);
    std::printf("F32 TENSOR %lld x %lld -> %lld (variant %d, %d split(s)): worst error %.4f of the f32 sum's bound; RMS error %.3g of the "
                "terms' magnitude, an f32 sum in order %.3g\n",
                (long long)c.rows, (long long)c.k, (long long)c.n, c.variant, c.splits, worst, rms, rms_f32);
    EXPECT_LE(worst, 1.0) << c.rows << " x " << c.k << " -> " << c.n << ", variant " << c.variant;
    if (c.variant != 2) EXPECT_LE(rms, 4 * rms_f32 + std::ldexp(1.0, -22)) << c.rows << " x " << c.k << " -> " << c.n << ", variant " << c.variant;
  }
  {  // x = 1 + j 2^-16 (17 bits), w small integers: every sum exact in f32 (at most 24 bits), so it must come out exact
    const int64_t rows = 64, k = 64, n = 24;
    std::vector<float> x(size_t(rows * k)), w(size_t(n * k));
    for (size_t i = 0; i < x.size(); ++i) x[i] = 1.0f + float(int((i * 7919) % 61)) * std::ldexp(1.0f, -16);
    for (size_t i = 0; i < w.size(); ++i) w[i] = float(1 + int(i % 3));
    auto dx = to_device_f32(x), dw = to_device_f32(w);
    auto dy = poisoned(size_t(rows * n) * 4);
    cuda::f32_tensor_xwt(dx.as<float>(), dw.as<float>(), dy.as<float>(), rows, k, n, nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const auto y = from_device_f32(dy, size_t(rows * n));
    int inexact = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < n; ++o) {
        double want = 0;
        for (int64_t i = 0; i < k; ++i) want += double(x[size_t(r * k + i)]) * w[size_t(o * k + i)];
        inexact += double(y[size_t(r * n + o)]) != want;
      }
    EXPECT_EQ(inexact, 0) << "of " << rows * n << " sums of 17-bit inputs";
  }
  EXPECT_THROW(cuda::f32_tensor_xwt(nullptr, nullptr, nullptr, 10, 100, 24, nullptr), std::invalid_argument) << "k not of 32-steps";
  EXPECT_FALSE(cuda::f32_tensor_supported(nullptr, nullptr, nullptr, 4096, 12)) << "a width not of 8";
#endif
}

// The fused pre-sum + rms norm (+ bf16 copy, + Q8_0 blocks) against the passes it replaces, bit for bit: rows of
// 4,096 (V4-Flash's), of 1,000 (a last 256-step cut short; no Q8_0 blocks) and of 64 (the tiny models').
TEST(CudaKernels, Dsv4PreSumNormIsTheThreePassesBitForBit) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  for (const int64_t E : {int64_t(4096), int64_t(1000), int64_t(64)}) {
    const int64_t n = 37;
    auto x = to_device_f32(randn(size_t(n * 4 * E))), mix = to_device_f32(randn(size_t(n * 24), 0.5f)), w = to_device_f32(randn(size_t(E), 0.3f));
    cuda::DeviceBuffer pre(size_t(n * E) * 4), y(size_t(n * E) * 4), y2(size_t(n * E) * 4), yb(size_t(n * E) * 2), yb2(size_t(n * E) * 2);
    ASSERT_TRUE(cuda::dsv4_hc_pre_sum_norm_supported(E));
    const bool q8 = E % 32 == 0;
    cuda::DeviceBuffer q(size_t(n * E)), q2(size_t(n * E)), d(size_t(n * E / 32 + 1) * 4), d2(size_t(n * E / 32 + 1) * 4);
    cuda::dsv4_hc_pre_sum_norm(x.as<float>(), mix.as<float>(), n, E, w.as<float>(), 1e-6f, y.as<float>(), yb.as<__nv_bfloat16>(), nullptr,
                               q8 ? q.as<int8_t>() : nullptr, d.as<float>());
    cuda::dsv4_hc_pre_sum(x.as<float>(), mix.as<float>(), n, E, pre.as<float>(), nullptr);
    cuda::rmsnorm_rows(pre.as<float>(), w.as<float>(), y2.as<float>(), n, E, 1e-6f, nullptr);
    cuda::f32_to_bf16(y2.as<float>(), yb2.as<__nv_bfloat16>(), n * E, nullptr);
    if (q8) cuda::quantize_rows_q8(y2.as<float>(), n, E, q2.as<int8_t>(), d2.as<float>(), nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    if (q8) {
      std::vector<int8_t> qa(size_t(n * E)), qb(qa.size());
      std::vector<uint32_t> da(size_t(n * E / 32)), db(da.size());
      PDB_CUDA_CHECK(cudaMemcpy(qa.data(), q.get(), qa.size(), cudaMemcpyDeviceToHost));
      PDB_CUDA_CHECK(cudaMemcpy(qb.data(), q2.get(), qb.size(), cudaMemcpyDeviceToHost));
      PDB_CUDA_CHECK(cudaMemcpy(da.data(), d.get(), da.size() * 4, cudaMemcpyDeviceToHost));
      PDB_CUDA_CHECK(cudaMemcpy(db.data(), d2.get(), db.size() * 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(qa, qb) << "the Q8_0 codes, E = " << E;
      EXPECT_EQ(da, db) << "the Q8_0 scales, E = " << E;
    }
    std::vector<uint32_t> a(size_t(n * E)), b(a.size());
    std::vector<uint16_t> ab(a.size()), bb(a.size());
    PDB_CUDA_CHECK(cudaMemcpy(a.data(), y.get(), a.size() * 4, cudaMemcpyDeviceToHost));
    PDB_CUDA_CHECK(cudaMemcpy(b.data(), y2.get(), b.size() * 4, cudaMemcpyDeviceToHost));
    PDB_CUDA_CHECK(cudaMemcpy(ab.data(), yb.get(), ab.size() * 2, cudaMemcpyDeviceToHost));
    PDB_CUDA_CHECK(cudaMemcpy(bb.data(), yb2.get(), bb.size() * 2, cudaMemcpyDeviceToHost));
    int64_t differ = 0, differ_bf16 = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i], differ_bf16 += ab[i] != bb[i];
    EXPECT_EQ(differ, 0) << "of " << a.size() << " normed values, E = " << E;
    EXPECT_EQ(differ_bf16, 0) << "of " << a.size() << " bf16 copies, E = " << E;
  }
  EXPECT_FALSE(cuda::dsv4_hc_pre_sum_norm_supported(8192)) << "rows past 16 elements a thread";
#endif
}

// The routed experts' rows combined inside the post-mix's pass against moe_combine then dsv4_hc_post, bit for bit:
// rows of 4,096 (V4-Flash's), 64, and 6 (not of 4: the scalar form).
TEST(CudaKernels, Dsv4CombineInThePostMixIsTheTwoPassesBitForBit) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  std::mt19937 rng(7);
  for (const int64_t E : {int64_t(4096), int64_t(64), int64_t(6)}) {
    const int64_t n = 29;
    const int K = 6;
    std::vector<int32_t> slot(size_t(n * K));
    for (size_t i = 0; i < slot.size(); ++i) slot[i] = int32_t(i);
    std::shuffle(slot.begin(), slot.end(), rng);
    std::vector<float> mixv(size_t(n * 24));
    for (float& v : mixv) v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
    auto yexp = to_device_bf16(randn(size_t(n * K * E))), w = to_device_f32(randn(size_t(n * K), 0.3f)), mix = to_device_f32(mixv);
    auto x = to_device_f32(randn(size_t(n * 4 * E))), f = to_device_f32(randn(size_t(n * E)));
    cuda::DeviceBuffer ds(slot.size() * 4), f2(size_t(n * E) * 4), next(size_t(n * 4 * E) * 4), next2(size_t(n * 4 * E) * 4), inv(size_t(n) * 4),
        inv2(size_t(n) * 4);
    PDB_CUDA_CHECK(cudaMemcpy(ds.get(), slot.data(), slot.size() * 4, cudaMemcpyHostToDevice));
    PDB_CUDA_CHECK(cudaMemcpy(f2.get(), f.get(), size_t(n * E) * 4, cudaMemcpyDeviceToDevice));
    cuda::dsv4_hc_post(f.as<float>(), mix.as<float>(), x.as<float>(), n, E, next.as<float>(), nullptr, inv.as<float>(), 1e-6f,
                       {yexp.as<__nv_bfloat16>(), ds.as<int32_t>(), w.as<float>(), K});
    cuda::moe_combine(yexp.as<__nv_bfloat16>(), ds.as<int32_t>(), w.as<float>(), n, K, E, f2.as<float>(), nullptr);
    cuda::dsv4_hc_post(f2.as<float>(), mix.as<float>(), x.as<float>(), n, E, next2.as<float>(), nullptr, inv2.as<float>(), 1e-6f);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint32_t> a(static_cast<size_t>(n * 4 * E)), b(a.size()), ia(static_cast<size_t>(n)), ib(ia.size());
    PDB_CUDA_CHECK(cudaMemcpy(a.data(), next.get(), a.size() * 4, cudaMemcpyDeviceToHost));
    PDB_CUDA_CHECK(cudaMemcpy(b.data(), next2.get(), b.size() * 4, cudaMemcpyDeviceToHost));
    PDB_CUDA_CHECK(cudaMemcpy(ia.data(), inv.get(), ia.size() * 4, cudaMemcpyDeviceToHost));
    PDB_CUDA_CHECK(cudaMemcpy(ib.data(), inv2.get(), ib.size() * 4, cudaMemcpyDeviceToHost));
    int64_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
    EXPECT_EQ(differ, 0) << "of " << a.size() << " stream values, E = " << E;
    EXPECT_EQ(ia, ib) << "the next layer's inv-rms, E = " << E;
  }
#endif
}

// A benchmark, run on request (PDBRIDGE_BENCH=1): the f32 work of DeepSeek-V4's hyper-connection mixes and router
// at V4-Flash's shapes for a 32K chunk (hidden 4096, 4 streams, 256 experts), which the session-35 profile put at
// ~11 ms of a ratio-4 layer's 75 (the sections' mix 5.3, the MoE's routing and gather 5.7): each product's time
// against reading its input once at the device's bandwidth, and the elementwise passes beside them.
TEST(CudaBench, Dsv4F32MixAndRouterProducts) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
  const char* on = std::getenv("PDBRIDGE_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "a benchmark: PDBRIDGE_BENCH=1 runs it";
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  const int64_t rows = 32768, E = 4096, NE = 256, kMix = cuda::kDsv4MixFloats;
  cuda::Gemm gemm;
  cuda::DeviceBuffer x(size_t(rows * 4 * E) * 4), y(size_t(rows * NE) * 4), pre(size_t(rows * E) * 4), normed(size_t(rows * E) * 4);
  cuda::fill_random_f32(x.as<float>(), rows * 4 * E, 1, 1.0f, 0.0f, nullptr);
  auto w = to_device_f32(randn(size_t(NE * 4 * E), 0.01f));
  auto mix = to_device_f32(randn(size_t(rows * kMix), 0.1f));
  auto norm_w = to_device_f32(randn(size_t(E), 0.1f));
  struct Shape { const char* what; int64_t in, out; };
  for (const Shape& sh : {Shape{"the sections' two mixes (decoder's and engine's)", 4 * E, 2 * kMix}, Shape{"the FFN's mix", 4 * E, kMix},
                          Shape{"the router", E, NE}}) {
    const double bytes = double(rows) * sh.in * 4 + double(sh.in) * sh.out * 4 + double(rows) * sh.out * 4;
    auto report = [&](const char* how, double ms) {
      std::printf("DSV4 F32 PRODUCT %s, %s: %lld x %lld -> %lld: %.3f ms, %.1f TFLOP/s, %.0f GB/s of its operands read once\n", sh.what, how,
                  (long long)rows, (long long)sh.in, (long long)sh.out, ms, 2.0 * rows * sh.in * sh.out / (ms * 1e-3) / 1e12, bytes / (ms * 1e-3) / 1e9);
    };
    report("cuBLAS", median_ms(10, [&] { gemm.xwt(cuda::DType::F32, x.get(), w.get(), cuda::DType::F32, y.get(), rows, sh.in, sh.out, 0.0f, nullptr); }));
    if (cuda::f32_narrow_supported(x.as<float>(), w.as<float>(), sh.in, sh.out))
      report("narrow kernel", median_ms(10, [&] { cuda::f32_narrow_xwt(x.as<float>(), w.as<float>(), y.as<float>(), rows, sh.in, sh.out, nullptr); }));
    for (const int v : {0, 2})
      report(v ? "3xTF32, no per-stage sums" : "tensor cores, 3xTF32",
             median_ms(10, [&] { cuda::f32_tensor_xwt(x.as<float>(), w.as<float>(), y.as<float>(), rows, sh.in, sh.out, nullptr, nullptr, 1, v); }));
  }
  // the mixes in the prefill server's chunks of 4,096 rows: cuBLAS, the kernel's 32 tiles, and its k split until
  // the tiles fill the GPU (PDBRIDGE_DSV4_MIX=split)
  {
    const int64_t n4 = 4096, k = 4 * E;
    cuda::DeviceBuffer parts(size_t(8 * n4 * 2 * kMix) * 4);
    for (const int64_t n : {2 * kMix, kMix}) {
      const int splits = cuda::f32_narrow_splits(n4, k);
      const double cublas = median_ms(20, [&] { gemm.xwt(cuda::DType::F32, x.get(), w.get(), cuda::DType::F32, y.get(), n4, k, n, 0.0f, nullptr); });
      const double one = median_ms(20, [&] { cuda::f32_narrow_xwt(x.as<float>(), w.as<float>(), y.as<float>(), n4, k, n, nullptr); });
      const double split = median_ms(20, [&] {
        cuda::f32_narrow_xwt(x.as<float>(), w.as<float>(), y.as<float>(), n4, k, n, nullptr, parts.as<float>(), splits);
      });
      const double tensor = median_ms(20, [&] { cuda::f32_tensor_xwt(x.as<float>(), w.as<float>(), y.as<float>(), n4, k, n, nullptr); });
      const int tsplits = cuda::f32_tensor_splits(n4, n, k);
      const double tensor_split = median_ms(20, [&] {
        cuda::f32_tensor_xwt(x.as<float>(), w.as<float>(), y.as<float>(), n4, k, n, nullptr, parts.as<float>(), tsplits);
      });
      std::printf("DSV4 F32 MIX of a 4,096-row chunk, %lld x %lld -> %lld: cuBLAS %.3f ms, the kernel %.3f, its k in %d splits %.3f: %.2fx cuBLAS; "
                  "3xTF32 %.3f, its k in %d splits %.3f: %.2fx cuBLAS\n",
                  (long long)n4, (long long)k, (long long)n, cublas, one, splits, split, cublas / split, tensor, tsplits, tensor_split,
                  cublas / tensor_split);
    }
  }
  {  // the router in a 4,096-row chunk
    const int64_t n4 = 4096;
    cuda::DeviceBuffer parts(size_t(8 * n4 * NE) * 4);
    const int tsplits = cuda::f32_tensor_splits(n4, NE, E);
    const double cublas = median_ms(20, [&] { gemm.xwt(cuda::DType::F32, x.get(), w.get(), cuda::DType::F32, y.get(), n4, E, NE, 0.0f, nullptr); });
    const double tensor = median_ms(20, [&] { cuda::f32_tensor_xwt(x.as<float>(), w.as<float>(), y.as<float>(), n4, E, NE, nullptr); });
    const double tensor_split = median_ms(20, [&] {
      cuda::f32_tensor_xwt(x.as<float>(), w.as<float>(), y.as<float>(), n4, E, NE, nullptr, parts.as<float>(), tsplits);
    });
    std::printf("DSV4 F32 ROUTER of a 4,096-row chunk, %lld x %lld -> %lld: cuBLAS %.3f ms, 3xTF32 %.3f, its k in %d splits %.3f: %.2fx cuBLAS\n",
                (long long)n4, (long long)E, (long long)NE, cublas, tensor, tsplits, tensor_split, cublas / tensor_split);
  }
  const double pre_ms = median_ms(10, [&] { cuda::dsv4_hc_pre_sum(x.as<float>(), mix.as<float>(), rows, E, pre.as<float>(), nullptr); });
  const double norm_ms = median_ms(10, [&] { cuda::rmsnorm_rows(pre.as<float>(), norm_w.as<float>(), normed.as<float>(), rows, E, 1e-6f, nullptr); });
  cuda::DeviceBuffer normed_b(size_t(rows * E) * 2);
  const double bf16_ms = median_ms(10, [&] { cuda::f32_to_bf16(normed.as<float>(), normed_b.as<__nv_bfloat16>(), rows * E, nullptr); });
  const double fused_ms = median_ms(10, [&] {
    cuda::dsv4_hc_pre_sum_norm(x.as<float>(), mix.as<float>(), rows, E, norm_w.as<float>(), 1e-6f, normed.as<float>(), normed_b.as<__nv_bfloat16>(), nullptr);
  });
  std::printf("DSV4 F32 PASSES: the streams' pre-sum %.3f ms (%.0f GB/s), the rms norm %.3f ms (%.0f GB/s), the bf16 copy %.3f ms; "
              "the three fused %.3f ms (%.0f GB/s)\n", pre_ms, double(rows) * E * 4 * 5 / (pre_ms * 1e-3) / 1e9, norm_ms,
              double(rows) * E * 4 * 2 / (norm_ms * 1e-3) / 1e9, bf16_ms, fused_ms, double(rows) * E * (4 * 4 + 4 + 2) / (fused_ms * 1e-3) / 1e9);
  std::fflush(stdout);
#endif
}

// A benchmark, run on request (PDBRIDGE_BENCH=1; the H200 figures in docs/RESULTS.md): one ratio-4 layer's indexer
// over a whole prompt at DeepSeek-V4-Flash's shapes (64 heads x 128 dims, top 512), query chunks sized so that S
// stays <= 2 GiB; the time of the q.k GEMMs, the weighted ReLU and the top-k, and the GEMMs' TFLOP/s.
TEST(CudaBench, Dsv4IndexerAtV4FlashShapes) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
  const char* on = std::getenv("PDBRIDGE_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "a benchmark: PDBRIDGE_BENCH=1 runs it";
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  const int H = 64, I = 128, K = 512;
  cuda::Gemm gemm;
  for (const int64_t T : {int64_t(8192), int64_t(32768), int64_t(131072)}) {
    const int64_t NB = T / 4;
    auto dq = to_device_bf16(round_bf16(randn(size_t(4096) * H * I)));  // one chunk's queries, reused along the prompt
    auto dk = to_device_bf16(round_bf16(randn(size_t(NB) * I)));
    auto dw = to_device_f32(randn(size_t(4096) * H, 0.1f));
    const int64_t chunk = std::min<int64_t>(4096, std::max<int64_t>(64, (int64_t(2) << 30) / (int64_t(H) * 4 * std::max<int64_t>(NB, 1))));
    cuda::DeviceBuffer s(size_t(chunk * H * NB) * 4), scores(size_t(chunk * NB) * 4), idx(size_t(chunk * K) * 4);
    cudaEvent_t e[6];
    for (auto& x : e) PDB_CUDA_CHECK(cudaEventCreate(&x));
    float t_gemm = 0, t_relu = 0, t_topk = 0, t_topk_smem = 0, t_topk_warps = 0;
    double flops = 0;
    gemm.xwt(cuda::DType::BF16, dq.get(), dk.get(), cuda::DType::F32, s.get(), chunk * H, I, 64, 0.0f, nullptr);  // warm-up (cuBLASLt)
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    for (int64_t p0 = 0; p0 < T; p0 += chunk) {
      const int64_t n = std::min(chunk, T - p0), nb = std::max<int64_t>(1, (p0 + n) / 4);
      PDB_CUDA_CHECK(cudaEventRecord(e[0]));
      gemm.xwt(cuda::DType::BF16, dq.get(), dk.get(), cuda::DType::F32, s.get(), n * H, I, nb, 0.0f, nullptr);
      PDB_CUDA_CHECK(cudaEventRecord(e[1]));
      const cuda::IndexerShape sh{n, p0, H, nb, 4, K};
      cuda::indexer_weighted_relu(s.as<float>(), dw.as<float>(), scores.as<float>(), sh, nullptr);
      PDB_CUDA_CHECK(cudaEventRecord(e[2]));
      setenv("PDBRIDGE_DSV4_TOPK", "global", 1);  // the block scans' kernel (the default until session 39)
      cuda::indexer_topk(scores.as<float>(), idx.as<int32_t>(), sh, nullptr);
      PDB_CUDA_CHECK(cudaEventRecord(e[3]));
      setenv("PDBRIDGE_DSV4_TOPK", "smem", 1);  // the shared-memory kernel, same scores (the A/B)
      cuda::indexer_topk(scores.as<float>(), idx.as<int32_t>(), sh, nullptr);
      PDB_CUDA_CHECK(cudaEventRecord(e[4]));
      setenv("PDBRIDGE_DSV4_TOPK", "warps", 1);  // the warps' kernel (the default), same scores
      cuda::indexer_topk(scores.as<float>(), idx.as<int32_t>(), sh, nullptr);
      unsetenv("PDBRIDGE_DSV4_TOPK");
      PDB_CUDA_CHECK(cudaEventRecord(e[5]));
      PDB_CUDA_CHECK(cudaEventSynchronize(e[5]));
      float a, b, c, g, h;
      PDB_CUDA_CHECK(cudaEventElapsedTime(&a, e[0], e[1]));
      PDB_CUDA_CHECK(cudaEventElapsedTime(&b, e[1], e[2]));
      PDB_CUDA_CHECK(cudaEventElapsedTime(&c, e[2], e[3]));
      PDB_CUDA_CHECK(cudaEventElapsedTime(&g, e[3], e[4]));
      PDB_CUDA_CHECK(cudaEventElapsedTime(&h, e[4], e[5]));
      t_topk_warps += h;
      t_gemm += a;
      t_relu += b;
      t_topk += c;
      t_topk_smem += g;
      flops += 2.0 * double(n) * H * I * double(nb);
    }
    for (auto& x : e) cudaEventDestroy(x);
    const double ms = t_gemm + t_relu + t_topk;
    std::printf("DSV4 INDEXER T=%lld (one ratio-4 layer, chunks of %lld queries): %.2f ms = GEMM %.2f (%.0f TFLOP/s) + ReLU sum %.2f + top-%d by block scans"
                " (PDBRIDGE_DSV4_TOPK=global) %.2f ms; 21 ratio-4 layers: %.0f ms; the top-k from shared memory (=smem) %.2f ms: %.2fx faster; by warps (the default)"
                " %.2f ms: %.2fx faster\n",
                (long long)T, (long long)chunk, ms, t_gemm, flops / (t_gemm * 1e-3) / 1e12, t_relu, K, t_topk, 21 * ms, t_topk_smem,
                t_topk / t_topk_smem, t_topk_warps, t_topk / t_topk_warps);
  }
  // Then: does an FP8 indexer hold the top-k? At the same shapes, the last 256 queries of a T-token prompt (all T/4
  // blocks visible), their top-k from bf16 q and rows against the top-k from q and rows rounded to e4m3 with one
  // power-of-two scale per 128-wide row (dsv4_indexer_fp8_rows, the FP8 kernel's operands; the rounded values are
  // exact in bf16, so the bf16 kernel computes what the e4m3 product computes, up to the sum's order).
  // Random Gaussian operands: scores without a trained model's peaks, many near-ties at the k-th: a hard case.
  {
    const int64_t NQ = 256;
    auto fp8_rows = [&](const std::vector<float>& v) {  // the FP8 path's operand values (its CPU twin's)
      std::vector<float> out(v.size());
      dsv4_indexer_fp8_rows(v.data(), int64_t(v.size()) / I, I, nullptr, nullptr, out.data());
      return out;
    };
    for (const int64_t T : {int64_t(8192), int64_t(32768), int64_t(131072)}) {
      const int64_t NB = T / 4;
      const auto q = round_bf16(randn(size_t(NQ * H * I))), k = round_bf16(randn(size_t(NB * I)));
      const auto w = randn(size_t(NQ * H), 0.1f);
      const cuda::IndexerShape sh{NQ, T - NQ, H, NB, 4, K};
      auto top = [&](const std::vector<float>& qv, const std::vector<float>& kv, std::vector<float>* scores_out) {
        auto dq = to_device_bf16(qv), dk = to_device_bf16(kv), dw = to_device_f32(w);
        cuda::DeviceBuffer sc(size_t(NQ * NB) * 4), idx(size_t(NQ * K) * 4);
        cuda::indexer_scores(dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(), dw.as<float>(), sc.as<float>(), sh, I, nullptr);
        cuda::indexer_topk(sc.as<float>(), idx.as<int32_t>(), sh, nullptr);
        PDB_CUDA_CHECK(cudaDeviceSynchronize());
        if (scores_out) *scores_out = from_device_f32(sc, size_t(NQ * NB));
        std::vector<int32_t> out(size_t(NQ * K));
        idx.download(out.data(), out.size() * 4);
        return out;
      };
      // the FP8 kernels themselves (the engine's operands: q from f32, the rows from bf16), queries or keys as A
      auto top_fp8 = [&](const char* a_operand) {
        setenv("PDBRIDGE_DSV4_INDEXER_A", a_operand, 1);
        auto dqf = to_device_f32(q), dk = to_device_bf16(k), dw = to_device_f32(w);
        cuda::DeviceBuffer dq8(q.size()), dq8s(size_t(NQ * H) * 4), dk8(k.size()), dk8s(size_t(NB) * 4);
        cuda::DeviceBuffer sc(size_t(NQ * NB) * 4), idx(size_t(NQ * K) * 4);
        cuda::indexer_fp8_rows(dqf.as<float>(), NQ * H, I, dq8.as<uint8_t>(), dq8s.as<float>(), nullptr);
        cuda::indexer_fp8_rows(dk.as<__nv_bfloat16>(), NB, I, dk8.as<uint8_t>(), dk8s.as<float>(), nullptr);
        cuda::indexer_scores_fp8(dq8.as<uint8_t>(), dq8s.as<float>(), dk8.as<uint8_t>(), dk8s.as<float>(), dw.as<float>(), sc.as<float>(), sh, I, nullptr);
        cuda::indexer_topk(sc.as<float>(), idx.as<int32_t>(), sh, nullptr);
        PDB_CUDA_CHECK(cudaDeviceSynchronize());
        unsetenv("PDBRIDGE_DSV4_INDEXER_A");
        std::vector<int32_t> out(size_t(NQ * K));
        idx.download(out.data(), out.size() * 4);
        return out;
      };
      std::vector<float> s16;
      const auto a = top(q, k, &s16), b = top(fp8_rows(q), fp8_rows(k), nullptr);
      const auto by_queries = top_fp8("smem"), by_keys = top_fp8("keys");
      auto held = [&](const std::vector<int32_t>& x) {  // the average share of the bf16 top-k that x keeps
        double sum = 0;
        for (int64_t t = 0; t < NQ; ++t) {
          std::set<int32_t> sa(a.begin() + t * K, a.begin() + (t + 1) * K);
          for (int j = 0; j < K; ++j) sum += sa.count(x[size_t(t * K + j)]) ? 1.0 / K : 0.0;
        }
        return sum / double(NQ);
      };
      double shared_sum = 0, worst_shared = 1, worst_gap = 0;
      for (int64_t t = 0; t < NQ; ++t) {
        std::set<int32_t> sa(a.begin() + t * K, a.begin() + (t + 1) * K);
        int shared = 0;
        for (int j = 0; j < K; ++j) shared += sa.count(b[size_t(t * K + j)]) ? 1 : 0;
        shared_sum += double(shared) / K;
        worst_shared = std::min(worst_shared, double(shared) / K);
        // how far below the bf16 k-th score the FP8 choice reaches, in units of the bf16 scores' spread
        const int64_t vis = (T - NQ + t + 1) / 4;  // the blocks this query sees (the rest score -inf)
        std::vector<float> row(s16.begin() + t * NB, s16.begin() + t * NB + vis);
        std::vector<float> sorted = row;
        std::nth_element(sorted.begin(), sorted.begin() + (K - 1), sorted.end(), std::greater<float>());
        const float kth = sorted[size_t(K - 1)];
        double mean = 0, var = 0;
        for (float x : row) mean += x;
        mean /= double(vis);
        for (float x : row) var += (x - mean) * (x - mean);
        const double sd = std::sqrt(var / double(vis));
        for (int j = 0; j < K; ++j) worst_gap = std::max(worst_gap, double(kth - row[size_t(b[size_t(t * K + j)])]) / sd);
      }
      std::printf("DSV4 INDEXER FP8 T=%lld (last %lld queries, %lld blocks, top %d): bf16 top-k held %.4f on average, worst query %.4f; the "
                  "furthest FP8 choice %.3f score SDs below the bf16 k-th; the FP8 kernels' own top-k held %.4f (queries as A, "
                  "PDBRIDGE_DSV4_INDEXER_A=smem) and %.4f (keys as A, the heads summed in bf16 products: the default)\n",
                  (long long)T, (long long)NQ, (long long)NB, K, shared_sum / double(NQ), worst_shared, worst_gap, held(by_queries), held(by_keys));
    }
  }
  // Then the two fused kernels over whole prompts in chunks of 4,096 queries (FP8: the rows' quantization, once per
  // prompt, and each chunk's queries' inside the time, as the engine pays them).
  for (const int64_t T : {int64_t(8192), int64_t(32768), int64_t(131072)}) {
    const int64_t NB = T / 4, QC = 4096;
    const auto qv = round_bf16(randn(size_t(QC * H * I))), kv = round_bf16(randn(size_t(NB * I)));
    auto dq = to_device_bf16(qv), dqf = to_device_f32(qv), dk = to_device_bf16(kv), dw = to_device_f32(randn(size_t(QC * H), 0.1f));
    cuda::DeviceBuffer dq8(qv.size()), dq8s(size_t(QC * H) * 4), dk8(kv.size()), dk8s(size_t(NB) * 4);
    const int64_t chunk = QC;  // the queries reused along the prompt; <= 512 MiB of scores at 128K
    cuda::DeviceBuffer sc(size_t(chunk * NB) * 4), idx(size_t(chunk * K) * 4);
    float ms[4] = {0, 0, 0, 0}, scores_ms[4] = {0, 0, 0, 0};
    // bf16; FP8 reading the queries from shared memory; FP8 with them as register fragments; FP8 with the keys as A
    for (int way = 0; way < 4; ++way) {
      const int fp8 = way > 0;
      if (fp8) setenv("PDBRIDGE_DSV4_INDEXER_A", way == 1 ? "smem" : way == 2 ? "registers" : "keys", 1);
      for (int rep = 0; rep < 3; ++rep) {  // the first a warm-up, the third the scores alone
        cudaEvent_t a, b;
        PDB_CUDA_CHECK(cudaEventCreate(&a));
        PDB_CUDA_CHECK(cudaEventCreate(&b));
        PDB_CUDA_CHECK(cudaEventRecord(a));
        if (fp8) cuda::indexer_fp8_rows(dk.as<__nv_bfloat16>(), NB, I, dk8.as<uint8_t>(), dk8s.as<float>(), nullptr);
        for (int64_t p0 = 0; p0 < T; p0 += chunk) {
          const int64_t n_here = std::min(chunk, T - p0), nb = std::max<int64_t>(1, (p0 + n_here) / 4);
          const cuda::IndexerShape sh{n_here, p0, H, nb, 4, K};
          if (fp8) {
            cuda::indexer_fp8_rows(dqf.as<float>(), n_here * H, I, dq8.as<uint8_t>(), dq8s.as<float>(), nullptr);
            cuda::indexer_scores_fp8(dq8.as<uint8_t>(), dq8s.as<float>(), dk8.as<uint8_t>(), dk8s.as<float>(), dw.as<float>(), sc.as<float>(), sh, I,
                                     nullptr);
          } else {
            cuda::indexer_scores(dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(), dw.as<float>(), sc.as<float>(), sh, I, nullptr);
          }
          if (rep < 2) cuda::indexer_topk(sc.as<float>(), idx.as<int32_t>(), sh, nullptr);
        }
        PDB_CUDA_CHECK(cudaEventRecord(b));
        PDB_CUDA_CHECK(cudaEventSynchronize(b));
        PDB_CUDA_CHECK(cudaEventElapsedTime(rep < 2 ? &ms[way] : &scores_ms[way], a, b));
        cudaEventDestroy(a);
        cudaEventDestroy(b);
      }
      unsetenv("PDBRIDGE_DSV4_INDEXER_A");
    }
    const double flops = 2.0 * H * I * double(T) * double(T) / 8.0;  // each query t sees (t+1)/4 blocks: T^2/8 dot products in all
    std::printf("DSV4 INDEXER FUSED T=%lld (one ratio-4 layer, scores + top-%d, chunks of %lld queries): bf16 %.2f ms (%.0f TFLOP/s), FP8 %.2f ms "
                "(%.0f TFLOP/s, quantization included): FP8/bf16 %.2fx faster; FP8 with the queries as register fragments "
                "(PDBRIDGE_DSV4_INDEXER_A=registers) %.2f ms (%.0f TFLOP/s): %.2fx the shared-memory operand's speed; FP8 with the keys as A "
                "and the heads summed by products (=keys) %.2f ms (%.0f TFLOP/s): %.2fx the shared-memory operand's speed\n",
                (long long)T, K, (long long)chunk, ms[0], flops / (ms[0] * 1e-3) / 1e12, ms[1], flops / (ms[1] * 1e-3) / 1e12, ms[0] / ms[1], ms[2],
                flops / (ms[2] * 1e-3) / 1e12, ms[1] / ms[2], ms[3], flops / (ms[3] * 1e-3) / 1e12, ms[1] / ms[3]);
    std::printf("DSV4 INDEXER SCORES T=%lld (the same without the top-k): bf16 %.2f ms (%.0f TFLOP/s), FP8 queries from shared memory %.2f (%.0f), "
                "queries as register fragments %.2f (%.0f), keys as A %.2f (%.0f): keys/shared-memory %.2fx faster\n",
                (long long)T, scores_ms[0], flops / (scores_ms[0] * 1e-3) / 1e12, scores_ms[1], flops / (scores_ms[1] * 1e-3) / 1e12, scores_ms[2],
                flops / (scores_ms[2] * 1e-3) / 1e12, scores_ms[3], flops / (scores_ms[3] * 1e-3) / 1e12, scores_ms[1] / scores_ms[3]);
  }
#endif
}

#ifdef PDBRIDGE_HAVE_CUDA
// The worst difference of a device mix [n x 24] and pre-sum [n x E] from the host's (dsv4_hc_pre's).
double mix_error(const std::vector<float>& gm, const std::vector<float>& gy, const std::vector<Dsv4HcMix>& want, const std::vector<float>& want_y,
                 int64_t n, int64_t E) {
  double worst = 0;
  for (int64_t t = 0; t < n; ++t) {
    const Dsv4HcMix& w = want[size_t(t)];
    for (int i = 0; i < 4; ++i) {
      worst = std::max(worst, double(std::fabs(gm[size_t(t * 24 + i)] - w.pre[i])));
      worst = std::max(worst, double(std::fabs(gm[size_t(t * 24 + 4 + i)] - w.post[i])));
    }
    for (int d = 0; d < 4; ++d)
      for (int k = 0; k < 4; ++k) worst = std::max(worst, double(std::fabs(gm[size_t(t * 24 + 8 + d * 4 + k)] - w.comb[d][k])));
    for (int64_t i = 0; i < E; ++i) worst = std::max(worst, double(std::fabs(gy[size_t(t * E + i)] - want_y[size_t(t * E + i)])) / 4.0);
  }
  return worst;
}

#endif

// The hyper-connection mix, the Hadamard rotation, the q path's fused head norm and MXFP4's expansion against their twins
// (dsv4_hc_pre, hadamard_rows, dequantize_row): the rotation and MXFP4 bit for bit (the same operations in the
// same order; e2m1 x 2^k is exact in bf16), the mix within f32 rounding (expf differs by an ulp).
TEST(CudaKernels, Dsv4MixRotationAndMxfp4MatchTheirCpuTwins) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  using namespace test_kernels;
  {  // the mix: m from the same products on both sides (host), then pre / post / comb and y
    const int64_t n = 37, E = 256;
    const auto x = randn(size_t(n * 4 * E)), fn = randn(size_t(24 * 4 * E), 0.02f), base = randn(24, 0.3f);
    const std::vector<float> scale = {0.9f, 1.1f, 1.3f};
    std::vector<float> m(size_t(n * 24)), want_y(size_t(n * E));
    std::vector<Dsv4HcMix> want(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) {
      want[size_t(t)] = dsv4_hc_pre({&fn, &base, &scale}, x.data() + t * 4 * E, E, 1e-6f, 1e-6f, 20, want_y.data() + t * E);
      std::vector<float> xn(size_t(4 * E));
      double ss = 0;
      for (int64_t i = 0; i < 4 * E; ++i) ss += double(x[size_t(t * 4 * E + i)]) * x[size_t(t * 4 * E + i)];
      const float rs = 1.0f / std::sqrt(float(ss / double(4 * E)) + 1e-6f);
      for (int o = 0; o < 24; ++o) {
        float acc = 0.0f;
        for (int64_t i = 0; i < 4 * E; ++i) acc += fn[size_t(o * 4 * E + i)] * (x[size_t(t * 4 * E + i)] * rs);
        m[size_t(t * 24 + o)] = acc;
      }
    }
    auto dm = to_device_f32(m), dx = to_device_f32(x), db = to_device_f32(base), ds = to_device_f32(scale);
    cuda::DeviceBuffer mix(size_t(n * 24) * 4), y(size_t(n * E) * 4);
    cuda::dsv4_hc_mix(dm.as<float>(), dx.as<float>(), db.as<float>(), ds.as<float>(), n, E, 1e-6f, 20, mix.as<float>(), y.as<float>(), nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const auto gm = from_device_f32(mix, size_t(n * 24)), gy = from_device_f32(y, size_t(n * E));
    EXPECT_LE(mix_error(gm, gy, want, want_y, n, E), 1e-4) << "the mix differs from dsv4_hc_pre's";
  }
  {  // the engine's way to the same mix: products of the raw streams times each row's inv-rms (dsv4_row_inv_rms,
     // dsv4_hc_coefs with a row stride of 48), the pre-sum alone, and hc_post's x_next with its own inv-rms; both
     // sides E = 256 (float4 passes) and E = 6 (scalar)
    for (const int64_t E : {int64_t(256), int64_t(6)}) {
      const int64_t n = 41;
      const auto x = randn(size_t(n * 4 * E)), fn = randn(size_t(24 * 4 * E), 0.02f), base = randn(24, 0.3f), f = randn(size_t(n * E));
      const std::vector<float> scale = {0.9f, 1.1f, 1.3f};
      std::vector<float> m48(size_t(n * 48), 0.0f), want_y(size_t(n * E)), want_inv(static_cast<size_t>(n)), want_next(size_t(n * 4 * E)), want_next_inv(static_cast<size_t>(n));
      std::vector<Dsv4HcMix> want(static_cast<size_t>(n));
      for (int64_t t = 0; t < n; ++t) {
        const float* xt = x.data() + t * 4 * E;
        want[size_t(t)] = dsv4_hc_pre({&fn, &base, &scale}, xt, E, 1e-6f, 1e-6f, 20, want_y.data() + t * E);
        double ss = 0;
        for (int64_t i = 0; i < 4 * E; ++i) ss += double(xt[i] * xt[i]);
        want_inv[size_t(t)] = 1.0f / std::sqrt(float(ss / double(4 * E)) + 1e-6f);
        for (int o = 0; o < 24; ++o) {  // the raw products in the row's second half (the first: the recipe's, unused here)
          float acc = 0.0f;
          for (int64_t i = 0; i < 4 * E; ++i) acc += fn[size_t(o * 4 * E + i)] * xt[i];
          m48[size_t(t * 48 + 24 + o)] = acc;
        }
        dsv4_hc_post(want[size_t(t)], f.data() + t * E, xt, E, want_next.data() + t * 4 * E);
        double sn = 0;
        for (int64_t i = 0; i < 4 * E; ++i) sn += double(want_next[size_t(t * 4 * E + i)] * want_next[size_t(t * 4 * E + i)]);
        want_next_inv[size_t(t)] = 1.0f / std::sqrt(float(sn / double(4 * E)) + 1e-6f);
      }
      auto dm = to_device_f32(m48), dx = to_device_f32(x), db = to_device_f32(base), ds = to_device_f32(scale), df = to_device_f32(f);
      cuda::DeviceBuffer inv(size_t(n) * 4), mix(size_t(n * 24) * 4), y(size_t(n * E) * 4), next(x.size() * 4), next_inv(size_t(n) * 4);
      cuda::dsv4_row_inv_rms(dx.as<float>(), n, 4 * E, 1e-6f, inv.as<float>(), nullptr);
      cuda::dsv4_hc_coefs(dm.as<float>() + 24, 48, inv.as<float>(), db.as<float>(), ds.as<float>(), n, 1e-6f, 20, mix.as<float>(), nullptr);
      cuda::dsv4_hc_pre_sum(dx.as<float>(), mix.as<float>(), n, E, y.as<float>(), nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      const auto gi = from_device_f32(inv, size_t(n)), gm = from_device_f32(mix, size_t(n * 24)), gy = from_device_f32(y, size_t(n * E));
      // hc_post from the host's mix, so that only its own arithmetic is compared (the same operations; the host's
      // compiler may contract them into FMAs, so within a few f32 ulps)
      std::vector<float> host_mix(size_t(n * 24));
      for (int64_t t = 0; t < n; ++t) {
        const Dsv4HcMix& w = want[size_t(t)];
        for (int i = 0; i < 4; ++i) host_mix[size_t(t * 24 + i)] = w.pre[i], host_mix[size_t(t * 24 + 4 + i)] = w.post[i];
        for (int d = 0; d < 4; ++d)
          for (int k = 0; k < 4; ++k) host_mix[size_t(t * 24 + 8 + d * 4 + k)] = w.comb[d][k];
      }
      auto dhm = to_device_f32(host_mix);
      cuda::dsv4_hc_post(df.as<float>(), dhm.as<float>(), dx.as<float>(), n, E, next.as<float>(), nullptr, next_inv.as<float>(), 1e-6f);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      const auto gn = from_device_f32(next, x.size()), gni = from_device_f32(next_inv, size_t(n));
      double worst_inv = 0;
      for (int64_t t = 0; t < n; ++t) {
        worst_inv = std::max(worst_inv, double(std::fabs(gi[size_t(t)] - want_inv[size_t(t)]) / want_inv[size_t(t)]));
        worst_inv = std::max(worst_inv, double(std::fabs(gni[size_t(t)] - want_next_inv[size_t(t)]) / want_next_inv[size_t(t)]));
      }
      EXPECT_LE(worst_inv, 1e-6) << "inv-rms off the host's, E = " << E;
      EXPECT_LE(mix_error(gm, gy, want, want_y, n, E), 1e-4) << "the mix from the raw products differs from dsv4_hc_pre's, E = " << E;
      double worst_next = 0;
      for (size_t i = 0; i < gn.size(); ++i)
        worst_next = std::max(worst_next, double(std::fabs(gn[i] - want_next[i])) / (1.0 + std::fabs(double(want_next[i]))));
      EXPECT_LE(worst_next, 1e-6) << "hc_post differs from the host's, E = " << E;
    }
  }
  {  // the rotation: groups of 512 and 128, bit for bit
    for (const int nrot : {512, 128}) {
      auto v = randn(size_t(nrot * 9));
      auto want = v;
      hadamard_rows(want.data(), int64_t(want.size()), nrot);
      auto dv = to_device_f32(v);
      cuda::hadamard_groups(dv.as<float>(), 9, nrot, nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(from_device_f32(dv, v.size()), want) << "rotation of " << nrot;
    }
  }
  {  // the q path's fused head norm + RoPE + bf16 against its three steps (rmsnorm_rows, rope_tail, f32_to_bf16):
     // the same float operations; only the double sum's order differs, so a value may move by one bf16 ulp
    const int64_t n = 33;
    const int heads = 64, D = 512, r = 64;
    const auto q = randn(size_t(n * heads * D), 3.0f);
    std::vector<float> cs(size_t(n * r));
    for (int64_t t = 0; t < n; ++t)
      for (int i = 0; i < r; i += 2) {
        cs[size_t(t * r + i)] = std::cos(0.37f * float(t) * float(i + 1));
        cs[size_t(t * r + i + 1)] = std::sin(0.37f * float(t) * float(i + 1));
      }
    auto dq = to_device_f32(q), dcs = to_device_f32(cs);
    cuda::DeviceBuffer fused(q.size() * 2), steps(q.size() * 2), tmp(q.size() * 4);
    cuda::dsv4_head_norm_rope_bf16(dq.as<float>(), dcs.as<float>(), n, heads, D, r, 1e-6f, fused.as<__nv_bfloat16>(), nullptr);
    cuda::rmsnorm_rows(dq.as<float>(), nullptr, tmp.as<float>(), n * heads, D, 1e-6f, nullptr);
    cuda::rope_tail(tmp.as<float>(), dcs.as<float>(), n, heads, D, r, int64_t(heads) * D, nullptr);
    cuda::f32_to_bf16(tmp.as<float>(), steps.as<__nv_bfloat16>(), int64_t(q.size()), nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const auto a = from_device_bf16(fused, q.size()), b = from_device_bf16(steps, q.size());
    size_t differ = 0;
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] != b[i]) ++differ;
      worst = std::max(worst, double(std::fabs(a[i] - b[i])) / std::max(1e-6, double(std::fabs(b[i]))));
    }
    EXPECT_LE(differ, a.size() / 1000) << "values off the three steps' result";
    EXPECT_LE(worst, 1.0 / 128) << "a value moved by more than one bf16 ulp";
    // from a bf16 q: exactly the f32 kernel's result on the bf16-rounded q (the same float operations)
    std::vector<float> q16(q.size());
    for (size_t i = 0; i < q.size(); ++i) q16[i] = round_bf16(q[i]);
    auto dq16f = to_device_f32(q16);
    cuda::DeviceBuffer dq16(q.size() * 2), from16(q.size() * 2), from32(q.size() * 2);
    cuda::f32_to_bf16(dq16f.as<float>(), dq16.as<__nv_bfloat16>(), int64_t(q.size()), nullptr);
    cuda::dsv4_head_norm_rope_bf16(dq16.as<__nv_bfloat16>(), dcs.as<float>(), n, heads, D, r, 1e-6f, from16.as<__nv_bfloat16>(), nullptr);
    cuda::dsv4_head_norm_rope_bf16(dq16f.as<float>(), dcs.as<float>(), n, heads, D, r, 1e-6f, from32.as<__nv_bfloat16>(), nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(from_device_bf16(from16, q.size()), from_device_bf16(from32, q.size())) << "the bf16 input's pass differs from the f32 one's";
  }
  {  // MXFP4 blocks from the reference quantizer, expanded bit for bit
    const int64_t n = 32 * 64;
    const auto v = randn(size_t(n), 0.05f);
    std::vector<uint8_t> blocks(ggml_row_bytes(GgmlType::MXFP4, n));
    quantize_row(GgmlType::MXFP4, v.data(), blocks.data(), n);
    std::vector<float> want(static_cast<size_t>(n));
    dequantize_row(GgmlType::MXFP4, blocks.data(), want.data(), n);
    cuda::DeviceBuffer db(blocks.size()), out(size_t(n) * 2);
    db.upload(blocks.data(), blocks.size());
    cuda::mxfp4_to_bf16(db.as<uint8_t>(), n / 32, out.as<__nv_bfloat16>(), nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(from_device_bf16(out, size_t(n)), want) << "MXFP4 expansion";
  }
  {  // MXFP4 experts as FP8 tiles for the FP8 products: code x tile scale gives MXFP4's value bit for bit while a
     // tile's block exponents lie within 9 of its largest; one block 14 binades down rounds and is counted. Two
     // tensors of [experts x half x cols] into the halves of each expert's rows (row0), as the engine's gate and up.
    const int64_t experts = 2, half = 128, rows = 2 * half, cols = 256, nbk = cols / 32;
    for (const bool spread : {false, true}) {
      std::vector<uint8_t> blocks[2];
      std::vector<float> want(size_t(experts * rows * cols));
      for (int h = 0; h < 2; ++h) {
        blocks[h].resize(size_t(experts * half * nbk) * 17);
        for (int64_t b = 0; b < experts * half * nbk; ++b) {
          auto v = randn(32, std::ldexp(1.0f, -int(b % 7)));  // block exponents over 7 binades
          if (spread && h == 1 && b == 5) for (float& x : v) x *= std::ldexp(1.0f, -14);
          quantize_row(GgmlType::MXFP4, v.data(), blocks[h].data() + b * 17, 32);
          const int64_t x = b / (half * nbk), r = (b / nbk) % half, kb = b % nbk;
          dequantize_row(GgmlType::MXFP4, blocks[h].data() + b * 17, want.data() + (x * rows + h * half + r) * cols + kb * 32, 32);
        }
      }
      const int64_t tn = rows / 128, tk = cols / 128;
      cuda::DeviceBuffer codes(size_t(experts * rows * cols)), scales(size_t(experts * tn * tk) * 4), lost(4);
      PDB_CUDA_CHECK(cudaMemset(lost.get(), 0, 4));
      cuda::DeviceBuffer db[2] = {cuda::DeviceBuffer(blocks[0].size()), cuda::DeviceBuffer(blocks[1].size())};
      for (int h = 0; h < 2; ++h) {
        db[h].upload(blocks[h].data(), blocks[h].size());
        cuda::mxfp4_to_fp8_tiles({db[h].as<uint8_t>(), experts, half, cols, codes.as<uint8_t>(), rows * cols, h * half, scales.as<float>(), tn * tk, tk, true,
                                  lost.as<unsigned>()}, nullptr);
      }
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<uint8_t> hc(size_t(experts * rows * cols));
      std::vector<float> hs(size_t(experts * tn * tk));
      unsigned hl = 0;
      codes.download(hc.data(), hc.size());
      scales.download(hs.data(), hs.size() * 4);
      lost.download(&hl, 4);
      size_t differ = 0;
      for (int64_t x = 0; x < experts; ++x)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const float got = fp8_e4m3_to_f32(hc[size_t((x * rows + r) * cols + c)]) * hs[size_t(x * tn * tk + (r / 128) * tk + c / 128)];
            differ += got != want[size_t((x * rows + r) * cols + c)];
          }
      if (!spread) {
        EXPECT_EQ(differ, 0u) << "FP8 tiles of MXFP4";
        EXPECT_EQ(hl, 0u);
      } else {
        EXPECT_GT(hl, 0u) << "a block 14 binades under its tile's largest rounds, and is counted";
        EXPECT_LE(differ, size_t(hl)) << "only the counted values differ";
      }
    }
  }
#endif
}

}  // namespace pdb
