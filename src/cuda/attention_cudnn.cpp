// cuDNN's fused attention built by hand through the backend graph API. The graph is the composite form that
// cuDNN's flash-attention engines recognize (the one cudnn-frontend lowers its SDPA node to for cuDNN 9 before
// the unified ops): S = Q K^T, x scale, the causal mask as generated row/column indices compared and selected,
// softmax as max / sub / exp / sum / div (with the log-sum-exp statistics, virtual), then O = P V with P in bf16.
// The shared pieces (loading, descriptors, plans per device) are cudnn_graph.h's.
#include "cuda/attention_cudnn.h"

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <tuple>
#include <vector>

#include "common/tuning.h"
#include "cuda/cudnn_graph.h"

namespace pdb::cuda {

bool cudnn_attention_available(std::string* why) { return cudnn_available(why); }

#ifndef PDBRIDGE_HAVE_CUDNN_HEADERS

void causal_attention_cudnn(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, const AttentionShape&,
                            cudaStream_t) {
  throw std::runtime_error("attention: this build has no cuDNN path (no cudnn_graph.h at build time)");
}
CudnnAttentionStats cudnn_attention_stats() { return {}; }

#else

namespace {

using namespace cudnn;

enum Uid : int64_t { kQ = 1, kK, kV, kO, kScale, kLowest, kKeys, kQueries, kVirtual0 = 100 };

// The shape a plan is built for: everything that changes the graph.
using PlanKey = std::tuple<int64_t, int64_t, int, int, int, int, int64_t, uint32_t>;

// The graph for one shape, and the first execution plan cuDNN's heuristics offer that finalizes.
std::unique_ptr<Plan> build_attention_plan(cudnnHandle_t handle, const AttentionShape& s) {
  auto p = std::make_unique<Plan>();
  GraphBuilder g(p->descs, kVirtual0);
  const int64_t H = s.n_heads, Hk = s.n_kv_heads, D = s.head_dim, Dv = s.v_dim(), Sq = s.n_q, Skv = s.pos0 + s.n_q, cap = s.kv_capacity;
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT, i32 = CUDNN_DATA_INT32, boolean = CUDNN_DATA_BOOLEAN;
  Desc q = g.tensor(kQ, bf16, {1, H, Sq, D}, {Sq * H * D, D, H * D, 1});
  Desc kt = g.tensor(kK, bf16, {1, Hk, D, Skv}, {Hk * cap * D, cap * D, 1, D});  // K read transposed, in place
  Desc v = g.tensor(kV, bf16, {1, Hk, Skv, Dv}, {Hk * cap * Dv, cap * Dv, Dv, 1});
  Desc o = g.tensor(kO, bf16, {1, H, Sq, Dv}, {Sq * H * Dv, Dv, H * Dv, 1});
  const std::vector<int64_t> full = {1, H, Sq, Skv}, full_st = {H * Sq * Skv, Sq * Skv, Skv, 1};
  const std::vector<int64_t> row = {1, H, Sq, 1}, row_st = {H * Sq, Sq, 1, 1};

  Desc scores = g.virt(f32, full, full_st);
  g.matmul(q, kt, scores);
  Desc scaled = g.virt(f32, full, full_st);
  g.pointwise(CUDNN_POINTWISE_MUL, f32, scores, g.scalar(kScale, f32), nullptr, scaled);
  // causal: keep key j for query row i where i (+ Skv - Sq, the diagonal at the bottom right) >= j
  Desc ri = g.virt(i32, full, full_st);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, i32, scaled, nullptr, nullptr, ri, 2);
  p->flag = Skv != Sq;
  if (p->flag) {
    Desc plus = g.virt(i32, full, full_st);
    g.pointwise(CUDNN_POINTWISE_ADD, i32, ri, g.scalar(kKeys, i32), nullptr, plus);
    Desc minus = g.virt(i32, full, full_st);
    g.pointwise(CUDNN_POINTWISE_SUB, i32, plus, g.scalar(kQueries, i32), nullptr, minus);
    ri = minus;
  }
  Desc ci = g.virt(i32, full, full_st);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, i32, scaled, nullptr, nullptr, ci, 3);
  Desc keep = g.virt(boolean, full, full_st);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, boolean, ri, ci, nullptr, keep);
  Desc masked = g.virt(f32, full, full_st);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, f32, scaled, g.scalar(kLowest, f32), keep, masked);
  // softmax, with the statistics cuDNN's flash engines expect in the graph
  Desc mx = g.virt(f32, row, row_st);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, mx);
  Desc centered = g.virt(f32, full, full_st);
  g.pointwise(CUDNN_POINTWISE_SUB, f32, masked, mx, nullptr, centered);
  Desc e = g.virt(f32, full, full_st);
  g.pointwise(CUDNN_POINTWISE_EXP, f32, centered, nullptr, nullptr, e);
  Desc sum = g.virt(f32, row, row_st);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  Desc log_sum = g.virt(f32, row, row_st);
  g.pointwise(CUDNN_POINTWISE_LOG, f32, sum, nullptr, nullptr, log_sum);
  Desc stats = g.virt(f32, row, row_st);
  g.pointwise(CUDNN_POINTWISE_ADD, f32, mx, log_sum, nullptr, stats);
  Desc probs = g.virt(bf16, full, full_st);  // P in the inputs' type: what the engines' second product reads
  g.pointwise(CUDNN_POINTWISE_DIV, f32, e, sum, nullptr, probs);
  g.matmul(probs, v, o);

  cudnn::build_plan(handle, *p, g.ops(), "this attention");
  return p;
}

