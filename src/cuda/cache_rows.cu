#include "cuda/cache_rows.cuh"

#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

// One group of n floats per block (n a power of two <= 4096): scaled by 1/sqrt(n) first, then butterflies of
// growing span, ggml-cpu's order. The pairs of one stage are disjoint, so the order of threads cannot change a bit.
__global__ void hadamard_group_kernel(float* __restrict__ x, int n, float scale) {
  extern __shared__ float r[];
  float* g = x + int64_t(blockIdx.x) * n;
  for (int j = threadIdx.x; j < n; j += blockDim.x) r[j] = __fmul_rn(g[j], scale);
  __syncthreads();
  for (int len = 1; len < n; len <<= 1) {
    for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const int i = (p / len) * 2 * len, j = p % len;
      const float u = r[i + j], v = r[i + len + j];
      r[i + j] = __fadd_rn(u, v);
      r[i + len + j] = __fsub_rn(u, v);
    }
    __syncthreads();
  }
  for (int j = threadIdx.x; j < n; j += blockDim.x) g[j] = r[j];
}


constexpr int kHadamardThreads = 256;  // one butterfly pair per thread per stage: 512 elements per block


__device__ inline void store_half(uint8_t* p, float v) {
  const __half h = __float2half_rn(v);
  *reinterpret_cast<__half*>(p) = h;  // block starts are even: 2-byte aligned
}

// One warp per 32-element block, lane i owns element i. ggml-cpu's x86 quantize_row_q8_0:
// d = amax/127 (stored as f16), q = round-half-even(x * (127/amax)).
__global__ void q8_0_encode_kernel(const float* __restrict__ x, int64_t n_blocks, uint8_t* __restrict__ out) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  const Q8Lane e = q8_0_lane(x[b * 32 + lane]);
  uint8_t* blk = out + b * 34;
  blk[2 + lane] = uint8_t(e.code);
  if (lane == 0) store_half(blk, e.scale);
}

// ggml's quantize_row_q4_0_ref: the signed value of largest magnitude (the first one on ties) gives
// d = max / -8; q = min(15, trunc(x * (1/d) + 8.5)); element j and j + 16 share byte j.
__global__ void q4_0_encode_kernel(const float* __restrict__ x, int64_t n_blocks, uint8_t* __restrict__ out) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  const float v = x[b * 32 + lane];
  float amax = fabsf(v);
  int at = lane;
  for (int o = 16; o > 0; o >>= 1) {
    const float oa = __shfl_xor_sync(0xffffffffu, amax, o);
    const int oi = __shfl_xor_sync(0xffffffffu, at, o);
    if (oa > amax || (oa == amax && oi < at)) { amax = oa; at = oi; }
  }
  const float max = __shfl_sync(0xffffffffu, v, at);
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const int q = min(15, __float2int_rz(__fadd_rn(__fmul_rn(v, id), 8.5f)));
  const int hi = __shfl_down_sync(0xffffffffu, q, 16);
  uint8_t* blk = out + b * 18;
  if (lane < 16) blk[2 + lane] = uint8_t(q | (hi << 4));
  if (lane == 0) store_half(blk, d);
}

__global__ void f16_encode_kernel(const float* __restrict__ x, int64_t n, uint8_t* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_half(out + 2 * i, x[i]);
}

}  // namespace

void hadamard_groups(float* x, int64_t groups, int n, cudaStream_t s) {
  if (groups <= 0) return;
  if (n < 2 || n > 4096 || (n & (n - 1))) throw std::invalid_argument("hadamard_groups: n must be a power of two <= 4096");
  if (groups > 0x7fffffff) throw std::invalid_argument("hadamard_groups: too many groups");
  hadamard_group_kernel<<<unsigned(groups), std::min(n / 2, 256), size_t(n) * 4, s>>>(x, n, 1.0f / sqrtf(float(n)));
  PDB_CUDA_LAUNCHED();
}

void hadamard_rows(float* x, int64_t n_total, int64_t n, cudaStream_t s) {
  if (n < 2 || n > 2 * kHadamardThreads || (n & (n - 1)))
    throw std::invalid_argument(fmt::format("hadamard_rows: chunk {} is not a power of two in 2..{}", n, 2 * kHadamardThreads));
  hadamard_groups(x, n_total / n, int(n), s);  // a partial last chunk stays as it is
}

bool encodes_on_gpu(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::Q8_0 || t == GgmlType::Q4_0; }

void encode_rows(GgmlType t, const float* x, int64_t n, uint8_t* out, cudaStream_t s) {
  if (n == 0) return;
  const int threads = 256;
  switch (t) {
    case GgmlType::F32:
      PDB_CUDA_CHECK(cudaMemcpyAsync(out, x, size_t(n) * 4, cudaMemcpyDeviceToDevice, s));
      return;
    case GgmlType::F16:
      f16_encode_kernel<<<unsigned(std::min<int64_t>((n + threads - 1) / threads, 65535)), threads, 0, s>>>(x, n, out);
      break;
    case GgmlType::Q8_0:
    case GgmlType::Q4_0: {
      if (n % 32) throw std::invalid_argument(fmt::format("encode_rows: {} values are not whole 32-element blocks", n));
      const int64_t nb = n / 32;
      const unsigned grid = unsigned((nb * 32 + threads - 1) / threads);
      if (t == GgmlType::Q8_0) q8_0_encode_kernel<<<grid, threads, 0, s>>>(x, nb, out);
      else q4_0_encode_kernel<<<grid, threads, 0, s>>>(x, nb, out);
      break;
    }
    default: throw std::invalid_argument(fmt::format("encode_rows: ggml type {} is encoded on the host", uint32_t(t)));
  }
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
