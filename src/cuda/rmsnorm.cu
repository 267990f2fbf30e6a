#include "cuda/rmsnorm.cuh"

namespace pdb::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                               int64_t dim, float eps) {
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float* yr = y + row * dim;
  double sum = 0.0;  // double, like the CPU twin, so the two agree to the last bit in most rows
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) sum += double(xr[i] * xr[i]);
  __shared__ double partial[kThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float mean = float(partial[0] / double(dim));
  const float scale = 1.0f / sqrtf(mean + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float v = xr[i] * scale;
    yr[i] = w ? v * w[i] : v;
  }
}

}  // namespace

void rmsnorm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  rmsnorm_kernel<<<unsigned(rows), kThreads, 0, stream>>>(x, w, y, dim, eps);
}

}  // namespace pdb::cuda

#include <stdexcept>

namespace pdb::cuda {

std::vector<float> rmsnorm_rows_host(const std::vector<float>& x, const std::vector<float>& w, int64_t rows, int64_t dim, float eps) {
  auto check = [](cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  };
  float *dx = nullptr, *dw = nullptr, *dy = nullptr;
  const size_t n = size_t(rows * dim);
  check(cudaMalloc(&dx, n * 4), "cudaMalloc");
  check(cudaMalloc(&dw, size_t(dim) * 4), "cudaMalloc");
  check(cudaMalloc(&dy, n * 4), "cudaMalloc");
  check(cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice), "copy x");
  check(cudaMemcpy(dw, w.data(), size_t(dim) * 4, cudaMemcpyHostToDevice), "copy w");
  rmsnorm_rows(dx, dw, dy, rows, dim, eps, nullptr);
  check(cudaGetLastError(), "rmsnorm launch");
  std::vector<float> y(n);
  check(cudaMemcpy(y.data(), dy, n * 4, cudaMemcpyDeviceToHost), "copy y");
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dy);
  return y;
}

}  // namespace pdb::cuda
