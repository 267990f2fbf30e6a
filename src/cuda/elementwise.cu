#include "cuda/elementwise.cuh"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

__global__ void round_kernel(float* __restrict__ x, int64_t n, int type) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n) return;
  if (type == 1) x[k] = __half2float(__float2half_rn(x[k]));
  else if (type == 2) x[k] = __bfloat162float(__float2bfloat16_rn(x[k]));
}

__global__ void scale_kernel(float* __restrict__ x, int64_t n, float a) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < n) x[k] = __fmul_rn(x[k], a);
}


constexpr int kThreads = 256;
unsigned blocks_for(int64_t n, int per_thread = 1) {
  const int64_t b = (n + int64_t(kThreads) * per_thread - 1) / (int64_t(kThreads) * per_thread);
  return unsigned(b < 1 ? 1 : (b > 65535LL * 32 ? 65535LL * 32 : b));
}

__global__ void embed_kernel(const float* __restrict__ table, const int32_t* __restrict__ tokens, int64_t dim,
                             float* __restrict__ h) {
  const int64_t r = blockIdx.x;
  const float* src = table + int64_t(tokens[r]) * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) h[r * dim + i] = src[i];
}

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// A thread owns 8 consecutive columns of a row (16-byte loads of gate and up, one 16-byte store); rows
// over blockIdx.y. (One element pair per thread with a 64-bit division for its row made this kernel
// instruction-bound rather than memory-bound.)
__global__ void swiglu_kernel(const __nv_bfloat16* __restrict__ gu, __nv_bfloat16* __restrict__ out, int64_t rows, int64_t ff) {
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (c >= ff) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const uint4 gw = *reinterpret_cast<const uint4*>(gu + r * 2 * ff + c);
    const uint4 uw = *reinterpret_cast<const uint4*>(gu + r * 2 * ff + ff + c);
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gw);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&uw);
    uint4 ow;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&ow);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 g = __bfloat1622float2(g2[i]), u = __bfloat1622float2(u2[i]);
      o2[i] = __floats2bfloat162_rn(silu_times(g.x, u.x), silu_times(g.y, u.y));
    }
    *reinterpret_cast<uint4*>(out + r * ff + c) = ow;
  }
}

__global__ void f32_to_f16_kernel(const float* __restrict__ x, __half* __restrict__ y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) y[i] = __float2half_rn(x[i]);
}
__global__ void f32_to_bf16_kernel(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) y[i] = __float2bfloat16_rn(x[i]);
}
__global__ void f16_to_f32_kernel(const __half* __restrict__ x, float* __restrict__ y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) y[i] = __half2float(x[i]);
}

__global__ void assemble_qkv_kernel(const __nv_bfloat16* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, int64_t rows,
                                    int64_t qw, int64_t kw, __nv_bfloat16* __restrict__ qkv) {
  const int64_t width = qw + 2 * kw, n = rows * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    qkv[i] = c < qw ? q[r * qw + c] : c < qw + kw ? __float2bfloat16_rn(k[r * kw + c - qw]) : __float2bfloat16_rn(v[r * kw + c - qw - kw]);
  }
}

// One warp per 32-element block: lane i owns element i.
__global__ void q8_0_kernel(float* __restrict__ x, int64_t n_blocks) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  const Q8Lane e = q8_0_lane(x[b * 32 + lane]);
  x[b * 32 + lane] = __fmul_rn(float(e.code), __half2float(__float2half_rn(e.scale)));
}

// One warp per 256-value block: the first element of largest magnitude by a (magnitude, -index) reduction.
__global__ void q8_k_kernel(float* __restrict__ x, int64_t n_blocks) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  float* v = x + b * 256;
  float amax = 0.0f, max = 0.0f;
  int at = 256;
  for (int j = lane; j < 256; j += 32)
    if (fabsf(v[j]) > amax) { amax = fabsf(v[j]); max = v[j]; at = j; }  // a lane's first, in index order
  for (int o = 16; o > 0; o /= 2) {
    const float a2 = __shfl_xor_sync(0xffffffffu, amax, o), m2 = __shfl_xor_sync(0xffffffffu, max, o);
    const int at2 = __shfl_xor_sync(0xffffffffu, at, o);
    if (a2 > amax || (a2 == amax && at2 < at)) { amax = a2; max = m2; at = at2; }
  }
  if (amax == 0.0f) return;
  const float iscale = __fdiv_rn(-127.0f, max), d = __fdiv_rn(1.0f, iscale);
  for (int j = lane; j < 256; j += 32) v[j] = __fmul_rn(d, float(min(127, __float2int_rn(__fmul_rn(iscale, v[j])))));
}

template <class Out>
__device__ __forceinline__ Out out_as(float v) {
  if constexpr (std::is_same_v<Out, float>) return v;
  else return __float2half_rn(v);
}

// Rows whose width is not a multiple of 4: one element per thread.
template <class Out>
__global__ void swiglu_f32_kernel(const float* __restrict__ gu, Out* __restrict__ out, int64_t rows, int64_t ff) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * ff; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / ff, c = i % ff;
    out[i] = out_as<Out>(silu_times(gu[r * 2 * ff + c], gu[r * 2 * ff + ff + c]));
  }
}

