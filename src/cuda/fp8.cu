#include "cuda/fp8.cuh"

#include <cuda_fp8.h>

#include <algorithm>
#include <stdexcept>

#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

// One warp per (row, 128-column block); lane i owns columns 4i..4i+3 of the block.
__global__ void quantize_fp8_kernel(const __nv_bfloat16* __restrict__ x, int64_t rows, int64_t k, uint8_t* __restrict__ q,
                                    float* __restrict__ scales, bool row_major, int64_t ld) {
  const int64_t kblocks = k / 128;
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows * kblocks) return;
  const int64_t r = w / kblocks, kb = w % kblocks;
  const __nv_bfloat16* xb = x + r * k + kb * 128 + lane * 4;
  float v[4];
  float amax = 0.0f;
  for (int i = 0; i < 4; ++i) {
    v[i] = __bfloat162float(xb[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = fp8_scale_for(amax);
  uint8_t* qb = q + r * k + kb * 128 + lane * 4;
  for (int i = 0; i < 4; ++i) qb[i] = fp8_code(v[i], scale);
  if (lane == 0) scales[row_major ? r * kblocks + kb : kb * ld + r] = scale;
}

// One thread per 16 codes of a row (one 16-byte load, two 16-byte stores); blockIdx.y is the head.
__global__ void expand_fp8_rows_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, int64_t capacity, int64_t rows,
                                       int head_dim, __nv_bfloat16* __restrict__ out) {
  // 32-bit index arithmetic (the launcher checks rows x per_row < 2^31): a 64-bit division per thread
  // would cost more than the thread's 48 bytes of memory traffic.
  const unsigned per_row = unsigned(head_dim) / 16;
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (int64_t(i) >= rows * per_row) return;
  const int64_t row = int64_t(blockIdx.y) * capacity + i / per_row;
  const int64_t at = row * head_dim + int64_t(i % per_row) * 16;
  const uint4 w = *reinterpret_cast<const uint4*>(codes + at);
  const float scale = scales[row];
  uint32_t o[8];
  fp8x4_to_bf16(w.x, scale, o);
  fp8x4_to_bf16(w.y, scale, o + 2);
  fp8x4_to_bf16(w.z, scale, o + 4);
  fp8x4_to_bf16(w.w, scale, o + 6);
  uint4* dst = reinterpret_cast<uint4*>(out + at);
  dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
  dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

__global__ void add_bf16_kernel(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += __bfloat162float(x[i]);
}

}  // namespace

size_t fp8_scale_bytes(int64_t rows, int64_t k, const Fp8ScaleLayout& L) {
  const int64_t kblocks = k / 128;
  return size_t(kblocks * (L.act_row_major ? rows : L.act_ld(rows))) * 4;
}

void quantize_rows_fp8(const __nv_bfloat16* x, int64_t rows, int64_t k, uint8_t* q, float* scales, const Fp8ScaleLayout& L,
                       cudaStream_t s) {
  if (k % 128) throw std::invalid_argument("quantize_rows_fp8: width must be a multiple of 128");
  if (rows == 0) return;
  const int64_t warps = rows * (k / 128);
  const int threads = 256;
  quantize_fp8_kernel<<<unsigned((warps * 32 + threads - 1) / threads), threads, 0, s>>>(x, rows, k, q, scales, L.act_row_major,
                                                                                         L.act_ld(rows));
  PDB_CUDA_LAUNCHED();
}

void expand_fp8_rows(const uint8_t* codes, const float* scales, int n_heads, int64_t capacity, int64_t rows, int head_dim, __nv_bfloat16* out,
                     cudaStream_t s) {
  if (head_dim % 16) throw std::invalid_argument("expand_fp8_rows: head_dim must be a multiple of 16");
  if (rows > capacity) throw std::invalid_argument("expand_fp8_rows: rows past the capacity");
  if (rows <= 0 || n_heads <= 0) return;
  const int64_t threads = rows * (head_dim / 16);
  if (threads >= (int64_t(1) << 31)) throw std::invalid_argument("expand_fp8_rows: more than 2^31 16-code pieces per head");
  expand_fp8_rows_kernel<<<dim3(unsigned((threads + 255) / 256), unsigned(n_heads)), 256, 0, s>>>(codes, scales, capacity, rows, head_dim, out);
  PDB_CUDA_LAUNCHED();
}

void add_bf16_into_f32(const __nv_bfloat16* x, float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_bf16_kernel<<<unsigned(std::min<int64_t>((n + 255) / 256, 65535)), 256, 0, s>>>(x, y, n);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
