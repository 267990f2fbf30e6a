#include "cuda/common.cuh"

#include <stdexcept>

#include <fmt/format.h>

namespace pdb::cuda {

void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  throw std::runtime_error(fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(e), cudaGetErrorString(e), what, file, line));
}

void DeviceBuffer::resize(size_t bytes) {
  if (bytes <= n_) return;
  release();
  if (bytes == 0) return;
  cudaError_t e = cudaMalloc(&p_, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    p_ = nullptr;
    throw std::runtime_error(fmt::format("GPU out of memory: cudaMalloc of {:.2f} GiB failed ({})", double(bytes) / (1 << 30), cudaGetErrorString(e)));
  }
  n_ = bytes;
}

void DeviceBuffer::release() {
  if (p_) cudaFree(p_);
  p_ = nullptr;
  n_ = 0;
}

void DeviceBuffer::upload(const void* src, size_t bytes, size_t offset) {
  if (offset + bytes > n_) throw std::out_of_range("DeviceBuffer::upload past the end");
  PDB_CUDA_CHECK(cudaMemcpy(static_cast<char*>(p_) + offset, src, bytes, cudaMemcpyHostToDevice));
}

void DeviceBuffer::download(void* dst, size_t bytes, size_t offset) const {
  if (offset + bytes > n_) throw std::out_of_range("DeviceBuffer::download past the end");
  PDB_CUDA_CHECK(cudaMemcpy(dst, static_cast<const char*>(p_) + offset, bytes, cudaMemcpyDeviceToHost));
}

PinnedBuffer::~PinnedBuffer() {
  if (p_) cudaFreeHost(p_);
}

void PinnedBuffer::resize(size_t bytes) {
  if (bytes <= n_) return;
  if (p_) cudaFreeHost(p_);
  p_ = nullptr;
  n_ = 0;
  PDB_CUDA_CHECK(cudaMallocHost(&p_, bytes));
  n_ = bytes;
}

DeviceMemory device_memory() {
  DeviceMemory m;
  PDB_CUDA_CHECK(cudaMemGetInfo(&m.free, &m.total));
  return m;
}

EventSpans::~EventSpans() { take_ms(); }

void EventSpans::begin(cudaStream_t s) {
  spans_.emplace_back();
  PDB_CUDA_CHECK(cudaEventCreate(&spans_.back().first));
  PDB_CUDA_CHECK(cudaEventRecord(spans_.back().first, s));
}

void EventSpans::end(cudaStream_t s) {
  PDB_CUDA_CHECK(cudaEventCreate(&spans_.back().second));
  PDB_CUDA_CHECK(cudaEventRecord(spans_.back().second, s));
}

double EventSpans::take_ms() {
  double sum = 0;
  for (auto& [a, b] : spans_) {
    float ms = 0;
    if (b && cudaEventSynchronize(b) == cudaSuccess && cudaEventElapsedTime(&ms, a, b) == cudaSuccess) sum += ms;
    cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
  }
  spans_.clear();
  return sum;
}

}  // namespace pdb::cuda