// A thread owns 4 consecutive columns of a row (16-byte loads of gate and up, one store); rows over blockIdx.y. The
// element-per-thread form above, with a 64-bit division per element, is instruction-bound at Llama-8B's 58M values
// a 4,096-row chunk.
template <class Out>
__global__ void swiglu_f32_vec_kernel(const float* __restrict__ gu, Out* __restrict__ out, int64_t rows, int64_t ff) {
  const int64_t c = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (c >= ff) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float4 g = *reinterpret_cast<const float4*>(gu + r * 2 * ff + c);
    const float4 u = *reinterpret_cast<const float4*>(gu + r * 2 * ff + ff + c);
    const float o0 = silu_times(g.x, u.x), o1 = silu_times(g.y, u.y), o2 = silu_times(g.z, u.z), o3 = silu_times(g.w, u.w);
    if constexpr (std::is_same_v<Out, float>) {
      *reinterpret_cast<float4*>(out + r * ff + c) = make_float4(o0, o1, o2, o3);
    } else {
      __half2 h[2] = {__halves2half2(__float2half_rn(o0), __float2half_rn(o1)), __halves2half2(__float2half_rn(o2), __float2half_rn(o3))};
      *reinterpret_cast<uint2*>(out + r * ff + c) = *reinterpret_cast<const uint2*>(h);
    }
  }
}

template <class Out>
void swiglu_f32_launch(const float* gu, Out* out, int64_t rows, int64_t ff, cudaStream_t s) {
  if (rows * ff == 0) return;
  const bool aligned = ff % 4 == 0 && reinterpret_cast<uintptr_t>(gu) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % (4 * sizeof(Out)) == 0;
  if (aligned) {
    const dim3 grid(unsigned((ff / 4 + kThreads - 1) / kThreads), unsigned(std::min<int64_t>(rows, 65535)));
    swiglu_f32_vec_kernel<Out><<<grid, kThreads, 0, s>>>(gu, out, rows, ff);
  } else {
    swiglu_f32_kernel<Out><<<blocks_for(rows * ff), kThreads, 0, s>>>(gu, out, rows, ff);
  }
  PDB_CUDA_LAUNCHED();
}

template <bool F32>
__device__ __forceinline__ float load_act(const void* x, int64_t i) {
  if constexpr (F32) return static_cast<const float*>(x)[i];
  else return __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
}

template <bool F32>
__global__ void act_half_kernel(const void* __restrict__ x, int64_t n, __half* __restrict__ y) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2half_rn(load_act<F32>(x, i));
}

// One warp per 32-value block (q8_0_kernel's rounding), the values written as half.
template <bool F32>
__global__ void act_q8_0_half_kernel(const void* __restrict__ x, int64_t n_blocks, __half* __restrict__ y) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  const Q8Lane e = q8_0_lane(load_act<F32>(x, b * 32 + lane));
  y[b * 32 + lane] = __float2half_rn(__fmul_rn(float(e.code), __half2float(__float2half_rn(e.scale))));
}

// One warp per 256-value block (q8_k_kernel's rounding), the values written as half.
template <bool F32>
__global__ void act_q8_k_half_kernel(const void* __restrict__ x, int64_t n_blocks, __half* __restrict__ y) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  float v[8];
  float amax = 0.0f, max = 0.0f;
  int at = 256;
  for (int k = 0; k < 8; ++k) {
    const int j = lane + 32 * k;
    v[k] = load_act<F32>(x, b * 256 + j);
    if (fabsf(v[k]) > amax) { amax = fabsf(v[k]); max = v[k]; at = j; }
  }
  for (int o = 16; o > 0; o /= 2) {
    const float a2 = __shfl_xor_sync(0xffffffffu, amax, o), m2 = __shfl_xor_sync(0xffffffffu, max, o);
    const int at2 = __shfl_xor_sync(0xffffffffu, at, o);
    if (a2 > amax || (a2 == amax && at2 < at)) { amax = a2; max = m2; at = at2; }
  }
  if (amax == 0.0f) {
    for (int k = 0; k < 8; ++k) y[b * 256 + lane + 32 * k] = __float2half_rn(v[k]);
    return;
  }
  const float iscale = __fdiv_rn(-127.0f, max), d = __fdiv_rn(1.0f, iscale);
  for (int k = 0; k < 8; ++k)
    y[b * 256 + lane + 32 * k] = __float2half_rn(__fmul_rn(d, float(min(127, __float2int_rn(__fmul_rn(iscale, v[k]))))));
}

// One warp per 32-value block: q8_0_lane's codes (Q8_1's are the same), their sum, the f16 rounding of d * sum.
__global__ void q8_1_sum_kernel(const float* __restrict__ x, int64_t n_blocks, float* __restrict__ c) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  const Q8Lane e = q8_0_lane(x[b * 32 + lane]);
  int sum = e.code;
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) {
    const float s = float(sum);
    c[b] = __fsub_rn(__half2float(__float2half_rn(__fmul_rn(e.scale, s))), __fmul_rn(__half2float(__float2half_rn(e.scale)), s));
  }
}

