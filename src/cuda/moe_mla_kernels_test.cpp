// The MoE and MLA kernels against their CPU twins on fresh random inputs: MLA's 192/128 attention
// against the f64 twin, the routing against a plain softmax + top-k, the grouping's invariants, the
// whole MoE block (cuda_moe_ffn) against the CPU block (model/moe_ffn.h, its fast path), and MLA's
// RoPE / scatter against the same arithmetic on the host. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <numeric>
#include <random>

#include "cuda/device.h"
#include "formats/numeric.h"
#include "model/moe_ffn.h"
#include "numerics/reference_ops.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include <cuda_bf16.h>

#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/cudnn_graph.h"
#include "cuda/gemm.cuh"
#include "cuda/mla.cuh"
#include "cuda/moe.cuh"
#include "cuda/readback.cuh"
#include "cuda/kernel_test_support.h"
#include "model/cuda_moe_ffn.h"
#endif

namespace pdb {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary()

#ifdef PDBRIDGE_HAVE_CUDA
using namespace test_kernels;
std::vector<float> randn_bf16(size_t n, float sd = 1.0f) { return round_bf16(randn(n, sd)); }
template <class T>
std::vector<T> host(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  b.download(v.data(), n * sizeof(T));
  return v;
}
#endif

}  // namespace

