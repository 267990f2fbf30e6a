// cuDNN's fused attention built by hand through the backend graph API. The graph is the composite form that
// cuDNN's flash-attention engines recognize (the one cudnn-frontend lowers its SDPA node to for cuDNN 9 before
// the unified ops): S = Q K^T, x scale, the causal mask as generated row/column indices compared and selected,
// softmax as max / sub / exp / sum / div (with the log-sum-exp statistics, virtual), then O = P V with P in bf16.
// Nothing is linked: the few entry points are looked up in libcudnn.so.9 at first use.
#include "cuda/attention_cudnn.h"

#include <dlfcn.h>

#include <chrono>
#include <cfloat>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#define PDBRIDGE_HAVE_CUDNN_HEADERS 1
#endif

namespace pdb::cuda {

#ifndef PDBRIDGE_HAVE_CUDNN_HEADERS

bool cudnn_attention_available(std::string* why) {
  if (why) *why = "this build had no cuDNN headers";
  return false;
}
void causal_attention_cudnn(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, const AttentionShape&,
                            cudaStream_t) {
  throw std::runtime_error("attention: this build has no cuDNN path (no cudnn_graph.h at build time)");
}
CudnnAttentionStats cudnn_attention_stats() { return {}; }

#else

namespace {

using Desc = cudnnBackendDescriptor_t;

// The entry points, from the runtime's library.
struct CudnnApi {
  size_t (*get_version)() = nullptr;
  cudnnStatus_t (*create)(cudnnHandle_t*) = nullptr;
  cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t) = nullptr;
  const char* (*error_string)(cudnnStatus_t) = nullptr;
  void (*last_error)(char*, size_t) = nullptr;
  cudnnStatus_t (*create_desc)(cudnnBackendDescriptorType_t, Desc*) = nullptr;
  cudnnStatus_t (*destroy_desc)(Desc) = nullptr;
  cudnnStatus_t (*set_attr)(Desc, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, int64_t, const void*) = nullptr;
  cudnnStatus_t (*get_attr)(Desc, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, int64_t, int64_t*, void*) = nullptr;
  cudnnStatus_t (*finalize)(Desc) = nullptr;
  cudnnStatus_t (*execute)(cudnnHandle_t, Desc, Desc) = nullptr;
  std::string error;  // why loading failed; empty when it worked
};

const CudnnApi& api() {
  static const CudnnApi a = [] {
    CudnnApi r;
    std::vector<std::string> names;
    if (const char* p = std::getenv("PDBRIDGE_CUDNN_LIB")) names.push_back(p);
    names.push_back("libcudnn.so.9");
    void* h = nullptr;
    std::string tried;
    for (const auto& n : names) {
      if ((h = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
      tried += fmt::format("{}: {}; ", n, dlerror());
    }
    if (!h) {
      r.error = "cuDNN not found (libcudnn.so.9 on the library path, or PDBRIDGE_CUDNN_LIB): " + tried;
      return r;
    }
    auto sym = [&](auto& f, const char* s) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, s));
      if (!f && r.error.empty()) r.error = fmt::format("libcudnn.so.9 lacks {}", s);
    };
    sym(r.get_version, "cudnnGetVersion");
    sym(r.create, "cudnnCreate");
    sym(r.set_stream, "cudnnSetStream");
    sym(r.error_string, "cudnnGetErrorString");
    sym(r.last_error, "cudnnGetLastErrorString");
    sym(r.create_desc, "cudnnBackendCreateDescriptor");
    sym(r.destroy_desc, "cudnnBackendDestroyDescriptor");
    sym(r.set_attr, "cudnnBackendSetAttribute");
    sym(r.get_attr, "cudnnBackendGetAttribute");
    sym(r.finalize, "cudnnBackendFinalize");
    sym(r.execute, "cudnnBackendExecute");
    if (r.error.empty() && r.get_version() < 90000) r.error = fmt::format("cuDNN {} is older than 9", r.get_version());
    return r;
  }();
  return a;
}

[[noreturn]] void fail(cudnnStatus_t st, const char* what) {
  const CudnnApi& a = api();
  char msg[1024] = {0};
  if (a.last_error) a.last_error(msg, sizeof msg);
  throw std::runtime_error(fmt::format("cuDNN attention: {} failed: {}{}{}", what, a.error_string ? a.error_string(st) : "?",
                                       msg[0] ? ": " : "", msg));
}
void check(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS) fail(st, what);
}

// Owns every descriptor made while a graph is built; they are destroyed with the plan that needed them.
class Descs {
 public:
  ~Descs() {
    for (auto it = all_.rbegin(); it != all_.rend(); ++it) api().destroy_desc(*it);
  }
  Desc make(cudnnBackendDescriptorType_t type) {
    Desc d = nullptr;
    check(api().create_desc(type, &d), "creating a descriptor");
    all_.push_back(d);
    return d;
  }
 private:
  std::vector<Desc> all_;
};

