#include "cuda/rope.cuh"

#include <cuda_fp16.h>

#include <stdexcept>

#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

__global__ void rope_tail_kernel(float* __restrict__ x, const float* __restrict__ cs, int64_t n, int H, int width, int r, int64_t stride,
                                 int64_t cs_stride) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int pairs = r / 2;
  if (k >= n * H * pairs) return;
  const int64_t t = k / (int64_t(H) * pairs);
  const int h = int((k / pairs) % H), i0 = int(k % pairs) * 2;
  float* a = x + t * stride + int64_t(h) * width + (width - r) + i0;
  const float c = cs[t * cs_stride + i0], s = cs[t * cs_stride + i0 + 1];
  const float x0 = a[0], x1 = a[1];
  a[0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
  a[1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}


constexpr int kWarpsPerBlock = 8;
constexpr int kMaxHeadDim = 256;

// One K or V row of D values held PER per lane, rounded to bf16, into e4m3 codes and one scale (the
// warp's amax): the per-block quantizer of fp8.cu applied to a whole head row.
template <int PER>
__device__ __forceinline__ void store_fp8_row(const float* y, int lane, uint8_t* codes, float* scale) {
  float v[PER];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    v[i] = __bfloat162float(__float2bfloat16_rn(y[i]));
    amax = fmaxf(amax, fabsf(v[i]));
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float sc = fp8_scale_for(amax);
#pragma unroll
  for (int i = 0; i < PER; ++i) codes[lane + 32 * i] = fp8_code(v[i], sc);
  if (lane == 0) *scale = sc;
}

__device__ __forceinline__ float qkv_value(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float qkv_value(const float* p) { return *p; }

// One warp per (row, head). Lane i holds channels i, i+32, ...: the rotate-half partner of
// channel c < D/2 is c + D/2, held by the same lane (D/2 is a multiple of 32). T: the product's type (bf16, or f32
// for half products, whose f32 result is read without a bf16 copy in between).
template <int D, class T>
__global__ void qkv_rope_kernel(const T* __restrict__ qkv, __nv_bfloat16* __restrict__ q_out,
                                __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache, QkvRopeArgs a) {
  constexpr int PER = D / 32;
  const int heads = a.n_heads + 2 * a.n_kv_heads;
  const int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (item >= a.rows * heads) return;
  const int lane = threadIdx.x % 32;
  const int64_t r = item / heads;
  const int h = int(item % heads);
  const T* src = qkv + (r * heads + h) * D;
  float x[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) x[i] = qkv_value(src + lane + 32 * i);
  const int64_t pos = a.pos0 + r;
  if (h >= a.n_heads + a.n_kv_heads) {  // V: straight into the cache
    const int64_t at = int64_t(h - a.n_heads - a.n_kv_heads) * a.kv_capacity + pos;
    if (a.v_fp8) return store_fp8_row<PER>(x, lane, a.v_fp8 + at * D, a.v_scale + at);
    __nv_bfloat16* dst = v_cache + at * D;
#pragma unroll
    for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = __float2bfloat16_rn(x[i]);
    return;
  }
  const bool is_q = h < a.n_heads;
  const float* norm = is_q ? a.q_norm : a.k_norm;
  if (norm) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) ss += x[i] * x[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float sc = rsqrtf(ss / float(D) + a.eps);
#pragma unroll
    for (int i = 0; i < PER; ++i) x[i] = x[i] * sc * norm[lane + 32 * i];
  }
  float y[PER];
#pragma unroll
  for (int i = 0; i < PER / 2; ++i) {
    const int c = lane + 32 * i;  // c < D/2
    float sn, cs;
    sincosf(float(pos) * a.inv_freq[c], &sn, &cs);
    cs *= a.attn_scale;
    sn *= a.attn_scale;
    const float x0 = x[i], x1 = x[i + PER / 2];
    y[i] = x0 * cs - x1 * sn;
    y[i + PER / 2] = x1 * cs + x0 * sn;
  }
  const int64_t at = int64_t(h - a.n_heads) * a.kv_capacity + pos;  // K's place in the cache
  if (!is_q && a.k_fp8) return store_fp8_row<PER>(y, lane, a.k_fp8 + at * D, a.k_scale + at);
  __nv_bfloat16* dst = is_q ? q_out + (r * a.n_heads + h) * D : k_cache + at * D;
#pragma unroll
  for (int i = 0; i < PER; ++i) dst[lane + 32 * i] = __float2bfloat16_rn(y[i]);
}

// Element t of a head row after the decoder's per-head RMSNorm (qwen3's attn_k_norm; ggml's order: a sequential
// double sum, x * scale, then * w). Every thread of the head's block calls it.
__device__ __forceinline__ float k_norm_value(float v, const float* __restrict__ k_norm, double* red, int t, int head_dim, float eps) {
  red[t] = double(v * v);
  __syncthreads();
  if (t == 0) {  // sequential double sum: ggml-cpu's order
    double s = 0.0;
    for (int i = 0; i < head_dim; ++i) s += red[i];
    red[0] = s;
  }
  __syncthreads();
  const float mean = float(red[0] / double(head_dim));
  const float scale = 1.0f / sqrtf(mean + eps);
  return __fmul_rn(__fmul_rn(v, scale), k_norm[t]);
}

// One block (head_dim threads) per (row, head).
__global__ void rope_ggml_kernel(float* __restrict__ k, int64_t row_stride, const float* __restrict__ cs, int n_heads, int head_dim, int n_dims,
                                 bool neox, const float* __restrict__ k_norm, float eps) {
  const int64_t r = blockIdx.x / n_heads;
  const int h = blockIdx.x % n_heads;
  float* x = k + r * row_stride + int64_t(h) * head_dim;
  __shared__ float buf[kMaxHeadDim];
  __shared__ double red[kMaxHeadDim];
  const int t = threadIdx.x;
  float v = x[t];
  if (k_norm) v = k_norm_value(v, k_norm, red, t, head_dim, eps);
  buf[t] = v;
  __syncthreads();
  if (t < n_dims / 2) {
    const int i0 = 2 * t;
    const float c = cs[r * n_dims + i0], s = cs[r * n_dims + i0 + 1];
    const int ia = neox ? t : i0, ib = neox ? t + n_dims / 2 : i0 + 1;
    const float x0 = buf[ia], x1 = buf[ib];
    x[ia] = x0 * c - x1 * s;
    x[ib] = x0 * s + x1 * c;
  } else if (t >= n_dims) {
    x[t] = v;
  }
}

// The same rows straight from the engine's products into an f16 cache's bytes: one block (head_dim threads) per
// (row, head); element t of K read from HF's order where asked, normed, rotated as rope_ggml_kernel's pair of it
// (the same expressions), both rows rounded as encode_rows' F16.
__global__ void kv_rows_f16_kernel(const float* __restrict__ k, const float* __restrict__ v, const float* __restrict__ cs, int n_heads, int head_dim,
                                   int n_dims, bool neox, bool hf_order, const float* __restrict__ k_norm, float eps, __half* __restrict__ k_out,
                                   __half* __restrict__ v_out, int64_t in_stride) {
  const int64_t r = blockIdx.x / n_heads;
  const int64_t base = int64_t(blockIdx.x) * head_dim;  // row r, head blockIdx.x % n_heads
  const int64_t in = r * in_stride + int64_t(blockIdx.x % n_heads) * head_dim;  // the same in rows in_stride apart
  __shared__ float buf[kMaxHeadDim];
  __shared__ double red[kMaxHeadDim];
  const int t = threadIdx.x;
  float x = k[in + (hf_order ? (t % 2) * (head_dim / 2) + t / 2 : t)];
  if (k_norm) x = k_norm_value(x, k_norm, red, t, head_dim, eps);
  buf[t] = x;
  __syncthreads();
  float out = x;
  if (t < n_dims) {  // pair p: elements (p, p + n_dims/2) in NEOX mode, (2p, 2p + 1) otherwise
    const int half = n_dims / 2;
    const bool first = neox ? t < half : t % 2 == 0;
    const int p = neox ? (first ? t : t - half) : t / 2;
    const int ia = neox ? p : 2 * p, ib = neox ? p + half : 2 * p + 1;
    const float c = cs[r * n_dims + 2 * p], s = cs[r * n_dims + 2 * p + 1];
    const float x0 = buf[ia], x1 = buf[ib];
    out = first ? x0 * c - x1 * s : x0 * s + x1 * c;
  }
  k_out[base + t] = __float2half_rn(out);
  v_out[base + t] = __float2half_rn(v[in + t]);
}

}  // namespace

