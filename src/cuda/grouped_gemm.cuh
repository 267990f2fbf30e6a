// Grouped products for the mixture-of-experts block: for each expert e with rows, Y_e = X_e W_e^T
// (row-major, the engine's xwt convention), all experts in one cublasGemmGroupedBatchedEx call: one
// launch whatever the number of experts and however unevenly the tokens fall on them. The group sizes
// are host arrays in cuBLAS's interface, so the caller knows each expert's row count on the host (one
// small download per MoE layer). bf16 operands, f32 accumulation.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/gemm.cuh"

namespace pdb::cuda {

struct GroupedProduct {
  const void* x = nullptr;  // [rows x in] bf16
  const void* w = nullptr;  // [out x in] bf16
  void* y = nullptr;        // [rows x out], bf16 or f32
  int64_t rows = 0;
};

// Chunks of one size (model/moe_padding.h): chunk i is rows [first_row[i], first_row[i] + cap) of x and y,
// multiplied by the weights of expert[i].
struct ChunkSpan {
  int64_t cap = 0;
  const int32_t* expert = nullptr;
  const int32_t* first_row = nullptr;
  int64_t n = 0;
};

class GroupedGemm {
 public:
  // per_expert: one cuBLAS product per expert by default instead of the grouped call (DeepSeek-V4's experts of
  // 2048 x 4096 on the H200: the 43-layer model at 32K ran 9,323 tok/s against the grouped call's 7,687 in one
  // run, docs/RESULTS.md).
  explicit GroupedGemm(bool per_expert = false);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;
  // Every product shares in/out and the types. Products with no rows are left out. PDBRIDGE_MOE_GEMM=loop
  // runs them as one cuBLAS product each, =grouped as one grouped call, whatever the default (the A/B switch).
  void xwt(const std::vector<GroupedProduct>& products, int64_t in, int64_t out, DType y_type, cudaStream_t s);
  // Every expert's rows padded to `cap` (expert e's at rows [e cap, e cap + cap) of x and y; the padding rows are
  // computed and never read): one strided batched cuBLAS product over all experts, weights [experts x out x in].
  void xwt_padded(const void* x, const void* w, void* y, int64_t cap, int64_t experts, int64_t in, int64_t out, DType y_type, cudaStream_t s);
  // The rows in chunks (model/moe_padding.h), the weights of expert e at w + e out in (bf16): one batched cuBLAS
  // product per chunk size, their pointers uploaded together.
  void xwt_chunks(const void* x, const void* w, void* y, const std::vector<ChunkSpan>& sizes, int64_t in, int64_t out, DType y_type,
                  cudaStream_t s);

 private:
  // The handle on stream s. The pointer arrays of a batched call live on the device: staging(n) waits until the last
  // upload has left the host staging and returns n pointers of it; upload(n, s) copies them and returns the device's.
  void* on_stream(cudaStream_t s);
  void** staging(int64_t n);
  void** upload(int64_t n, cudaStream_t s);
  void* handle_ = nullptr;
  PinnedBuffer host_ptrs_;
  DeviceBuffer dev_ptrs_;
  cudaEvent_t ptrs_copied_ = nullptr;
  bool loop_ = false;
};

}  // namespace pdb::cuda
