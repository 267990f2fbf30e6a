// Matrix products through cuBLASLt: Y[rows x out] = X[rows x in] * W[out x in]^T (+ beta * Y),
// row-major, the layout of HF weights and of our activations. One heuristic query per shape, cached.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace pdb::cuda {

enum class DType { BF16, F16, F32 };

class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes = size_t(64) << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // X and W share `ab` (bf16/f16: f32 accumulation; f32: true f32, no TF32). Y is `y_type`;
  // beta = 1 accumulates into Y (the residual add, fused into the product).
  void xwt(DType ab, const void* x, const void* w, DType y_type, void* y, int64_t rows, int64_t in, int64_t out, float beta,
           cudaStream_t stream);

 private:
  struct Plan;
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, bool>;
  Plan& plan(DType ab, DType y_type, int64_t rows, int64_t in, int64_t out, bool accumulate);
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::mutex mu_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace pdb::cuda
