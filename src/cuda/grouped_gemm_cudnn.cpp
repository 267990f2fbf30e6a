// cuDNN's MoE grouped matmul: a graph of one operation. cuDNN's weight is [E x K x N]; ours, [E x out x in] row-major,
// is that tensor with strides (in*out, 1, in): read transposed in place, as cuDNN's frontend documents.
#include "cuda/grouped_gemm_cudnn.h"

#include <stdexcept>
#include <tuple>
#include <vector>

namespace pdb::cuda {

#ifndef PDBRIDGE_HAVE_CUDNN_HEADERS

void moe_grouped_xwt_cudnn(const __nv_bfloat16*, const int32_t*, const __nv_bfloat16*, const int32_t*, __nv_bfloat16*, const MoeGroupedShape&,
                           cudaStream_t) {
  throw std::runtime_error("MoE products: this build has no cuDNN path (no cudnn_graph.h at build time)");
}
CudnnPlanStats cudnn_moe_stats() { return {}; }

#else

namespace {

using namespace cudnn;

enum Uid : int64_t { kToken = 1, kWeight, kFirst, kIndex, kOut };
using PlanKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>;  // rows, experts, in, out, x_rows (0: no gather)

std::unique_ptr<Plan> build_moe_plan(cudnnHandle_t handle, const MoeGroupedShape& s, bool gather) {
  auto p = std::make_unique<Plan>();
  GraphBuilder g(p->descs, 100);
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, i32 = CUDNN_DATA_INT32;
  const int64_t R = s.rows, E = s.experts, K = s.in, N = s.out, X = gather ? s.x_rows : s.rows;
  Desc token = g.tensor(kToken, bf16, {1, X, K}, {X * K, K, 1});
  Desc weight = g.tensor(kWeight, bf16, {E, K, N}, {K * N, 1, K});
  Desc first = g.tensor(kFirst, i32, {E, 1, 1}, {1, 1, 1});
  Desc index = gather ? g.tensor(kIndex, i32, {1, R, 1}, {R, 1, 1}) : nullptr;
  Desc out = g.tensor(kOut, bf16, {1, R, N}, {R * N, N, 1});
  g.moe_grouped_matmul(token, weight, first, index, out);
  p->flag = gather;
  cudnn::build_plan(handle, *p, g.ops(), "this MoE grouped product");
  return p;
}

PlanCache<PlanKey> g_plans;

}  // namespace

void moe_grouped_xwt_cudnn(const __nv_bfloat16* x, const int32_t* gather, const __nv_bfloat16* w, const int32_t* first_row,
                           __nv_bfloat16* y, const MoeGroupedShape& s, cudaStream_t stream) {
  if (s.rows <= 0) return;
  if (!x || !w || !first_row || !y) throw std::invalid_argument("MoE products: a null tensor");
  if (s.experts <= 0 || s.in <= 0 || s.out <= 0 || s.in % 8 || s.out % 8) throw std::invalid_argument("MoE products: widths must be multiples of 8");
  if (gather && s.x_rows <= 0) throw std::invalid_argument("MoE products: a gather index needs the rows of x");
  const PlanKey key{s.rows, s.experts, s.in, s.out, gather ? s.x_rows : 0};
  g_plans.with(key, [&](cudnnHandle_t h) { return build_moe_plan(h, s, gather != nullptr); }, stream, [&](cudnnHandle_t h, const Plan& p, void* ws) {
    std::vector<int64_t> uids = {kToken, kWeight, kFirst, kOut};
    std::vector<void*> ptrs = {const_cast<__nv_bfloat16*>(x), const_cast<__nv_bfloat16*>(w), const_cast<int32_t*>(first_row), y};
    if (p.flag) {
      uids.push_back(kIndex);
      ptrs.push_back(const_cast<int32_t*>(gather));
    }
    execute(h, p, uids, ptrs, ws);
  });
}

CudnnPlanStats cudnn_moe_stats() { return g_plans.stats(); }

#endif  // PDBRIDGE_HAVE_CUDNN_HEADERS

}  // namespace pdb::cuda
