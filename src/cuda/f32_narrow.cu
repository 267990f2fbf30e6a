// The narrow f32 products of f32_narrow.cuh. A CTA: 128 rows x all n outputs, 192 threads as 16 row groups x 12
// column groups (a warp: 8 x 4), thread (rg, cg) owning rows rg + 16 i (i < 8) and outputs cg + 12 j (j < n / 12).
// k in steps of 32 through three cp.async stages of x's and w's rows, each row padded to 36 floats: the 8 rows (or 4
// outputs) a warp reads with one 16-byte load start 4 banks apart, so every load is one shared-memory wavefront.
#include "cuda/f32_narrow.cuh"

#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

constexpr int kRows = 128, kBK = 32, kPitch = kBK + 4, kRowGroups = 16, kColGroups = 12, kThreads = kRowGroups * kColGroups, kStages = 3;
constexpr int kRowsPerThread = kRows / kRowGroups;

template <int N>
__host__ __device__ constexpr int stage_floats() { return (kRows + N) * kPitch; }
template <int N>
__host__ __device__ constexpr int smem_bytes() { return kStages * stage_floats<N>() * 4; }

// One k-step's rows of x (past the last: zeros) and of w into a stage; one cp.async group.
template <int N>
__device__ __forceinline__ void load_step(float* stage, const float* __restrict__ x, const float* __restrict__ w, int64_t rows, int64_t k,
                                          int64_t m0, int64_t k0) {
  for (int i = threadIdx.x; i < (kRows + N) * (kBK / 4); i += kThreads) {
    const int r = i / (kBK / 4), c = i % (kBK / 4);
    bool ok = true;
    const float* src;
    if (r < kRows) {
      ok = m0 + r < rows;
      src = x + (ok ? m0 + r : 0) * k + k0 + c * 4;
    } else {
      src = w + int64_t(r - kRows) * k + k0 + c * 4;
    }
    cp_async16(uint32_t(__cvta_generic_to_shared(stage + r * kPitch + c * 4)), src, ok);
  }
  cp_async_commit();
}

// Split s = blockIdx.y of gridDim.y takes k's steps [s nk, (s + 1) nk) and writes its partial sums to y + s rows N.
template <int N>
__global__ void __launch_bounds__(kThreads) narrow_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                                          int64_t rows, int64_t k) {
  constexpr int TN = N / kColGroups;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rg = (warp % 2) * 8 + lane / 4, cg = (warp / 2) * 4 + lane % 4;
  const int64_t m0 = int64_t(blockIdx.x) * kRows;
  const int nk = int(k / kBK) / int(gridDim.y);
  const int64_t kb = int64_t(blockIdx.y) * nk * kBK;  // the split's first input
  y += int64_t(blockIdx.y) * rows * N;
  float acc[kRowsPerThread][TN];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;

  load_step<N>(sm, x, w, rows, k, m0, kb);
  if (nk > 1) load_step<N>(sm + stage_floats<N>(), x, w, rows, k, m0, kb + kBK);
  else cp_async_commit();
  for (int s = 0; s < nk; ++s) {
    cp_async_wait<1>();  // step s's group (one group per step, empty past the last)
    __syncthreads();     // ... everyone's; and step s - 1's stage read by all
    if (s + 2 < nk) load_step<N>(sm + ((s + 2) % kStages) * stage_floats<N>(), x, w, rows, k, m0, kb + int64_t(s + 2) * kBK);
    else cp_async_commit();
    const float* A = sm + (s % kStages) * stage_floats<N>();
    const float* B = A + kRows * kPitch;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 4) {
      float4 a[kRowsPerThread], b[TN];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) a[i] = *reinterpret_cast<const float4*>(A + (rg + kRowGroups * i) * kPitch + kk);
#pragma unroll
      for (int j = 0; j < TN; ++j) b[j] = *reinterpret_cast<const float4*>(B + (cg + kColGroups * j) * kPitch + kk);
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          float v = acc[i][j];
          v = fmaf(a[i].x, b[j].x, v);
          v = fmaf(a[i].y, b[j].y, v);
          v = fmaf(a[i].z, b[j].z, v);
          acc[i][j] = fmaf(a[i].w, b[j].w, v);
        }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = m0 + rg + kRowGroups * i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) y[r * N + cg + kColGroups * j] = acc[i][j];
  }
}

// y = the splits' partial sums added in split order (each a sum in k order).
__global__ void add_splits_kernel(const float* __restrict__ partials, int splits, int64_t count, float* __restrict__ y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float v = partials[i];
  for (int s = 1; s < splits; ++s) v += partials[int64_t(s) * count + i];
  y[i] = v;
}

template <int N>
void launch(const float* x, const float* w, float* y, int64_t rows, int64_t k, int splits, cudaStream_t s) {
  static const bool configured = [] {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(narrow_kernel<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<N>()));
    return true;
  }();
  (void)configured;
  narrow_kernel<N><<<dim3(unsigned((rows + kRows - 1) / kRows), unsigned(splits)), kThreads, smem_bytes<N>(), s>>>(x, w, y, rows, k);
  PDB_CUDA_LAUNCHED();
}

}  // namespace

bool f32_narrow_supported(const float* x, const float* w, int64_t k, int64_t n) {
  return (n == 24 || n == 48) && k > 0 && k % kBK == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

bool f32_narrow_fills_gpu(int64_t rows) {
  const int sms = multiprocessor_count();
  return sms > 0 && rows >= int64_t(kRows) * sms;
}

int f32_narrow_splits(int64_t rows, int64_t k) {
  const int sms = multiprocessor_count();
  const int64_t tiles = (rows + kRows - 1) / kRows, steps = k / kBK;
  int splits = 1;
  while (tiles * splits < sms && splits < 8 && steps % (2 * splits) == 0 && steps / (2 * splits) >= 8) splits *= 2;
  return splits;
}

void f32_narrow_xwt(const float* x, const float* w, float* y, int64_t rows, int64_t k, int64_t n, cudaStream_t s, float* partials, int splits) {
  if (rows <= 0) return;
  if (!f32_narrow_supported(x, w, k, n))
    throw std::invalid_argument("f32_narrow_xwt: needs n 24 or 48, k a multiple of 32 and 16-byte aligned operands; not " +
                                std::to_string(rows) + " x " + std::to_string(k) + " -> " + std::to_string(n));
  if (splits < 1 || (k / kBK) % splits || (splits > 1 && !partials))
    throw std::invalid_argument("f32_narrow_xwt: " + std::to_string(splits) + " splits of " + std::to_string(k / kBK) + " k-steps" +
                                (partials ? "" : " without a workspace"));
  float* out = splits > 1 ? partials : y;
  if (n == 48) launch<48>(x, w, out, rows, k, splits, s);
  else launch<24>(x, w, out, rows, k, splits, s);
  if (splits == 1) return;
  f32_add_splits(partials, splits, rows * n, y, s);
}

void f32_add_splits(const float* partials, int splits, int64_t count, float* y, cudaStream_t s) {
  if (count <= 0) return;
  add_splits_kernel<<<unsigned((count + 255) / 256), 256, 0, s>>>(partials, splits, count, y);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
