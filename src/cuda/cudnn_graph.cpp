// cuDNN's backend graph API, looked up in libcudnn.so.9 at first use (see cudnn_graph.h).
#include "cuda/cudnn_graph.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>

#include <fmt/format.h>

namespace pdb::cuda {

#ifndef PDBRIDGE_HAVE_CUDNN_HEADERS

bool cudnn_available(std::string* why) {
  if (why) *why = "this build had no cuDNN headers";
  return false;
}

#else

namespace cudnn {
namespace {

// The entry points, from the runtime's library.
struct Api {
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

const Api& api() {
  static const Api a = [] {
    Api r;
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

}  // namespace

void fail(cudnnStatus_t st, const std::string& what) {
  const Api& a = api();
  char msg[1024] = {0};
  if (a.last_error) a.last_error(msg, sizeof msg);
  throw std::runtime_error(fmt::format("cuDNN: {} failed: {}{}{}", what, a.error_string ? a.error_string(st) : "?", msg[0] ? ": " : "", msg));
}
void check(cudnnStatus_t st, const char* what) {
  if (st != CUDNN_STATUS_SUCCESS) fail(st, what);
}

Descs::~Descs() {
  for (auto it = all_.rbegin(); it != all_.rend(); ++it) api().destroy_desc(*it);
}
Desc Descs::make(cudnnBackendDescriptorType_t type) {
  Desc d = nullptr;
  check(api().create_desc(type, &d), "creating a descriptor");
  all_.push_back(d);
  return d;
}

void set_attr(Desc d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const void* v, int64_t n) {
  check(api().set_attr(d, name, type, n, v), "setting an attribute");
}
void link(Desc d, cudnnBackendAttributeName_t name, Desc v) { set_attr(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &v); }
void finalize(Desc d, const char* what) { check(api().finalize(d), what); }

Desc GraphBuilder::tensor(int64_t uid, cudnnDataType_t type, const std::vector<int64_t>& dims, const std::vector<int64_t>& strides,
                          bool is_virtual, bool by_value) {
  Desc t = d_.make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const int64_t align = 16;
  set_attr(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &uid);
  set_attr(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &type);
  set_attr(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), int64_t(dims.size()));
  set_attr(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), int64_t(strides.size()));
  set_attr(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &align);
  set_attr(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &is_virtual);
  if (by_value) set_attr(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value);
  finalize(t, "a tensor descriptor");
  return t;
}

void GraphBuilder::pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, Desc x, Desc b, Desc t, Desc y, int64_t axis) {
  Desc pw = d_.make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
  set_attr(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode);
  set_attr(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &prec);
  if (axis >= 0) set_attr(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
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

void GraphBuilder::reduction(cudnnReduceTensorOp_t mode, Desc x, Desc y) {
  Desc r = d_.make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  set_attr(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &mode);
  set_attr(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32);
  finalize(r, "a reduction descriptor");
  Desc op = d_.make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
  link(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, r);
  link(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
  link(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
  finalize(op, "a reduction operation");
  ops_.push_back(op);
}

void GraphBuilder::matmul(Desc a, Desc b, Desc c) {
  Desc mm = d_.make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  set_attr(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &f32);
  finalize(mm, "a matmul descriptor");
  Desc op = d_.make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
  link(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
  link(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
  link(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
  link(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm);
  finalize(op, "a matmul operation");
  ops_.push_back(op);
}

void GraphBuilder::moe_grouped_matmul(Desc token, Desc weight, Desc first, Desc index, Desc out) {
  Desc op = d_.make(CUDNN_BACKEND_OPERATION_MOE_GROUPED_MATMUL_DESCRIPTOR);
  const cudnnMoeGroupedMatmulMode_t mode = index ? CUDNN_MOE_GROUPED_MATMUL_MODE_GATHER : CUDNN_MOE_GROUPED_MATMUL_MODE_NONE;
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  set_attr(op, CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_MODE, CUDNN_TYPE_MOE_GROUPED_MATMUL_MODE, &mode);
  set_attr(op, CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &f32);
  link(op, CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_TOKEN_DESC, token);
  link(op, CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_WEIGHT_DESC, weight);
  link(op, CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_FIRST_TOKEN_OFFSET_DESC, first);
  link(op, CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_OUTPUT_DESC, out);
  if (index) link(op, CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_TOKEN_INDEX_DESC, index);
  finalize(op, "a MoE grouped matmul operation");
  ops_.push_back(op);
}

void build_plan(cudnnHandle_t handle, Plan& p, const std::vector<Desc>& ops, const std::string& what) {
  Desc graph = p.descs.make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  set_attr(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(), int64_t(ops.size()));
  set_attr(graph, cudnnBackendAttributeName_t(800) /* OPERATIONGRAPH_HANDLE, deprecated name */, CUDNN_TYPE_HANDLE, &handle);
  finalize(graph, "the operation graph");
  Desc heur = p.descs.make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  link(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph);
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  set_attr(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode);
  finalize(heur, "the engine heuristics");
  int64_t n = 0;
  check(api().get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr), "counting engine configs");
  std::vector<Desc> cfgs(size_t(std::max<int64_t>(n, 0)));
  for (auto& c : cfgs) c = p.descs.make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
  if (n > 0) check(api().get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &n, cfgs.data()), "reading engine configs");
  cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
  for (int64_t i = 0; i < n && !p.plan; ++i) {
    Desc plan = p.descs.make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    set_attr(plan, cudnnBackendAttributeName_t(400) /* EXECUTION_PLAN_HANDLE, deprecated name */, CUDNN_TYPE_HANDLE, &handle);
    link(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[size_t(i)]);
    if ((last = api().finalize(plan)) != CUDNN_STATUS_SUCCESS) continue;
    p.plan = plan;
    Desc engine = p.descs.make(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    int64_t got = 0, index = -1;
    if (api().get_attr(cfgs[size_t(i)], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &got, &engine) == CUDNN_STATUS_SUCCESS)
      api().get_attr(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &got, &index);
    p.engine = fmt::format("engine {} (config {} of {})", index, i + 1, n);
  }
  if (!p.plan) fail(last, fmt::format("finding an engine ({} configs offered) for {}", n, what));
  check(api().get_attr(p.plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &p.workspace), "reading the workspace size");
}

void execute(cudnnHandle_t handle, const Plan& p, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs, void* workspace) {
  Descs d;
  Desc pack = d.make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  set_attr(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), int64_t(uids.size()));
  set_attr(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(), int64_t(ptrs.size()));
  set_attr(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &workspace);
  finalize(pack, "the variant pack");
  check(api().execute(handle, p.plan, pack), "executing a plan");
}

void create_handle(cudnnHandle_t& h) {
  std::string why;
  if (!cudnn_available(&why)) throw std::runtime_error(why);
  check(api().create(&h), "cudnnCreate");
}
void set_stream(cudnnHandle_t h, cudaStream_t s) { check(api().set_stream(h, s), "cudnnSetStream"); }
void grow_workspace(void*& ws, int64_t& have, int64_t need) {
  if (ws) cudaFree(ws);
  ws = nullptr;
  have = 0;
  if (cudaMalloc(&ws, size_t(need)) != cudaSuccess) throw std::runtime_error(fmt::format("cuDNN: cannot allocate a {} byte workspace", need));
  have = need;
}

}  // namespace cudnn

bool cudnn_available(std::string* why) {
  const auto& a = cudnn::api();
  if (why) *why = a.error.empty() ? fmt::format("cuDNN {}", a.get_version()) : a.error;
  return a.error.empty();
}

#endif  // PDBRIDGE_HAVE_CUDNN_HEADERS

}  // namespace pdb::cuda
