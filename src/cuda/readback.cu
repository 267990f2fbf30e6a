#include "cuda/readback.cuh"

#include "common/tuning.h"

namespace pdb::cuda {
namespace {

__global__ void to_host_kernel(const int32_t* __restrict__ src, int64_t n, int32_t* dst) {
  for (int64_t i = threadIdx.x + int64_t(blockIdx.x) * blockDim.x; i < n; i += int64_t(blockDim.x) * gridDim.x) dst[i] = src[i];
  __threadfence_system();
}

}  // namespace

Readback::Readback() : copy_(Tuning::from_env().readback == "copy") {
  PDB_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
}

Readback::~Readback() {
  if (done_) cudaEventDestroy(done_);
}

const int32_t* Readback::fetch(const int32_t* src, int64_t n, cudaStream_t s) {
  if (n <= 0) return nullptr;
  const size_t bytes = size_t(n) * 4;
  if (host_.bytes() < bytes) {
    host_.resize(bytes);
    void* d = nullptr;
    PDB_CUDA_CHECK(cudaHostGetDevicePointer(&d, host_.as<void>(), 0));  // pinned memory is mapped under UVA
    mapped_ = static_cast<int32_t*>(d);
  }
  if (copy_) {
    PDB_CUDA_CHECK(cudaMemcpyAsync(host_.as<int32_t>(), src, bytes, cudaMemcpyDeviceToHost, s));
  } else {
    to_host_kernel<<<unsigned((n + 255) / 256 < 64 ? (n + 255) / 256 : 64), 256, 0, s>>>(src, n, mapped_);
    PDB_CUDA_LAUNCHED();
  }
  PDB_CUDA_CHECK(cudaEventRecord(done_, s));
  PDB_CUDA_CHECK(cudaEventSynchronize(done_));
  return host_.as<int32_t>();
}

}  // namespace pdb::cuda
