#include "cuda/mla.cuh"

#include <stdexcept>

#include "cuda/common.cuh"

namespace pdb::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rmsnorm_strided_kernel(const __nv_bfloat16* __restrict__ x, int64_t xs, const float* __restrict__ w, __nv_bfloat16* __restrict__ y,
                                       int64_t ys, int64_t dim, float eps) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* xr = x + row * xs;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float v = __bfloat162float(xr[i]);
    sum += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < kThreads / 32; ++i) total += warp_sums[i];
  const float scale = rsqrtf(total / float(dim) + eps);
  __nv_bfloat16* yr = y + row * ys;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) yr[i] = __float2bfloat16_rn(__bfloat162float(xr[i]) * scale * w[i]);
}

// One block per row: thread t of the first n_heads * nope copies q_nope, the rope pairs of every head
// and of k_pe are rotated (NORM: pairs (2i, 2i+1)).
__global__ void rope_qk_kernel(const __nv_bfloat16* __restrict__ q, int64_t q_stride, const __nv_bfloat16* __restrict__ k_pe, int64_t kpe_stride,
                               const float* __restrict__ cs, __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ k_cache, MlaShape m) {
  const int64_t r = blockIdx.x;
  const int qk = m.nope + m.rope, pairs = m.rope / 2;
  const __nv_bfloat16* qr = q + r * q_stride;
  __nv_bfloat16* qo = q_out + r * int64_t(m.n_heads) * qk;
  const float* c = cs + r * m.rope;
  for (int i = threadIdx.x; i < m.n_heads * m.nope; i += blockDim.x) {
    const int h = i / m.nope, d = i % m.nope;
    qo[h * qk + d] = qr[h * qk + d];
  }
  for (int i = threadIdx.x; i < (m.n_heads + 1) * pairs; i += blockDim.x) {
    const int h = i / pairs, p = i % pairs;
    const float cv = c[2 * p], sv = c[2 * p + 1];
    if (h < m.n_heads) {
      const float x0 = __bfloat162float(qr[h * qk + m.nope + 2 * p]), x1 = __bfloat162float(qr[h * qk + m.nope + 2 * p + 1]);
      qo[h * qk + m.nope + 2 * p] = __float2bfloat16_rn(x0 * cv - x1 * sv);
      qo[h * qk + m.nope + 2 * p + 1] = __float2bfloat16_rn(x0 * sv + x1 * cv);
    } else {
      const __nv_bfloat16* kr = k_pe + r * kpe_stride;
      const float x0 = __bfloat162float(kr[2 * p]), x1 = __bfloat162float(kr[2 * p + 1]);
      const __nv_bfloat16 y0 = __float2bfloat16_rn(x0 * cv - x1 * sv), y1 = __float2bfloat16_rn(x0 * sv + x1 * cv);
      for (int hh = 0; hh < m.n_heads; ++hh) {
        __nv_bfloat16* dst = k_cache + (int64_t(hh) * m.kv_capacity + m.pos0 + r) * qk + m.nope;
        dst[2 * p] = y0;
        dst[2 * p + 1] = y1;
      }
    }
  }
}

__global__ void scatter_kv_kernel(const __nv_bfloat16* __restrict__ kvb, __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache,
                                  MlaShape m) {
  const int64_t r = blockIdx.x;
  const int qk = m.nope + m.rope, w = m.nope + m.v_dim;
  const __nv_bfloat16* src = kvb + r * int64_t(m.n_heads) * w;
  for (int i = threadIdx.x; i < m.n_heads * w; i += blockDim.x) {
    const int h = i / w, d = i % w;
    const int64_t at = int64_t(h) * m.kv_capacity + m.pos0 + r;
    if (d < m.nope) k_cache[at * qk + d] = src[i];
    else v_cache[at * m.v_dim + (d - m.nope)] = src[i];
  }
}

}  // namespace

void rmsnorm_rows_strided_bf16(const __nv_bfloat16* x, int64_t x_stride, const float* w, __nv_bfloat16* y, int64_t y_stride, int64_t rows,
                               int64_t dim, float eps, cudaStream_t s) {
  if (rows <= 0) return;
  rmsnorm_strided_kernel<<<unsigned(rows), kThreads, 0, s>>>(x, x_stride, w, y, y_stride, dim, eps);
  PDB_CUDA_LAUNCHED();
}

void mla_rope_qk(const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* k_pe, int64_t kpe_stride, const float* cs, __nv_bfloat16* q_out,
                 __nv_bfloat16* k_cache, const MlaShape& m, cudaStream_t s) {
  if (m.rows <= 0) return;
  if (m.rope % 2) throw std::invalid_argument("mla_rope_qk: odd rope width");
  if (m.pos0 + m.rows > m.kv_capacity) throw std::invalid_argument("mla_rope_qk: rows past the cache capacity");
  rope_qk_kernel<<<unsigned(m.rows), kThreads, 0, s>>>(q, q_stride, k_pe, kpe_stride, cs, q_out, k_cache, m);
  PDB_CUDA_LAUNCHED();
}

void mla_scatter_kv(const __nv_bfloat16* kvb, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const MlaShape& m, cudaStream_t s) {
  if (m.rows <= 0) return;
  if (m.pos0 + m.rows > m.kv_capacity) throw std::invalid_argument("mla_scatter_kv: rows past the cache capacity");
  scatter_kv_kernel<<<unsigned(m.rows), kThreads, 0, s>>>(kvb, k_cache, v_cache, m);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