PlanCache<PlanKey> g_plans;

// A plan is built per shape (35-580 ms on the H200), and a prompt of a new length ends in a chunk of a new length. Its
// queries are padded to a multiple of kQueryBucket rows where the buffers and the cache hold them, so that prompts
// within a bucket of each other share every plan. The real rows' mask is unchanged (their keys stop at pos0 + i; the
// diagonal is at pos0 either way); the padding rows attend finite rows and are never read. PDBRIDGE_ATTN_BUCKET=0: exact.
constexpr int64_t kQueryBucket = 256;

AttentionShape planned_shape(const AttentionShape& s) {
  AttentionShape p = s;
  if (s.q_rows <= s.n_q || Tuning::from_env().attn_bucket == "0") return p;
  const int64_t padded = std::min((s.n_q + kQueryBucket - 1) / kQueryBucket * kQueryBucket, s.q_rows);
  if (s.pos0 + padded <= s.kv_capacity) p.n_q = padded;
  return p;
}

}  // namespace

void causal_attention_cudnn(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                            const AttentionShape& s, cudaStream_t stream) {
  if (s.n_q <= 0) return;
  if (!q || !k || !v || !out) throw std::invalid_argument("attention: a null tensor");
  if (s.n_kv_heads <= 0 || s.n_heads % s.n_kv_heads != 0) throw std::invalid_argument("attention: heads not a multiple of kv heads");
  if (s.pos0 + s.n_q > s.kv_capacity) throw std::invalid_argument("attention: keys past the cache capacity");
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &s.scale, 4);
  const AttentionShape ps = planned_shape(s);
  const PlanKey key{ps.n_q, ps.pos0, ps.n_heads, ps.n_kv_heads, ps.head_dim, ps.v_dim(), ps.kv_capacity, scale_bits};
  g_plans.with(key, [&](cudnnHandle_t h) { return build_attention_plan(h, ps); }, stream, [&](cudnnHandle_t h, const Plan& p, void* ws) {
    // by-value scalars are read from host memory when the plan is executed
    float scale = s.scale, lowest = -FLT_MAX;
    int32_t keys = int32_t(s.pos0 + s.n_q), queries = int32_t(s.n_q);
    std::vector<int64_t> uids = {kQ, kK, kV, kO, kScale, kLowest};
    std::vector<void*> ptrs = {const_cast<__nv_bfloat16*>(q), const_cast<__nv_bfloat16*>(k), const_cast<__nv_bfloat16*>(v), out, &scale, &lowest};
    if (p.flag) {
      uids.insert(uids.end(), {kKeys, kQueries});
      ptrs.insert(ptrs.end(), {&keys, &queries});
    }
    execute(h, p, uids, ptrs, ws);
  });
}

CudnnAttentionStats cudnn_attention_stats() { return g_plans.stats(); }

#endif  // PDBRIDGE_HAVE_CUDNN_HEADERS

}  // namespace pdb::cuda
