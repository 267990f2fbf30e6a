// What our cuDNN paths share (attention_cudnn.cpp, grouped_gemm_cudnn.cpp): cuDNN's backend graph API loaded
// from libcudnn.so.9 at first use (PDBRIDGE_CUDNN_LIB names another file; nothing is linked, so a build needs only
// cuDNN's headers and a box without cuDNN runs our kernels), descriptors owned by the plan that needed them, a
// graph builder, the first execution plan cuDNN's heuristics offer, and a per-device cache of plans by shape.
#pragma once
#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#define PDBRIDGE_HAVE_CUDNN_HEADERS 1
#endif

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace pdb::cuda {

// Whether cuDNN 9 loads here (its version, or why not, in *why).
bool cudnn_available(std::string* why = nullptr);

// What a plan cache has built: for /health, the benches and the tests.
struct CudnnPlanStats {
  int64_t plans = 0;          // execution plans built
  double plan_build_ms = 0;   // host time spent building them
  std::string last_engine;    // the engine cuDNN's heuristics gave the last plan
};

}  // namespace pdb::cuda

#ifdef PDBRIDGE_HAVE_CUDNN_HEADERS
namespace pdb::cuda::cudnn {

using Desc = cudnnBackendDescriptor_t;

[[noreturn]] void fail(cudnnStatus_t st, const std::string& what);
void check(cudnnStatus_t st, const char* what);

// Owns every descriptor made while a graph is built; they are destroyed with the plan that needed them.
class Descs {
 public:
  Descs() = default;
  Descs(const Descs&) = delete;
  Descs& operator=(const Descs&) = delete;
  ~Descs();
  Desc make(cudnnBackendDescriptorType_t type);

 private:
  std::vector<Desc> all_;
};

void set_attr(Desc d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const void* v, int64_t n = 1);
void link(Desc d, cudnnBackendAttributeName_t name, Desc v);
void finalize(Desc d, const char* what);

// Builds the operations of one graph: tensors by uid, then its operations in order.
class GraphBuilder {
 public:
  GraphBuilder(Descs& d, int64_t virtual_uid0) : d_(d), next_virtual_(virtual_uid0) {}

  Desc tensor(int64_t uid, cudnnDataType_t type, const std::vector<int64_t>& dims, const std::vector<int64_t>& strides, bool is_virtual = false,
              bool by_value = false);
  Desc scalar(int64_t uid, cudnnDataType_t type) { return tensor(uid, type, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }
  Desc virt(cudnnDataType_t type, const std::vector<int64_t>& dims, const std::vector<int64_t>& strides) {
    return tensor(next_virtual_++, type, dims, strides, true);
  }
  // y = mode(x[, b[, t]]) with the given compute precision (GEN_INDEX: along axis)
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, Desc x, Desc b, Desc t, Desc y, int64_t axis = -1);
  void reduction(cudnnReduceTensorOp_t mode, Desc x, Desc y);
  void matmul(Desc a, Desc b, Desc c);
  // out[1 x rows x N] = token rows x weight[e] ([E x K x N]) for the rows of expert e from first[e] (int32 [E x 1 x 1]);
  // with `index` ([1 x rows x 1] int32, gather mode) token row index[r] feeds output row r.
  void moe_grouped_matmul(Desc token, Desc weight, Desc first, Desc index, Desc out);
  const std::vector<Desc>& ops() const { return ops_; }

 private:
  Descs& d_;
  int64_t next_virtual_;
  std::vector<Desc> ops_;
};

struct Plan {
  Descs descs;
  Desc plan = nullptr;
  int64_t workspace = 0;
  std::string engine;
  bool flag = false;  // the graph's own variant bit (attention: the mask's diagonal at the bottom right)
};

// Finalizes the graph of `ops` and keeps the first execution plan cuDNN's heuristics offer that finalizes; throws
// std::runtime_error naming `what` where none does.
void build_plan(cudnnHandle_t handle, Plan& p, const std::vector<Desc>& ops, const std::string& what);

// Runs the plan with the tensors uids[i] at ptrs[i] (by-value scalars: host pointers, read at the call).
void execute(cudnnHandle_t handle, const Plan& p, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs, void* workspace);

// The handle, stream and workspace steps of PlanCache (cudnn_graph.cpp: they need the loaded library).
void create_handle(cudnnHandle_t& h);
void set_stream(cudnnHandle_t h, cudaStream_t s);
void grow_workspace(void*& ws, int64_t& have, int64_t need);

// Per device: a handle, the plans by key (bounded: every ragged shape is a key), the keys cuDNN refused (not planned
// again at every layer), one workspace. Calls are serialized: the engine's layers run one after another per device.
template <class Key>
class PlanCache {
 public:
  using Build = std::function<std::unique_ptr<Plan>(cudnnHandle_t)>;
  using Run = std::function<void(cudnnHandle_t, const Plan&, void* workspace)>;

  // Builds the key's plan on first use (throwing, and remembering, cuDNN's refusal), then runs `run` on `stream`.
  void with(const Key& key, const Build& build, cudaStream_t stream, const Run& run) {
    std::lock_guard<std::mutex> lock(mu_);
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) throw std::runtime_error("cuDNN: no current CUDA device");
    Device& d = devices_[dev];
    if (!d.handle) create_handle(d.handle);
    if (auto r = d.refused.find(key); r != d.refused.end()) throw std::runtime_error(r->second);
    auto it = d.plans.find(key);
    if (it == d.plans.end()) {
      if (d.plans.size() >= 1024) d.plans.clear();
      const auto t0 = std::chrono::steady_clock::now();
      std::unique_ptr<Plan> plan;
      try {
        plan = build(d.handle);
      } catch (const std::runtime_error& e) {
        if (d.refused.size() < 1024) d.refused.emplace(key, e.what());
        throw;
      }
      it = d.plans.emplace(key, std::move(plan)).first;
      stats_.plans++;
      stats_.plan_build_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      stats_.last_engine = it->second->engine;
    }
    const Plan& p = *it->second;
    if (p.workspace > d.workspace_bytes) grow_workspace(d.workspace, d.workspace_bytes, p.workspace);
    set_stream(d.handle, stream);
    run(d.handle, p, d.workspace);
  }
  CudnnPlanStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  struct Device {
    cudnnHandle_t handle = nullptr;
    std::map<Key, std::unique_ptr<Plan>> plans;
    std::map<Key, std::string> refused;
    void* workspace = nullptr;
    int64_t workspace_bytes = 0;
  };
  mutable std::mutex mu_;
  std::map<int, Device> devices_;
  CudnnPlanStats stats_;
};

}  // namespace pdb::cuda::cudnn
#endif  // PDBRIDGE_HAVE_CUDNN_HEADERS
