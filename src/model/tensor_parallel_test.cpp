// The sharded forward's math equals the unsharded one, before any GPU runs it: one layer's attention block,
// dense FFN and MoE FFN computed whole (the engines' CPU twins, numerics/reference_ops.h and model/moe_ffn.h) and
// as `world` ranks would compute them with the slices tp_shard gives them, the ranks' parts summed as the
// all-reduce sums them (rank 0 adding into the residual, the others into zeros).
#include "model/tensor_parallel.h"

#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "model/moe_ffn.h"
#include "numerics/reference_ops.h"

namespace pdb {
namespace {

std::vector<float> randn(size_t n, std::mt19937& g, float sd = 0.2f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}
std::vector<float> concat(std::vector<float> a, const std::vector<float>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
// The all-reduce of the ranks' residual copies: rank 0 adds its part into the residual, the others into zeros.
std::vector<float> all_reduce(const std::vector<float>& residual, const std::vector<std::vector<float>>& parts) {
  std::vector<float> sum(residual.size(), 0.0f);
  for (size_t r = 0; r < parts.size(); ++r)
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += (r == 0 ? residual[i] : 0.0f) + parts[r][i];
  return sum;
}
std::vector<float> plus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> s(a.size());
  for (size_t i = 0; i < a.size(); ++i) s[i] = a[i] + b[i];
  return s;
}

// An attention block of `nh` heads over `nkv` kv heads of width D on hidden H (qwen3's per-head q/k norms too):
// out = attention(rope(x Wqkv^T)) Wo^T.
struct AttentionBlock {
  int64_t H, nh, nkv, D;
  std::vector<float> wq, wk, wv, wo, q_norm, k_norm, inv_freq;
  std::vector<float> forward(const std::vector<float>& x, int64_t rows, int64_t pos0, const TpShard* s) const {
    const int64_t h0 = s ? s->q_head0 : 0, hn = s ? s->q_heads : nh, k0 = s ? s->kv_head0 : 0, kn = s ? s->kv_heads : nkv;
    const auto wqkv = concat(concat(rows_of(wq, H, h0 * D, hn * D), rows_of(wk, H, k0 * D, kn * D)), rows_of(wv, H, k0 * D, kn * D));
    std::vector<float> qkv, q, att, out;
    ref::matmul_xwt(x, wqkv, qkv, rows, H, (hn + 2 * kn) * D);
    const int64_t cap = pos0 + rows;
    std::vector<float> kc(size_t(kn * cap * D), 0.0f), vc(kc.size(), 0.0f);
    ref::qkv_rope_to_cache(qkv, q, kc, vc, rows, pos0, int(hn), int(kn), int(D), inv_freq, 1.0f, q_norm.data(), k_norm.data(), 1e-6f, cap);
    ref::causal_attention(q, kc, vc, att, rows, pos0, int(hn), int(kn), int(D), cap, 1.0f / std::sqrt(float(D)));
    ref::matmul_xwt(att, cols_of(wo, H, nh * D, h0 * D, hn * D), out, rows, hn * D, H);
    return out;
  }
};

struct DenseFfn {
  int64_t H, F;
  std::vector<float> gate, up, down;
  std::vector<float> forward(const std::vector<float>& x, int64_t rows, const TpShard* s) const {
    const int64_t f0 = s ? s->ff0 : 0, fn = s ? s->ff : F;
    std::vector<float> gu, act, out;
    ref::matmul_xwt(x, concat(rows_of(gate, H, f0, fn), rows_of(up, H, f0, fn)), gu, rows, H, 2 * fn);
    ref::swiglu_rows(gu, act, rows, fn);
    ref::matmul_xwt(act, cols_of(down, H, F, f0, fn), out, rows, fn, H);
    return out;
  }
};

MoeWeights moe_shard(const MoeWeights& w, const TpShard& s) {
  MoeWeights r = w;
  r.ff = s.expert_ff;
  for (int64_t e = 0; e < w.n_expert; ++e) {
    r.gate[size_t(e)] = rows_of(w.gate[size_t(e)], w.hidden, s.expert_ff0, s.expert_ff);
    r.up[size_t(e)] = rows_of(w.up[size_t(e)], w.hidden, s.expert_ff0, s.expert_ff);
    r.down[size_t(e)] = cols_of(w.down[size_t(e)], w.hidden, w.ff, s.expert_ff0, s.expert_ff);
  }
  return r;
}

TEST(TensorParallel, ShardedAttentionAndFfnSumToTheUnshardedLayer) {
  std::mt19937 g(21);
  // the shapes' ratios of Llama-3.1-8B (32 heads over 8 kv heads) at a small width
  const int64_t H = 128, nh = 8, nkv = 4, D = 16, F = 192, rows = 24, pos0 = 0;
  AttentionBlock at{H, nh, nkv, D, randn(size_t(nh * D * H), g), randn(size_t(nkv * D * H), g), randn(size_t(nkv * D * H), g),
                    randn(size_t(H * nh * D), g), randn(size_t(D), g, 1.0f), randn(size_t(D), g, 1.0f), {}};
  for (int64_t i = 0; i < D / 2; ++i) at.inv_freq.push_back(std::pow(10000.0f, -2.0f * float(i) / float(D)));
  DenseFfn ffn{H, F, randn(size_t(F * H), g), randn(size_t(F * H), g), randn(size_t(H * F), g)};
  const auto h = randn(size_t(rows * H), g, 1.0f), x = randn(size_t(rows * H), g, 1.0f);
  const auto whole_att = plus(h, at.forward(x, rows, pos0, nullptr)), whole_ffn = plus(h, ffn.forward(x, rows, nullptr));
  for (int world : {1, 2, 4}) {
    std::vector<std::vector<float>> att_parts, ffn_parts;
    int64_t heads = 0, cols = 0;
    for (int r = 0; r < world; ++r) {
      const TpShard s = tp_shard(nh, nkv, F, 0, r, world);
      EXPECT_EQ(s.q_head0, heads);
      EXPECT_EQ(s.q_heads * nkv, s.kv_heads * nh) << "each rank keeps its q heads with their own kv heads";
      EXPECT_EQ(s.kv_head0 * (nh / nkv), s.q_head0);
      heads += s.q_heads;
      cols += s.ff;
      att_parts.push_back(at.forward(x, rows, pos0, &s));
      ffn_parts.push_back(ffn.forward(x, rows, &s));
    }
    EXPECT_EQ(heads, nh);
    EXPECT_EQ(cols, F);
    const double ea = ref::rel_error(all_reduce(h, att_parts), whole_att), ef = ref::rel_error(all_reduce(h, ffn_parts), whole_ffn);
    std::printf("TP %d: attention block rel err %.3g, FFN %.3g\n", world, ea, ef);
    EXPECT_LT(ea, 1e-6) << "world " << world;
    EXPECT_LT(ef, 1e-6) << "world " << world;
  }
}

TEST(TensorParallel, ShardedExpertsSumToTheUnshardedMoe) {
  std::mt19937 g(22);
  MoeWeights w;
  w.n_expert = 8;
  w.n_used = 2;
  w.hidden = 64;
  w.ff = 96;
  w.router = randn(size_t(w.n_expert * w.hidden), g, 0.5f);
  for (int64_t e = 0; e < w.n_expert; ++e) {
    w.gate.push_back(randn(size_t(w.ff * w.hidden), g));
    w.up.push_back(randn(size_t(w.ff * w.hidden), g));
    w.down.push_back(randn(size_t(w.hidden * w.ff), g));
  }
  const int64_t rows = 40;
  const auto x = randn(size_t(rows * w.hidden), g, 1.0f), h = randn(size_t(rows * w.hidden), g, 1.0f);
  std::vector<float> whole(x.size());
  moe_ffn(w, x.data(), rows, 0, 32, 1, whole.data());
  whole = plus(h, whole);
  for (int world : {2, 4}) {
    std::vector<std::vector<float>> parts;
    for (int r = 0; r < world; ++r) {
      const TpShard s = tp_shard(8, 4, 0, w.ff, r, world);
      EXPECT_EQ(s.expert_ff0, r * w.ff / world);
      std::vector<float> part(x.size());
      // the router is replicated: every rank routes the same tokens to the same experts
      const auto ws = moe_shard(w, s);
      EXPECT_EQ(moe_route(ws, x.data(), rows, 0, 1).experts, moe_route(w, x.data(), rows, 0, 1).experts);
      moe_ffn(ws, x.data(), rows, 0, 32, 1, part.data());
      parts.push_back(part);
    }
    const double e = ref::rel_error(all_reduce(h, parts), whole);
    std::printf("TP %d: MoE rel err %.3g\n", world, e);
    EXPECT_LT(e, 1e-5) << "world " << world;
  }
}

TEST(TensorParallel, AModelThatDoesNotSplitIsRefusedNamingTheDimension) {
  EXPECT_NO_THROW(tp_shard(32, 8, 14336, 0, 1, 4));  // Llama-3.1-8B at TP 4
  EXPECT_NO_THROW(tp_shard(32, 4, 0, 768, 3, 4));    // Qwen3-30B-A3B at TP 4
  auto why = [](auto f) {
    try { f(); } catch (const std::invalid_argument& e) { return std::string(e.what()); }
    return std::string("no error");
  };
  EXPECT_NE(why([] { tp_shard(32, 8, 14336, 0, 0, 3); }).find("attention heads (32)"), std::string::npos);
  EXPECT_NE(why([] { tp_shard(32, 4, 0, 768, 0, 8); }).find("kv heads (4)"), std::string::npos);
  EXPECT_NE(why([] { tp_shard(32, 8, 0, 96, 0, 4, 128); }).find("expert FFN columns (96)"), std::string::npos);
  EXPECT_NE(why([] { tp_shard(8, 8, 64, 0, 2, 2); }).find("rank 2 of 2"), std::string::npos);
}

}  // namespace
}  // namespace pdb
