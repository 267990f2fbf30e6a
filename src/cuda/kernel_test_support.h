// Helpers the CUDA kernel tests share (kernels_test.cpp, moe_mla_kernels_test.cpp): random inputs,
// bf16 rounding, device copies in and out, poisoned outputs. CUDA builds only.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/cudnn_graph.h"
#include "cuda/device.h"
#include "formats/numeric.h"

// Skips a test that needs a GPU and cuDNN (cudnn_graph.h), saying which is missing.
#define SKIP_WITHOUT_GPU_AND_CUDNN()                                         \
  if (pdb::cuda::device_count() == 0) GTEST_SKIP() << pdb::cuda::device_summary(); \
  if (std::string why; !pdb::cuda::cudnn_available(&why)) GTEST_SKIP() << why

namespace pdb::test_kernels {

// Mean milliseconds of fn() over reps calls on the default stream, timed with CUDA events.
template <class F>
double mean_ms(int reps, F&& fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int r = 0; r < reps; ++r) fn();
  cudaEventRecord(b);
  PDB_CUDA_CHECK(cudaEventSynchronize(b));
  float t = 0;
  cudaEventElapsedTime(&t, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return double(t) / reps;
}

// Median milliseconds of fn() over reps calls after one warm-up, each timed alone with CUDA events on the default
// stream (a bench's row: one slow call does not move it).
template <class F>
double median_ms(int reps, F&& fn) {
  fn();
  PDB_CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  PDB_CUDA_CHECK(cudaEventCreate(&a));
  PDB_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    PDB_CUDA_CHECK(cudaEventRecord(a));
    fn();
    PDB_CUDA_CHECK(cudaEventRecord(b));
    PDB_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    PDB_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]);
}

inline std::mt19937& rng() {
  static std::mt19937 g(std::random_device{}());
  return g;
}
inline std::vector<float> randn(size_t n, float sd = 1.0f) {
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng());
  return v;
}
// Values as bf16 holds them (what the kernel sees) and the device copy.
inline std::vector<float> round_bf16(std::vector<float> v) {
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}
inline cuda::DeviceBuffer to_device_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  cuda::DeviceBuffer b(h.size() * 2);
  b.upload(h.data(), h.size() * 2);
  return b;
}
inline cuda::DeviceBuffer to_device_f32(const std::vector<float>& v) {
  cuda::DeviceBuffer b(v.size() * 4);
  b.upload(v.data(), v.size() * 4);
  return b;
}
inline cuda::DeviceBuffer poisoned(size_t bytes) {
  cuda::DeviceBuffer b(bytes);
  PDB_CUDA_CHECK(cudaMemset(b.get(), 0xff, bytes));  // NaN in f32, bf16 and f16
  return b;
}
inline std::vector<float> from_device_bf16(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<uint16_t> h(n);
  b.download(h.data(), n * 2);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16_to_f32(h[i]);
  return v;
}
inline std::vector<float> from_device_f32(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<float> v(n);
  b.download(v.data(), n * 4);
  return v;
}

}  // namespace pdb::test_kernels