template <class T>
void set(Desc d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* v, int64_t n = 1) {
  check(api().set_attr(d, name, type, n, v), "setting an attribute");
}
void link(Desc d, cudnnBackendAttributeName_t name, Desc v) { set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &v); }
void finalize(Desc d, const char* what) { check(api().finalize(d), what); }

// Builds the operations of one graph: tensors by uid, then the pointwise, reduction and matmul operations.
class GraphBuilder {
 public:
  GraphBuilder(Descs& d, int64_t virtual_uid0) : d_(d), next_virtual_(virtual_uid0) {}

  Desc tensor(int64_t uid, cudnnDataType_t type, std::vector<int64_t> dims, std::vector<int64_t> strides, bool is_virtual = false,
              bool by_value = false) {
    Desc t = d_.make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t align = 16;
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid);
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type);
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), int64_t(dims.size()));
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), int64_t(strides.size()));
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &align);
    set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &is_virtual);
    if (by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value);
    finalize(t, "a tensor descriptor");
    return t;
  }
  Desc scalar(int64_t uid, cudnnDataType_t type) { return tensor(uid, type, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }
  Desc virt(cudnnDataType_t type, const std::vector<int64_t>& dims, const std::vector<int64_t>& strides) {
    return tensor(next_virtual_++, type, dims, strides, true);
  }

  // y = mode(x[, b[, t]]) with the given compute precision (GEN_INDEX: along axis)
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, Desc x, Desc b, Desc t, Desc y, int64_t axis = -1) {
    Desc pw = d_.make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode);
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &prec);
    if (axis >= 0) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
    finalize(pw, "a pointwise descriptor");
    Desc op = d_.make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    link(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw);
    link(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) link(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t) link(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    link(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    finalize(op, "a pointwise operation");
    ops_.push_back(op);
  }
  void reduction(cudnnReduceTensorOp_t mode, Desc x, Desc y) {
    Desc r = d_.make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode);
    set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32);
    finalize(r, "a reduction descriptor");
    Desc op = d_.make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    link(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, r);
    link(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    link(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    finalize(op, "a reduction operation");
    ops_.push_back(op);
  }
  void matmul(Desc a, Desc b, Desc c) {
    Desc mm = d_.make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32);
    finalize(mm, "a matmul descriptor");
    Desc op = d_.make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    link(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    link(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    link(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    link(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
    finalize(op, "a matmul operation");
    ops_.push_back(op);
  }
  const std::vector<Desc>& ops() const { return ops_; }

 private:
  Descs& d_;
  int64_t next_virtual_;
  std::vector<Desc> ops_;
};

enum Uid : int64_t { kQ = 1, kK, kV, kO, kScale, kLowest, kKeys, kQueries, kVirtual0 = 100 };

// The shape a plan is built for: everything that changes the graph.
using PlanKey = std::tuple<int64_t, int64_t, int, int, int, int, int64_t, uint32_t>;

struct Plan {
  Descs descs;
  Desc plan = nullptr;
  int64_t workspace = 0;
  bool bottom_right = false;
  std::string engine;
};

// The graph for one shape, and the first execution plan cuDNN's heuristics offer that finalizes.
std::unique_ptr<Plan> build_plan(cudnnHandle_t handle, const AttentionShape& s) {
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
  p->bottom_right = Skv != Sq;
  if (p->bottom_right) {
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

  Desc graph = p->descs.make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g.ops().data(), int64_t(g.ops().size()));
  set(graph, cudnnBackendAttributeName_t(800) /* OPERATIONGRAPH_HANDLE */, CUDNN_TYPE_HANDLE, &handle);
  finalize(graph, "the operation graph");

  Desc heur = p->descs.make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  link(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
  finalize(heur, "the engine heuristics");
  int64_t n = 0;
  check(api().get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr), "counting engine configs");
  std::vector<Desc> cfgs(size_t(std::max<int64_t>(n, 0)));
  for (auto& c : cfgs) c = p->descs.make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
  if (n > 0) check(api().get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &n, cfgs.data()), "reading engine configs");
  cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
  for (int64_t i = 0; i < n && !p->plan; ++i) {
    Desc plan = p->descs.make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    set(plan, cudnnBackendAttributeName_t(400) /* EXECUTION_PLAN_HANDLE */, CUDNN_TYPE_HANDLE, &handle);
    link(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[size_t(i)]);
    if ((last = api().finalize(plan)) != CUDNN_STATUS_SUCCESS) continue;
    p->plan = plan;
    Desc engine = p->descs.make(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    int64_t got = 0, index = -1;
    if (api().get_attr(cfgs[size_t(i)], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, &engine) == CUDNN_STATUS_SUCCESS)
      api().get_attr(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &got, &index);
    p->engine = fmt::format("engine {} (config {} of {})", index, i + 1, n);
  }
  if (!p->plan) fail(last, fmt::format("finding an engine ({} configs offered) for this attention", n).c_str());
  check(api().get_attr(p->plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &p->workspace), "reading the workspace size");
  return p;
}

// Per device: a handle, the plans by shape, one workspace. The engine's layers run one after another per device.
struct DeviceState {
  cudnnHandle_t handle = nullptr;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  std::map<PlanKey, std::string> refused;  // shapes cuDNN had no plan for: not rebuilt at every layer and chunk
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

std::mutex g_mu;
std::map<int, DeviceState> g_devices;
CudnnAttentionStats g_stats;

}  // namespace

bool cudnn_attention_available(std::string* why) {
  const CudnnApi& a = api();
  if (why) *why = a.error.empty() ? fmt::format("cuDNN {}", a.get_version()) : a.error;
  return a.error.empty();
}

void causal_attention_cudnn(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                            const AttentionShape& s, cudaStream_t stream) {
  if (s.n_q <= 0) return;
  if (!q || !k || !v || !out) throw std::invalid_argument("attention: a null tensor");
  if (s.n_kv_heads <= 0 || s.n_heads % s.n_kv_heads != 0) throw std::invalid_argument("attention: heads not a multiple of kv heads");
  if (s.pos0 + s.n_q > s.kv_capacity) throw std::invalid_argument("attention: keys past the cache capacity");
  std::string why;
  if (!cudnn_attention_available(&why)) throw std::runtime_error(why);
  const CudnnApi& a = api();
  std::lock_guard<std::mutex> lock(g_mu);
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) throw std::runtime_error("cuDNN attention: no current CUDA device");
  DeviceState& ds = g_devices[dev];
  if (!ds.handle) check(a.create(&ds.handle), "cudnnCreate");
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &s.scale, 4);
  const PlanKey key{s.n_q, s.pos0, s.n_heads, s.n_kv_heads, s.head_dim, s.v_dim(), s.kv_capacity, scale_bits};
  if (auto r = ds.refused.find(key); r != ds.refused.end()) throw std::runtime_error(r->second);
  auto it = ds.plans.find(key);
  if (it == ds.plans.end()) {
    if (ds.plans.size() >= 1024) ds.plans.clear();  // every ragged last chunk is a shape: keep the cache bounded
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Plan> plan;
    try {
      plan = build_plan(ds.handle, s);
    } catch (const std::runtime_error& e) {
      if (ds.refused.size() < 1024) ds.refused.emplace(key, e.what());
      throw;
    }
    it = ds.plans.emplace(key, std::move(plan)).first;
    g_stats.plans++;
    g_stats.plan_build_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    g_stats.last_engine = it->second->engine;
  }
  Plan& p = *it->second;
  if (p.workspace > ds.workspace_bytes) {
    if (ds.workspace) cudaFree(ds.workspace);
    ds.workspace = nullptr;
    if (cudaMalloc(&ds.workspace, size_t(p.workspace)) != cudaSuccess)
      throw std::runtime_error(fmt::format("cuDNN attention: cannot allocate its {} byte workspace", p.workspace));
    ds.workspace_bytes = p.workspace;
  }
  check(a.set_stream(ds.handle, stream), "cudnnSetStream");
  // by-value scalars are read from host memory when the plan is executed
  float scale = s.scale, lowest = -FLT_MAX;
  int32_t keys = int32_t(s.pos0 + s.n_q), queries = int32_t(s.n_q);
  std::vector<int64_t> uids = {kQ, kK, kV, kO, kScale, kLowest};
  std::vector<void*> ptrs = {const_cast<__nv_bfloat16*>(q), const_cast<__nv_bfloat16*>(k), const_cast<__nv_bfloat16*>(v), out, &scale, &lowest};
  if (p.bottom_right) {
    uids.insert(uids.end(), {kKeys, kQueries});
    ptrs.insert(ptrs.end(), {&keys, &queries});
  }
  Descs d;
  Desc pack = d.make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), int64_t(uids.size()));
  set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(), int64_t(ptrs.size()));
  void* ws = ds.workspace;
  set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &ws);
  finalize(pack, "the variant pack");
  check(a.execute(ds.handle, p.plan, pack), "executing the attention plan");
}

CudnnAttentionStats cudnn_attention_stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_stats;
}

#endif  // PDBRIDGE_HAVE_CUDNN_HEADERS

}  // namespace pdb::cuda