TEST(CudaKernels, MlaAttention192KeysAnd128ValuesMatchTheF64Twin) {
  SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  struct Case { int H; int64_t pos0, n_q; };
  for (const Case c : {Case{4, 0, 300}, Case{16, 500, 77}, Case{2, 1000, 1}}) {
    const int D = 192, DV = 128;
    const int64_t cap = c.pos0 + c.n_q + 3;
    auto q = randn_bf16(size_t(c.n_q * c.H * D)), k = randn_bf16(size_t(c.H * cap * D)), v = randn_bf16(size_t(c.H * cap * DV));
    for (int h = 0; h < c.H; ++h)  // rows past the keys: NaN, never to be read
      for (int64_t j = c.pos0 + c.n_q; j < cap; ++j) {
        for (int d = 0; d < D; ++d) k[size_t((h * cap + j) * D + d)] = NAN;
        for (int d = 0; d < DV; ++d) v[size_t((h * cap + j) * DV + d)] = NAN;
      }
    const float scale = 0.0723f;
    std::vector<float> want;
    ref::causal_attention(q, k, v, want, c.n_q, c.pos0, c.H, c.H, D, cap, scale, DV);
    auto dq = to_device_bf16(q), dk = to_device_bf16(k), dv = to_device_bf16(v);
    cuda::DeviceBuffer out(want.size() * 2);
    PDB_CUDA_CHECK(cudaMemset(out.get(), 0xff, out.bytes()));
    cuda::AttentionShape s{c.n_q, c.pos0, c.H, c.H, D, cap, scale, DV};
    EXPECT_FALSE(cuda::wgmma_attention_supported(s));
    cuda::causal_attention(dq.as<__nv_bfloat16>(), dk.as<__nv_bfloat16>(), dv.as<__nv_bfloat16>(), out.as<__nv_bfloat16>(), s, nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const double e = ref::rel_error(from_device_bf16(out, want.size()), want);
    std::printf("MLA attention H=%d pos0=%lld n_q=%lld: rel err %.2e\n", c.H, (long long)c.pos0, (long long)c.n_q, e);
    EXPECT_LT(e, 1e-2);
  }
  cuda::AttentionShape bad{4, 0, 2, 2, 192, 8, 1.0f, 64};
  EXPECT_THROW(cuda::causal_attention(nullptr, nullptr, nullptr, nullptr, bad, nullptr), std::invalid_argument);
#endif
}

TEST(CudaKernels, MoeRoutingAndGroupingMatchSoftmaxTopKAndPlaceEveryChoiceOnce) {
  SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  struct Case { int64_t rows; int E, k; bool renorm; float scale; };
  for (const Case c : {Case{300, 8, 2, true, 1.0f}, Case{1000, 128, 8, true, 1.0f}, Case{257, 64, 6, false, 2.5f}, Case{5, 256, 8, true, 1.0f}}) {
    std::normal_distribution<float> d(0.0f, 2.0f);
    std::vector<float> logits(size_t(c.rows * c.E));
    for (auto& x : logits) x = d(rng());
    auto dl = to_device_f32(logits);
    cuda::DeviceBuffer ex(size_t(c.rows * c.k) * 4), wt(size_t(c.rows * c.k) * 4), counts(size_t(c.E) * 4), offs(size_t(c.E) * 4),
        slot_of(size_t(c.rows * c.k) * 4), token_of(size_t(c.rows * c.k) * 4);
    cuda::MoeRouteArgs a{c.rows, c.E, c.k, c.renorm, c.scale};
    cuda::moe_route(dl.as<float>(), ex.as<int32_t>(), wt.as<float>(), a, nullptr);
    cuda::moe_group(ex.as<int32_t>(), c.rows, c.k, c.E, counts.as<int32_t>(), offs.as<int32_t>(), slot_of.as<int32_t>(), token_of.as<int32_t>(),
                    nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    auto ge = host<int32_t>(ex, size_t(c.rows * c.k));
    auto gw = host<float>(wt, size_t(c.rows * c.k));
    auto gc = host<int32_t>(counts, size_t(c.E)), go = host<int32_t>(offs, size_t(c.E));
    auto gs = host<int32_t>(slot_of, size_t(c.rows * c.k)), gt = host<int32_t>(token_of, size_t(c.rows * c.k));
    int64_t wrong_expert = 0;
    double worst_w = 0;
    for (int64_t r = 0; r < c.rows; ++r) {
      const float* lg = logits.data() + r * c.E;
      std::vector<int> order(size_t(c.E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return lg[x] > lg[y]; });
      double mx = lg[order[0]], sum = 0, picked = 0;
      for (int e = 0; e < c.E; ++e) sum += std::exp(double(lg[e]) - mx);
      for (int j = 0; j < c.k; ++j) picked += std::exp(double(lg[order[size_t(j)]]) - mx) / sum;
      for (int j = 0; j < c.k; ++j) {
        wrong_expert += ge[size_t(r * c.k + j)] != order[size_t(j)];
        double w = std::exp(double(lg[order[size_t(j)]]) - mx) / sum;
        if (c.renorm) w /= picked;
        w *= c.scale;
        worst_w = std::max(worst_w, std::abs(double(gw[size_t(r * c.k + j)]) - w) / w);
      }
    }
    // grouping: counts are the histogram, offsets its scan, every choice has one slot, slots of an
    // expert are contiguous and in token order
    std::vector<int32_t> hist(size_t(c.E), 0);
    for (int32_t e : ge) ++hist[size_t(e)];
    EXPECT_EQ(gc, hist);
    int32_t run = 0;
    for (int e = 0; e < c.E; ++e) { EXPECT_EQ(go[size_t(e)], run); run += hist[size_t(e)]; }
    std::vector<int> seen(size_t(c.rows * c.k), 0);
    bool ordered = true;
    for (int64_t i = 0; i < c.rows * c.k; ++i) {
      const int32_t slot = gs[size_t(i)], e = ge[size_t(i)];
      ASSERT_GE(slot, go[size_t(e)]);
      ASSERT_LT(slot, go[size_t(e)] + gc[size_t(e)]);
      ++seen[size_t(slot)];
      EXPECT_EQ(gt[size_t(slot)], int32_t(i / c.k));
      if (slot > go[size_t(e)]) ordered &= gt[size_t(slot - 1)] <= gt[size_t(slot)];
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
    EXPECT_TRUE(ordered);
    std::printf("MoE routing %lld rows, %d of %d: %lld experts differ from the f64 ranking, worst weight rel err %.2e\n", (long long)c.rows, c.k, c.E,
                (long long)wrong_expert, worst_w);
    EXPECT_EQ(wrong_expert, 0);  // continuous random logits: no ties
    EXPECT_LT(worst_w, 1e-5);
  }
#endif
}

// The expert counts' way to the host (cuda/readback.cuh): mapped stores by default, a copy with PDBRIDGE_READBACK=copy;
// each fetch sees what was queued on its stream before it, behind a large copy on another stream, not a stale value.
TEST(CudaKernels, ReadbackSeesWhatWasQueuedBeforeIt) {
  SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  for (const char* way : {"", "copy"}) {
    setenv("PDBRIDGE_READBACK", way, 1);
    cuda::Readback back;
    cudaStream_t s = nullptr, other = nullptr;
    PDB_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    PDB_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
    cuda::DeviceBuffer big(size_t(64) << 20), vals(300 * 4);
    cuda::PinnedBuffer big_host(size_t(64) << 20), src(300 * 4);
    for (int round = 0; round < 3; ++round) {
      for (int i = 0; i < 300; ++i) src.as<int32_t>()[i] = round * 1000 + i * 7 - 5;
      PDB_CUDA_CHECK(cudaMemcpyAsync(big_host.as<void>(), big.get(), big.bytes(), cudaMemcpyDeviceToHost, other));
      PDB_CUDA_CHECK(cudaMemcpyAsync(vals.get(), src.as<void>(), 300 * 4, cudaMemcpyHostToDevice, s));
      const int32_t* got = back.fetch(vals.as<int32_t>(), 300, s);
      for (int i = 0; i < 300; ++i) ASSERT_EQ(got[i], round * 1000 + i * 7 - 5) << "PDBRIDGE_READBACK=" << way << " round " << round << " value " << i;
    }
    PDB_CUDA_CHECK(cudaStreamSynchronize(other));
    cudaStreamDestroy(s);
    cudaStreamDestroy(other);
  }
  unsetenv("PDBRIDGE_READBACK");
#endif
}

TEST(CudaKernels, MoeBlockTracksTheCpuBlock) {
  SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  const int64_t rows = 333, H = 256, F = 128;
  for (const auto& [E, k] : {std::pair<int, int>{8, 2}, std::pair<int, int>{64, 6}}) {
    MoeWeights cw;
    cw.n_expert = E; cw.n_used = k; cw.hidden = H; cw.ff = F; cw.norm_topk = true;
    cw.router = randn_bf16(size_t(E * H), 0.2f);
    CudaMoeWeights gw;
    gw.n_expert = E; gw.n_used = k; gw.hidden = H; gw.ff = F; gw.renormalize = true;
    gw.router = to_device_bf16(cw.router);
    std::vector<float> gu_all, d_all;
    for (int e = 0; e < E; ++e) {
      cw.gate.push_back(randn_bf16(size_t(F * H), 0.06f));
      cw.up.push_back(randn_bf16(size_t(F * H), 0.06f));
      cw.down.push_back(randn_bf16(size_t(H * F), 0.09f));
      gu_all.insert(gu_all.end(), cw.gate.back().begin(), cw.gate.back().end());
      gu_all.insert(gu_all.end(), cw.up.back().begin(), cw.up.back().end());
      d_all.insert(d_all.end(), cw.down.back().begin(), cw.down.back().end());
    }
    gw.gu = to_device_bf16(gu_all);
    gw.down = to_device_bf16(d_all);
    auto x = randn_bf16(size_t(rows * H));
    std::vector<float> want(size_t(rows * H));
    moe_ffn(cw, x.data(), rows, 0, 32, 2, want.data());
    auto dx = to_device_bf16(x);
    // every way the expert products run (PDBRIDGE_MOE_GEMM): the default (padded chunks where they pad by at most
    // half, else cuBLAS's grouped call), always padded, cuBLAS's grouped call, one product per expert, cuDNN's
    // grouped matmul (cuBLAS's grouped call where cuDNN refuses, saying why)
    for (const char* way : {"", "padded", "grouped", "loop", "cudnn", "cudnn-gather"}) {
      setenv("PDBRIDGE_MOE_GEMM", way, 1);
      cuda::DeviceBuffer dh(size_t(rows * H) * 4);
      PDB_CUDA_CHECK(cudaMemset(dh.get(), 0, dh.bytes()));
      cuda::Gemm gemm;
      CudaMoeFfn block;
      block.forward(gw, dx.as<__nv_bfloat16>(), rows, dh.as<float>(), gemm, nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      const double e = ref::rel_error(host<float>(dh, want.size()), want);
      std::printf("MoE block %d experts top-%d, %lld rows, PDBRIDGE_MOE_GEMM=%s: ran %s, rel err vs the CPU block %.2e%s%s\n", E, k,
                  (long long)rows, way, block.last_way().c_str(), e, block.cudnn_refused().empty() ? "" : "; cuDNN refused: ",
                  block.cudnn_refused().c_str());
      EXPECT_LT(e, 2e-2) << way;
      const std::string w = way;
      if (w == "padded" || w == "grouped" || w == "loop") EXPECT_EQ(block.last_way(), w);
      if (w.empty()) EXPECT_TRUE(block.last_way() == "padded" || block.last_way() == "grouped") << block.last_way();
      if (w.rfind("cudnn", 0) == 0) EXPECT_TRUE(block.last_way() == w || (block.last_way() == "grouped" && !block.cudnn_refused().empty()));
    }
    unsetenv("PDBRIDGE_MOE_GEMM");
  }
#endif
}

TEST(CudaKernels, MlaRopeAndScatterPlaceTheRowsAsTheHostComputesThem) {
  SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  const int nh = 3, nope = 128, rope = 64, vd = 128, qk = nope + rope;
  const int64_t rows = 40, pos0 = 7, cap = 60, A = nh * qk + 512 + rope;
  auto front = randn_bf16(size_t(rows * A));
  std::vector<float> cs(size_t(rows * rope));
  for (int64_t r = 0; r < rows; ++r)
    for (int p = 0; p < rope / 2; ++p) {
      const float th = float(pos0 + r) * std::pow(10000.0f, -2.0f * float(p) / float(rope));
      cs[size_t(r * rope + 2 * p)] = std::cos(th);
      cs[size_t(r * rope + 2 * p + 1)] = std::sin(th);
    }
  auto kvb = randn_bf16(size_t(rows * nh * (nope + vd)));
  auto dfront = to_device_bf16(front), dcs = to_device_f32(cs), dkvb = to_device_bf16(kvb);
  cuda::DeviceBuffer qo(size_t(rows * nh * qk) * 2), kc(size_t(nh * cap * qk) * 2), vc(size_t(nh * cap * vd) * 2);
  PDB_CUDA_CHECK(cudaMemset(kc.get(), 0, kc.bytes()));
  PDB_CUDA_CHECK(cudaMemset(vc.get(), 0, vc.bytes()));
  cuda::MlaShape m{rows, pos0, nh, nope, rope, vd, cap};
  const auto* f = dfront.as<__nv_bfloat16>();
  cuda::mla_rope_qk(f, A, f + nh * qk + 512, A, dcs.as<float>(), qo.as<__nv_bfloat16>(), kc.as<__nv_bfloat16>(), m, nullptr);
  cuda::mla_scatter_kv(dkvb.as<__nv_bfloat16>(), kc.as<__nv_bfloat16>(), vc.as<__nv_bfloat16>(), m, nullptr);
  PDB_CUDA_CHECK(cudaDeviceSynchronize());
  auto gq = from_device_bf16(qo, size_t(rows * nh * qk)), gk = from_device_bf16(kc, size_t(nh * cap * qk)), gv = from_device_bf16(vc, size_t(nh * cap * vd));
  auto rot = [&](int64_t r, float x0, float x1, int p, bool second) {
    const float c = cs[size_t(r * rope + 2 * p)], s = cs[size_t(r * rope + 2 * p + 1)];
    return bf16_to_f32(f32_to_bf16(second ? x0 * s + x1 * c : x0 * c - x1 * s));
  };
  int64_t bad = 0, total = 0;
  auto expect_close = [&](float got, float want) { ++total; bad += std::abs(got - want) > 1e-2f * std::max(1.0f, std::abs(want)); };
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < nh; ++h) {
      const float* qs = front.data() + r * A + h * qk;
      for (int d = 0; d < nope; ++d) expect_close(gq[size_t((r * nh + h) * qk + d)], qs[d]);
      for (int p = 0; p < rope / 2; ++p)
        for (int second = 0; second < 2; ++second) {
          expect_close(gq[size_t((r * nh + h) * qk + nope + 2 * p + second)], rot(r, qs[nope + 2 * p], qs[nope + 2 * p + 1], p, second));
          const float* kp = front.data() + r * A + nh * qk + 512;
          expect_close(gk[size_t((h * cap + pos0 + r) * qk + nope + 2 * p + second)], rot(r, kp[2 * p], kp[2 * p + 1], p, second));
        }
      const float* src = kvb.data() + (r * nh + h) * (nope + vd);
      for (int d = 0; d < nope; ++d) expect_close(gk[size_t((h * cap + pos0 + r) * qk + d)], src[d]);
      for (int d = 0; d < vd; ++d) expect_close(gv[size_t((h * cap + pos0 + r) * vd + d)], src[nope + d]);
    }
  EXPECT_EQ(bad, 0) << "of " << total;
  EXPECT_EQ(gk[0], 0.0f);  // rows before pos0 untouched
#endif
}

}  // namespace pdb
