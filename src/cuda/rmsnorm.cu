#include "cuda/rmsnorm.cuh"

#include <stdexcept>

#include "cuda/common.cuh"

namespace pdb::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void store_as(float* y, float v) { *y = v; }
__device__ __forceinline__ void store_as(__half* y, float v) { *y = __float2half_rn(v); }

template <typename Out>
__global__ void rmsnorm_kernel(const float* __restrict__ x, int64_t xs, const float* __restrict__ w, Out* __restrict__ y, int64_t ys,
                               int64_t dim, float eps) {
  const int64_t row = blockIdx.x;
  const float* xr = x + row * xs;
  Out* yr = y + row * ys;
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
    store_as(yr + i, w ? v * w[i] : v);
  }
}

__global__ void rmsnorm_bf16_kernel(const float* __restrict__ x, const float* __restrict__ w, __nv_bfloat16* __restrict__ y,
                                    int64_t dim, float eps) {
  const int64_t row = blockIdx.x;
  const float4* xr = reinterpret_cast<const float4*>(x + row * dim);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim / 4; i += kThreads) {
    const float4 v = xr[i];
    sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < kThreads / 32; ++i) total += warp_sums[i];
  const float scale = rsqrtf(total / float(dim) + eps);
  const float4* wr = reinterpret_cast<const float4*>(w);
  __nv_bfloat162* yr = reinterpret_cast<__nv_bfloat162*>(y + row * dim);
  for (int64_t i = threadIdx.x; i < dim / 4; i += kThreads) {
    const float4 v = xr[i], g = wr[i];
    yr[2 * i] = __floats2bfloat162_rn(v.x * scale * g.x, v.y * scale * g.y);
    yr[2 * i + 1] = __floats2bfloat162_rn(v.z * scale * g.z, v.w * scale * g.w);
  }
}

}  // namespace

void rmsnorm_rows_bf16(const float* x, const float* w, __nv_bfloat16* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  if (dim % 4) throw std::invalid_argument("rmsnorm_rows_bf16: dim must be a multiple of 4");
  rmsnorm_bf16_kernel<<<unsigned(rows), kThreads, 0, stream>>>(x, w, y, dim, eps);
  PDB_CUDA_LAUNCHED();
}

void rmsnorm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  rmsnorm_kernel<<<unsigned(rows), kThreads, 0, stream>>>(x, dim, w, y, dim, dim, eps);
  PDB_CUDA_LAUNCHED();
}

void rmsnorm_rows_f16(const float* x, const float* w, __half* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0) return;
  rmsnorm_kernel<<<unsigned(rows), kThreads, 0, stream>>>(x, dim, w, y, dim, dim, eps);
  PDB_CUDA_LAUNCHED();
}

void rmsnorm_rows_strided(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t rows, int64_t dim, float eps,
                          cudaStream_t stream) {
  if (rows == 0) return;
  rmsnorm_kernel<<<unsigned(rows), kThreads, 0, stream>>>(x, x_stride, w, y, y_stride, dim, eps);
  PDB_CUDA_LAUNCHED();
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