void kv_rows_to_f16(const float* k, const float* v, const float* cs, int64_t rows, int n_heads, int head_dim, int n_dims, bool neox, bool hf_order,
                    const float* k_norm, float eps, void* k_out, void* v_out, cudaStream_t s, int64_t in_stride) {
  if (rows == 0) return;
  if (head_dim > kMaxHeadDim || n_dims > head_dim || n_dims % 2 || head_dim % 2) throw std::invalid_argument("kv_rows_to_f16: bad head_dim/n_dims");
  if (in_stride == 0) in_stride = int64_t(n_heads) * head_dim;
  if (in_stride < int64_t(n_heads) * head_dim) throw std::invalid_argument("kv_rows_to_f16: rows overlap (stride below the row)");
  kv_rows_f16_kernel<<<unsigned(rows * n_heads), unsigned(head_dim), 0, s>>>(k, v, cs, n_heads, head_dim, n_dims, neox, hf_order, k_norm, eps,
                                                                          static_cast<__half*>(k_out), static_cast<__half*>(v_out), in_stride);
  PDB_CUDA_LAUNCHED();
}

namespace {
template <class T>
void qkv_rope_launch(const T* qkv, __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const QkvRopeArgs& a, cudaStream_t s) {
  if (a.rows == 0) return;
  if (a.pos0 + a.rows > a.kv_capacity) throw std::invalid_argument("qkv_rope_to_cache: rows past the cache capacity");
  const int64_t items = a.rows * (a.n_heads + 2 * a.n_kv_heads);
  const unsigned grid = unsigned((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
  switch (a.head_dim) {
    case 64: qkv_rope_kernel<64, T><<<grid, 32 * kWarpsPerBlock, 0, s>>>(qkv, q_out, k_cache, v_cache, a); break;
    case 128: qkv_rope_kernel<128, T><<<grid, 32 * kWarpsPerBlock, 0, s>>>(qkv, q_out, k_cache, v_cache, a); break;
    default: throw std::invalid_argument("qkv_rope_to_cache: head_dim must be 64 or 128");
  }
  PDB_CUDA_LAUNCHED();
}
}  // namespace

void qkv_rope_to_cache(const __nv_bfloat16* qkv, __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
                       const QkvRopeArgs& a, cudaStream_t s) {
  qkv_rope_launch(qkv, q_out, k_cache, v_cache, a, s);
}
void qkv_rope_to_cache(const float* qkv, __nv_bfloat16* q_out, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const QkvRopeArgs& a,
                       cudaStream_t s) {
  qkv_rope_launch(qkv, q_out, k_cache, v_cache, a, s);
}

void rope_ggml_rows(float* k, const float* cs, int64_t rows, int n_heads, int head_dim, int n_dims, bool neox,
                    const float* k_norm, float eps, cudaStream_t s, int64_t row_stride) {
  if (rows == 0) return;
  if (head_dim > kMaxHeadDim || n_dims > head_dim || n_dims % 2) throw std::invalid_argument("rope_ggml_rows: bad head_dim/n_dims");
  if (row_stride == 0) row_stride = int64_t(n_heads) * head_dim;
  rope_ggml_kernel<<<unsigned(rows * n_heads), unsigned(head_dim), 0, s>>>(k, row_stride, cs, n_heads, head_dim, n_dims, neox, k_norm, eps);
  PDB_CUDA_LAUNCHED();
}

namespace {
__global__ void qk_rows_to_gguf_order_kernel(const float* __restrict__ in, float* __restrict__ out, int64_t n, int head_dim) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // the output element
  if (k >= n) return;
  const int j = int(k % head_dim), half = head_dim / 2;
  out[k] = in[k - j + (j % 2) * half + j / 2];
}
}  // namespace

void qk_rows_to_gguf_order(const float* in, float* out, int64_t rows, int n_heads, int head_dim, cudaStream_t s) {
  if (head_dim % 2) throw std::invalid_argument("qk_rows_to_gguf_order: odd head_dim");
  const int64_t n = rows * n_heads * head_dim;
  if (n == 0) return;
  qk_rows_to_gguf_order_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(in, out, n, head_dim);
  PDB_CUDA_LAUNCHED();
}

void rope_tail(float* x, const float* cs, int64_t n, int heads, int width, int r, int64_t row_stride, cudaStream_t s, int64_t cs_stride) {
  if (n <= 0) return;
  if (r % 2 || r > width) throw std::invalid_argument("rope_tail: r must be even and <= width");
  rope_tail_kernel<<<unsigned((n * heads * (r / 2) + 255) / 256), 256, 0, s>>>(x, cs, n, heads, width, r, row_stride ? row_stride : int64_t(heads) * width,
                                                                    cs_stride ? cs_stride : r);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