__global__ void add_bias_kernel(float* __restrict__ y, const float* __restrict__ bias, int64_t rows, int64_t cols) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += bias[i % cols];
}

}  // namespace

void embed_rows(const float* table, const int32_t* tokens, int64_t rows, int64_t dim, float* h, cudaStream_t s) {
  if (rows == 0) return;
  embed_kernel<<<unsigned(rows), kThreads, 0, s>>>(table, tokens, dim, h);
  PDB_CUDA_LAUNCHED();
}

void swiglu_rows(const __nv_bfloat16* gu, __nv_bfloat16* out, int64_t rows, int64_t ff, cudaStream_t s) {
  if (rows == 0) return;
  if (ff % 8) throw std::invalid_argument("swiglu_rows: the intermediate size must be a multiple of 8");
  const dim3 grid(unsigned((ff / 8 + kThreads - 1) / kThreads), unsigned(std::min<int64_t>(rows, 65535)));
  swiglu_kernel<<<grid, kThreads, 0, s>>>(gu, out, rows, ff);
  PDB_CUDA_LAUNCHED();
}

void swiglu_rows_f32(const float* gu, float* out, int64_t rows, int64_t ff, cudaStream_t s) { swiglu_f32_launch(gu, out, rows, ff, s); }
void swiglu_rows_f32_half(const float* gu, __half* out, int64_t rows, int64_t ff, cudaStream_t s) { swiglu_f32_launch(gu, out, rows, ff, s); }

void product_input_half(const void* x, bool x_f32, int64_t n, int block, __half* y, cudaStream_t s) {
  if (n <= 0) return;
  if (block != 0 && block != 32 && block != 256) throw std::invalid_argument("product_input_half: block 0, 32 or 256");
  if (block && n % block) throw std::invalid_argument("product_input_half: not whole blocks");
  auto launch = [&](auto f32) {
    constexpr bool F = decltype(f32)::value;
    if (block == 0) act_half_kernel<F><<<blocks_for(n), kThreads, 0, s>>>(x, n, y);
    else if (block == 32) act_q8_0_half_kernel<F><<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(x, n / 32, y);
    else act_q8_k_half_kernel<F><<<unsigned((n / 256 * 32 + kThreads - 1) / kThreads), kThreads, 0, s>>>(x, n / 256, y);
  };
  if (x_f32) launch(std::true_type{});
  else launch(std::false_type{});
  PDB_CUDA_LAUNCHED();
}

void f32_to_f16(const float* x, __half* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  f32_to_f16_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
  PDB_CUDA_LAUNCHED();
}
void f32_to_bf16(const float* x, __nv_bfloat16* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  f32_to_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
  PDB_CUDA_LAUNCHED();
}
void assemble_qkv_rows(const __nv_bfloat16* q, const float* k, const float* v, int64_t rows, int64_t qw, int64_t kw, __nv_bfloat16* qkv,
                       cudaStream_t s) {
  const int64_t n = rows * (qw + 2 * kw);
  if (n == 0) return;
  assemble_qkv_kernel<<<blocks_for(n), kThreads, 0, s>>>(q, k, v, rows, qw, kw, qkv);
  PDB_CUDA_LAUNCHED();
}
void f16_to_f32(const __half* x, float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  f16_to_f32_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
  PDB_CUDA_LAUNCHED();
}

void q8_0_round_trip(float* x, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  const int64_t nb = n / 32;
  q8_0_kernel<<<unsigned((nb * 32 + kThreads - 1) / kThreads), kThreads, 0, s>>>(x, nb);
  PDB_CUDA_LAUNCHED();
}

void q8_k_round_trip(float* x, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  if (n % 256) throw std::invalid_argument("q8_k_round_trip: not whole 256-value blocks");
  const int64_t nb = n / 256;
  q8_k_kernel<<<unsigned((nb * 32 + kThreads - 1) / kThreads), kThreads, 0, s>>>(x, nb);
  PDB_CUDA_LAUNCHED();
}

void q8_1_sum_corrections(const float* x, int64_t n, float* c, cudaStream_t s) {
  if (n <= 0) return;
  if (n % 32) throw std::invalid_argument("q8_1_sum_corrections: not whole 32-value blocks");
  q8_1_sum_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(x, n / 32, c);
  PDB_CUDA_LAUNCHED();
}

void add_bias_rows(float* y, const float* bias, int64_t rows, int64_t cols, cudaStream_t s) {
  if (rows * cols == 0) return;
  add_bias_kernel<<<blocks_for(rows * cols), kThreads, 0, s>>>(y, bias, rows, cols);
  PDB_CUDA_LAUNCHED();
}

void round_as_cached(float* x, int64_t n, int type, cudaStream_t s) {
  if (n <= 0 || type == 0) return;
  round_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(x, n, type);
  PDB_CUDA_LAUNCHED();
}

void scale_f32(float* x, int64_t n, float a, cudaStream_t s) {
  if (n <= 0) return;
  scale_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(x, n, a);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
