#include "cuda/readback.cuh"

#include <chrono>
#include <mutex>

#include "common/tuning.h"
#include "cuda/device.h"

namespace pdb::cuda {
namespace {

__global__ void to_host_kernel(const int32_t* __restrict__ src, int64_t n, int32_t* dst) {
  for (int64_t i = threadIdx.x + int64_t(blockIdx.x) * blockDim.x; i < n; i += int64_t(blockDim.x) * gridDim.x) dst[i] = src[i];
  __threadfence_system();
}

std::mutex totals_mu;
ReadbackTotals totals;

}  // namespace

ReadbackTotals readback_totals() {
  std::lock_guard<std::mutex> l(totals_mu);
  return totals;
}

Readback::Readback() : copy_(Tuning::from_env().readback == "copy"), stats_(Tuning::from_env().capture_stats == "1") {
  PDB_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  if (stats_)
    for (auto& g : gaps_) {
      PDB_CUDA_CHECK(cudaEventCreate(&g.arrived));
      PDB_CUDA_CHECK(cudaEventCreate(&g.resumed));
    }
}

Readback::~Readback() {
  if (done_) cudaEventDestroy(done_);
  for (auto& g : gaps_) {
    if (g.arrived) cudaEventDestroy(g.arrived);
    if (g.resumed) cudaEventDestroy(g.resumed);
  }
}

void Readback::record_gap(cudaStream_t s, double host_wait_ms) {
  PDB_CUDA_CHECK(cudaEventRecord(gaps_[gap_].resumed, s));
  gaps_[gap_].pending = true;
  gap_ ^= 1;
  Gap& prev = gaps_[gap_];  // recorded a fetch ago: both events passed before this fetch's result arrived
  float idle = 0;
  if (prev.pending) {
    PDB_CUDA_CHECK(cudaEventSynchronize(prev.resumed));  // passed already where both fetches share a stream
    PDB_CUDA_CHECK(cudaEventElapsedTime(&idle, prev.arrived, prev.resumed));
  }
  std::lock_guard<std::mutex> l(totals_mu);
  totals.syncs += 1;
  totals.host_wait_ms += host_wait_ms;
  totals.gpu_idle_ms += prev.pending ? double(idle) : 0.0;
  prev.pending = false;
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
  if (stats_) PDB_CUDA_CHECK(cudaEventRecord(gaps_[gap_].arrived, s));
  PDB_CUDA_CHECK(cudaEventRecord(done_, s));
  const auto t0 = std::chrono::steady_clock::now();
  PDB_CUDA_CHECK(cudaEventSynchronize(done_));
  if (stats_) record_gap(s, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  return host_.as<int32_t>();
}

}  // namespace pdb::cuda
