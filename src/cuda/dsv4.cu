#include "cuda/dsv4.cuh"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

using bf16 = __nv_bfloat16;

inline unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// One token's 24 mix floats from its products m (scaled by inv_rms where the products were of the raw streams:
// (fn . x) / rms instead of fn . (x / rms), the same value up to f32 rounding, and no normalized copy of x).
__device__ void hc_coefs(const float* mt, float inv_rms, const float* base, const float* scale, float hc_eps, int iters, float* out) {
  float mv[kDsv4MixFloats];
  for (int i = 0; i < kDsv4MixFloats; ++i) mv[i] = __fmul_rn(mt[i], inv_rms);  // exact for 1
  auto sigmoid = [](float v) { return 1.0f / (1.0f + expf(-v)); };
  float comb[4][4];
  for (int i = 0; i < 4; ++i) {
    out[i] = sigmoid(__fadd_rn(__fmul_rn(mv[i], scale[0]), base[i])) + hc_eps;
    out[4 + i] = 2.0f * sigmoid(__fadd_rn(__fmul_rn(mv[4 + i], scale[1]), base[4 + i]));
  }
  for (int src = 0; src < 4; ++src) {
    float v[4], mx = -INFINITY, sum = 0.0f;
    for (int dst = 0; dst < 4; ++dst) {
      v[dst] = __fadd_rn(__fmul_rn(mv[8 + dst + 4 * src], scale[2]), base[8 + dst + 4 * src]);
      mx = fmaxf(mx, v[dst]);
    }
    for (int dst = 0; dst < 4; ++dst) sum += (v[dst] = expf(v[dst] - mx));
    for (int dst = 0; dst < 4; ++dst) comb[dst][src] = v[dst] / sum + hc_eps;
  }
  auto norm_cols = [&] {
    for (int dst = 0; dst < 4; ++dst) {
      float s = 0.0f;
      for (int src = 0; src < 4; ++src) s += comb[dst][src];
      for (int src = 0; src < 4; ++src) comb[dst][src] /= s + hc_eps;
    }
  };
  auto norm_rows = [&] {
    for (int src = 0; src < 4; ++src) {
      float s = 0.0f;
      for (int dst = 0; dst < 4; ++dst) s += comb[dst][src];
      for (int dst = 0; dst < 4; ++dst) comb[dst][src] /= s + hc_eps;
    }
  };
  norm_cols();
  for (int i = 1; i < iters; ++i) {
    norm_rows();
    norm_cols();
  }
  for (int dst = 0; dst < 4; ++dst)
    for (int src = 0; src < 4; ++src) out[8 + dst * 4 + src] = comb[dst][src];
}

// One thread per token: the serial mix (Sinkhorn) apart from the pass over the streams, which it held up when one
// thread of each row's block did it (1.45 ms per 32K-token mix on the H200, three times the pass's bytes).
__global__ void hc_coefs_kernel(const float* __restrict__ m, int64_t ldm, const float* __restrict__ inv_rms, const float* __restrict__ base,
                                const float* __restrict__ scale, int64_t n, float hc_eps, int iters, float* __restrict__ mix) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  hc_coefs(m + t * ldm, inv_rms ? inv_rms[t] : 1.0f, base, scale, hc_eps, iters, mix + t * kDsv4MixFloats);
}

// y[t] = sum_h pre[h] x_h, h in order (the decoder's adds, no FMA), V floats at a time.
template <int V>
__global__ void hc_pre_sum_kernel(const float* __restrict__ x, const float* __restrict__ mix, int64_t n, int64_t E, float* __restrict__ y) {
  const int64_t per_row = E / V;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < n * per_row; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = k / per_row, i = (k % per_row) * V;
    const float* mt = mix + t * kDsv4MixFloats;
    const float* xt = x + t * 4 * E + i;
    float acc[V];
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
    for (int h = 0; h < 4; ++h) {
      const float p = mt[h];
      float xv[V];
      if constexpr (V == 4) {
        const float4 q = *reinterpret_cast<const float4*>(xt + h * E);
        xv[0] = q.x, xv[1] = q.y, xv[2] = q.z, xv[3] = q.w;
      } else {
        xv[0] = xt[h * E];
      }
      for (int v = 0; v < V; ++v) acc[v] = __fadd_rn(acc[v], __fmul_rn(xv[v], p));
    }
    if constexpr (V == 4) *reinterpret_cast<float4*>(y + t * E + i) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    else y[t * E + i] = acc[0];
  }
}

constexpr int kRowThreads = 256;

// dsv4_hc_pre_sum_norm: a block a row; element i = threadIdx.x + 256 j, so that the row's double sum of squares runs
// in rmsnorm_kernel's order (each thread's elements in turn, then the same tree), and each element's sum in
// hc_pre_sum_kernel's.
constexpr int kNormThreads = 256, kNormPerThread = 16;
__global__ void __launch_bounds__(kNormThreads) hc_pre_sum_norm_kernel(const float* __restrict__ x, const float* __restrict__ mix, int64_t E,
                                                                       const float* __restrict__ w, float eps, float* __restrict__ y,
                                                                       __nv_bfloat16* __restrict__ y_bf16, int8_t* __restrict__ q8,
                                                                       float* __restrict__ q8_scales) {
  const int64_t t = blockIdx.x;
  const float* mt = mix + t * kDsv4MixFloats;
  const float* xt = x + t * 4 * E;
  float p[4];
  for (int h = 0; h < 4; ++h) p[h] = mt[h];
  float v[kNormPerThread];
  double sum = 0.0;
#pragma unroll
  for (int j = 0; j < kNormPerThread; ++j) {
    const int64_t i = threadIdx.x + int64_t(kNormThreads) * j;
    float acc = 0.0f;
    if (i < E) {
      for (int h = 0; h < 4; ++h) acc = __fadd_rn(acc, __fmul_rn(xt[h * E + i], p[h]));
      sum += double(acc * acc);
    }
    v[j] = acc;
  }
  __shared__ double partial[kNormThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int r = kNormThreads / 2; r > 0; r >>= 1) {
    if (threadIdx.x < r) partial[threadIdx.x] += partial[threadIdx.x + r];
    __syncthreads();
  }
  const float mean = float(partial[0] / double(E));
  const float scale = 1.0f / sqrtf(mean + eps);
#pragma unroll
  for (int j = 0; j < kNormPerThread; ++j) {
    const int64_t i = threadIdx.x + int64_t(kNormThreads) * j;
    if (i >= E) continue;  // with q8 (E of 32s) a warp's lanes agree: they hold one Q8_0 block
    const float n = v[j] * scale, out = w ? n * w[i] : n;
    y[t * E + i] = out;
    if (y_bf16) y_bf16[t * E + i] = __float2bfloat16_rn(out);
    if (q8) {  // quantize_q8_kernel's block: its lanes, its scale
      const Q8Lane e = q8_0_lane(out);
      q8[t * E + i] = e.code;
      if (threadIdx.x % 32 == 0) q8_scales[(t * E + i) / 32] = __half2float(__float2half_rn(e.scale));
    }
  }
}

// The block's double sum of its threads' partial sums (rmsnorm_kernel's accumulation: float squares in double).
__device__ double block_sum(double v) {
  __shared__ double part[kRowThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < kRowThreads / 32; ++w) s += part[w];
  __syncthreads();
  return s;
}

__device__ float inv_rms_of(double sum, int64_t width, float eps) {
  const float mean = float(sum / double(width));
  return 1.0f / sqrtf(mean + eps);
}

__global__ void __launch_bounds__(kRowThreads) row_inv_rms_kernel(const float* __restrict__ x, int64_t width, float eps, float* __restrict__ inv) {
  const float* xr = x + int64_t(blockIdx.x) * width;
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < width; i += kRowThreads) sum += double(xr[i] * xr[i]);
  sum = block_sum(sum);
  if (threadIdx.x == 0) inv[blockIdx.x] = inv_rms_of(sum, width, eps);
}

// One block per token: x_next and, where asked, its 4E-wide inv-rms for the next pre-mix (the pass that the
// normalized copy of x took before).
template <int V>
__global__ void __launch_bounds__(kRowThreads) hc_post_kernel(const float* __restrict__ f, const float* __restrict__ mix, const float* __restrict__ x,
                                                              int64_t E, float* __restrict__ x_next, float* __restrict__ inv_next, float eps,
                                                              const __grid_constant__ Dsv4Combine cmb) {
  const int64_t t = blockIdx.x;
  const float* mt = mix + t * kDsv4MixFloats;
  __shared__ float cf[kDsv4MixFloats];
  if (threadIdx.x < kDsv4MixFloats) cf[threadIdx.x] = mt[threadIdx.x];
  __syncthreads();
  const float* xt = x + t * 4 * E;
  float* out = x_next + t * 4 * E;
  double sum = 0.0;
  for (int64_t i = int64_t(threadIdx.x) * V; i < E; i += int64_t(kRowThreads) * V) {
    float fv[V], xs[4][V];
    if constexpr (V == 4) {
      const float4 q = *reinterpret_cast<const float4*>(f + t * E + i);
      fv[0] = q.x, fv[1] = q.y, fv[2] = q.z, fv[3] = q.w;
      for (int src = 0; src < 4; ++src) {
        const float4 r = *reinterpret_cast<const float4*>(xt + src * E + i);
        xs[src][0] = r.x, xs[src][1] = r.y, xs[src][2] = r.z, xs[src][3] = r.w;
      }
    } else {
      fv[0] = f[t * E + i];
      for (int src = 0; src < 4; ++src) xs[src][0] = xt[src * E + i];
    }
    if (cmb.y) {  // moe_combine's sum per element, in its order and form, then its one addition
      float acc[V];
      for (int v = 0; v < V; ++v) acc[v] = 0.0f;
      for (int j = 0; j < cmb.n_used; ++j) {
        const float w = cmb.weights[t * cmb.n_used + j];
        const __nv_bfloat16* yr = cmb.y + int64_t(cmb.slot_of[t * cmb.n_used + j]) * E + i;
        for (int v = 0; v < V; ++v) acc[v] += w * __bfloat162float(yr[v]);
      }
      for (int v = 0; v < V; ++v) fv[v] += acc[v];
    }
    for (int dst = 0; dst < 4; ++dst) {
      float o[V];
      for (int v = 0; v < V; ++v) {
        float s = __fmul_rn(fv[v], cf[4 + dst]);
        for (int src = 0; src < 4; ++src) s = __fadd_rn(s, __fmul_rn(xs[src][v], cf[8 + dst * 4 + src]));
        o[v] = s;
        sum += double(s * s);
      }
      if constexpr (V == 4) *reinterpret_cast<float4*>(out + dst * E + i) = make_float4(o[0], o[1], o[2], o[3]);
      else out[dst * E + i] = o[0];
    }
  }
  if (inv_next) {  // uniform across the block
    sum = block_sum(sum);
    if (threadIdx.x == 0) inv_next[t] = inv_rms_of(sum, 4 * E, eps);
  }
}

__global__ void embed_streams_kernel(const float* __restrict__ table, const int32_t* __restrict__ tokens, int64_t n, int64_t E, float* __restrict__ x) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n * E) return;
  const int64_t t = k / E, i = k % E;
  const float v = table[int64_t(tokens[t]) * E + i];
  for (int h = 0; h < 4; ++h) x[t * 4 * E + h * E + i] = v;
}

// One block per group, the group in shared memory.

__global__ void add_ape_kernel(float* __restrict__ g, const float* __restrict__ ape, int64_t n, int64_t cw, int64_t pos0, int ratio) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n * cw) return;
  const int64_t t = k / cw, j = k % cw;
  g[k] = __fadd_rn(g[k], ape[((pos0 + t) % ratio) * cw + j]);
}

__global__ void pool_kernel(const float* __restrict__ a, const float* __restrict__ g, int64_t h0, int64_t b0, int ratio, int64_t width,
                            float* __restrict__ out) {
  const int64_t b = b0 + blockIdx.x;
  const int64_t d = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (d >= width) return;
  const int64_t cw = ratio == 4 ? 2 * width : width;
  const int ne = ratio == 4 ? 8 : 128;
  auto entry = [&](int j, float& v, float& sc) {
    if (ratio == 128) {
      const int64_t r = 128 * b + j - h0;
      v = a[r * cw + d];
      sc = g[r * cw + d];
    } else if (j < 4) {
      const int64_t tp = 4 * b - 4 + j;
      if (tp < 0) { v = 0.0f; sc = -INFINITY; return; }
      v = a[(tp - h0) * cw + d];
      sc = g[(tp - h0) * cw + d];
    } else {
      const int64_t r = 4 * b + (j - 4) - h0;
      v = a[r * cw + width + d];
      sc = g[r * cw + width + d];
    }
  };
  float mx = -INFINITY, v, sc;
  for (int j = 0; j < ne; ++j) { entry(j, v, sc); mx = fmaxf(mx, sc); }
  float sum = 0.0f, acc = 0.0f;
  for (int j = 0; j < ne; ++j) { entry(j, v, sc); sum += expf(sc - mx); }
  for (int j = 0; j < ne; ++j) { entry(j, v, sc); acc = __fadd_rn(acc, __fmul_rn(v, expf(sc - mx) / sum)); }
  out[int64_t(blockIdx.x) * width + d] = acc;
}



__global__ void route_kernel(const float* __restrict__ logits, const float* __restrict__ bias, const int32_t* __restrict__ tid2eid,
                             const int32_t* __restrict__ tokens, int64_t n, int NE, int k, float scale, int32_t* __restrict__ experts,
                             float* __restrict__ weights) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const float* lt = logits + t * NE;
  auto prob = [&](int e) {
    const float v = lt[e];
    return sqrtf(v > 20.0f ? v : log1pf(expf(v)));
  };
  int sel[16];
  if (tid2eid) {
    for (int j = 0; j < k; ++j) sel[j] = tid2eid[int64_t(tokens[t]) * k + j];
  } else {
    // k passes of an arg-max over the biased scores (ties: the lower index)
    uint32_t taken[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < k; ++j) {
      int best = -1;
      float bv = -INFINITY;
      for (int e = 0; e < NE; ++e) {
        if (taken[e >> 5] & (1u << (e & 31))) continue;
        const float v = prob(e) + bias[e];
        if (best < 0 || v > bv) { best = e; bv = v; }
      }
      sel[j] = best;
      taken[best >> 5] |= 1u << (best & 31);
    }
  }
  float wsum = 0.0f;
  for (int j = 0; j < k; ++j) wsum += prob(sel[j]);
  for (int j = 0; j < k; ++j) {
    float w = prob(sel[j]) / fmaxf(wsum, 6.103515625e-5f);
    if (scale != 0.0f && scale != 1.0f) w *= scale;
    experts[t * k + j] = sel[j];
    weights[t * k + j] = w;
  }
}

__global__ void swiglu_clamp_kernel(const bf16* __restrict__ gu, bf16* __restrict__ out, int64_t rows, int64_t ff, float L) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= rows * ff) return;
  const int64_t r = k / ff, i = k % ff;
  out[k] = __float2bfloat16_rn(swiglu_clamp(__bfloat162float(gu[r * 2 * ff + i]), __bfloat162float(gu[r * 2 * ff + ff + i]), L));
}

// Four threads per block, each writing 8 consecutive outputs as one 16-byte store (a warp's stores are one
// contiguous 512-byte run): outputs 0-7 / 8-15 are the low nibbles of codes 0-7 / 8-15, 16-23 / 24-31 the high ones.
__global__ void mxfp4_kernel(const uint8_t* __restrict__ blocks, int64_t n_blocks, bf16* __restrict__ out, int64_t per_group, int64_t group_stride) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n_blocks * 4) return;
  const int64_t b = k >> 2;
  const int part = int(k & 3);
  const uint8_t* blk = blocks + b * 17;
  const float d = ldexpf(1.0f, int(blk[0]) - 128);  // ggml's E8M0 "half" scale: the e2m1 values are stored doubled
  // e2m1 (doubled, as ggml's kvalues_mxfp4): magnitude m -> 0, 1, 2, 3, 4, 6, 8, 12; a table indexed at run time
  // would live in local memory
  auto e2m1 = [](uint32_t c) {
    const uint32_t m = c & 7, e = m >> 1;
    const float v = float(e == 0 ? m : (2 + (m & 1)) << (e - 1));
    return (c & 8) ? -v : v;
  };
  const uint8_t* q = blk + 1 + (part & 1) * 8;
  const int shift = (part >> 1) * 4;
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(e2m1(q[2 * j] >> shift) * d, e2m1(q[2 * j + 1] >> shift) * d);
    w[j] = *reinterpret_cast<const uint32_t*>(&v);
  }
  const int64_t o = per_group ? (b / per_group) * group_stride + (b % per_group) * 32 : b * 32;
  *reinterpret_cast<uint4*>(out + o + part * 8) = make_uint4(w[0], w[1], w[2], w[3]);
}

// One CTA per 128 x 128 tile, thread (r, j) = one row's j-th 32-block of the tile: the tile's largest exponent
// first (a CTA-wide max), then 32 codes as two 16-byte stores.
__global__ void __launch_bounds__(512) mxfp4_fp8_tiles_kernel(Mxfp4ToFp8 a) {
  const int r = threadIdx.x / 4, j = threadIdx.x % 4;
  const int64_t kb = blockIdx.x, nb = blockIdx.y, x = blockIdx.z;
  const int64_t row = nb * 128 + r;
  const uint8_t* blk = a.blocks + ((x * a.rows + row) * (a.cols / 32) + kb * 4 + j) * 17;
  const int e = blk[0];
  __shared__ int warp_max[16];
  const int wmax = __reduce_max_sync(0xffffffffu, unsigned(e));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = wmax;
  __syncthreads();
  int emax = 0;
#pragma unroll
  for (int w = 0; w < 16; ++w) emax = max(emax, warp_max[w]);
  const int shift = e - emax;  // <= 0
  uint32_t words[8];
  unsigned lost = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const uint32_t c = i < 16 ? (blk[1 + i] & 15u) : (blk[1 + i - 16] >> 4);
    const uint32_t m = c & 7, ex = m >> 1;
    const float mag = float(ex == 0 ? m : (2 + (m & 1)) << (ex - 1));
    const float v = ldexpf((c & 8) ? -mag : mag, shift);
    const __nv_fp8_storage_t code = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
    const __half_raw back = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
    lost += __half2float(__half(back)) != v;
    if (i % 4 == 0) words[i / 4] = 0;
    words[i / 4] |= uint32_t(code) << (8 * (i % 4));
  }
  if (lost) atomicAdd(a.inexact, lost);
  uint4* out = reinterpret_cast<uint4*>(a.codes + x * a.code_stride + (a.row0 + row) * a.cols + kb * 128 + j * 32);
  out[0] = make_uint4(words[0], words[1], words[2], words[3]);
  out[1] = make_uint4(words[4], words[5], words[6], words[7]);
  if (threadIdx.x == 0) {
    const int64_t n = a.row0 / 128 + nb;
    a.scales[x * a.scale_stride + (a.kb_fastest ? n * a.ld + kb : kb * a.ld + n)] = ldexpf(1.0f, emax - 128);
  }
}

__global__ void gather_keys_kernel(Dsv4KeyGather g, bf16* __restrict__ kg, uint8_t* __restrict__ valid) {
  const int slot = blockIdx.x;
  const int64_t q = blockIdx.y;
  const int64_t t = g.t0 + q;
  const bf16* src = nullptr;
  if (slot < g.W) {
    const int64_t p = t - g.W + 1 + slot;
    if (p >= 0) src = g.win + (p - g.win_first) * g.D;
  } else {
    const int i = slot - g.W;
    if (g.ratio == 128) {
      if (i < (t + 1) / 128) src = g.pool + int64_t(i) * g.D;
    } else if (g.ratio == 4 && i < g.top_k) {
      const int32_t b = g.idx[q * g.top_k + i];
      if (b >= 0) src = g.pool + int64_t(b) * g.D;
    }
  }
  uint4* dst = reinterpret_cast<uint4*>(kg + (q * g.NK + slot) * g.D);
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  for (int j = threadIdx.x; j < g.D / 8; j += blockDim.x) dst[j] = src ? s4[j] : make_uint4(0, 0, 0, 0);
  if (threadIdx.x == 0) valid[q * g.NK + slot] = src != nullptr;
}

__global__ void sink_softmax_kernel(const float* __restrict__ sc, const uint8_t* __restrict__ valid, const float* __restrict__ sinks, int H, int NK,
                                    float scale, bf16* __restrict__ p) {
  const int64_t row = blockIdx.x;  // q * H + h
  const int64_t q = row / H;
  const int h = int(row % H);
  const float* s = sc + row * NK;
  const uint8_t* v = valid + q * NK;
  __shared__ float red[32];
  auto block_reduce = [&](float x, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
      const float y = __shfl_xor_sync(0xffffffffu, x, o);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) red[w] = x;
    __syncthreads();
    const int nw = (blockDim.x + 31) / 32;
    x = lane < nw ? red[lane] : (is_max ? -INFINITY : 0.0f);
    for (int o = 16; o > 0; o >>= 1) {
      const float y = __shfl_xor_sync(0xffffffffu, x, o);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    __syncthreads();
    return x;
  };
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < NK; j += blockDim.x)
    if (v[j]) mx = fmaxf(mx, s[j] * scale);
  mx = fmaxf(block_reduce(mx, true), sinks[h]);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < NK; j += blockDim.x)
    if (v[j]) sum += expf(s[j] * scale - mx);
  const float den = block_reduce(sum, false) + expf(sinks[h] - mx);
  for (int j = threadIdx.x; j < NK; j += blockDim.x) p[row * NK + j] = __float2bfloat16_rn(v[j] ? expf(s[j] * scale - mx) / den : 0.0f);
}


// one warp per head row; lane l holds the pairs l, l + 32, ... (coalesced float2 loads)
__device__ __forceinline__ float2 load_pair(const float* q, int p) { return reinterpret_cast<const float2*>(q)[p]; }
__device__ __forceinline__ float2 load_pair(const bf16* q, int p) { return __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(q)[p]); }

template <class T>
__global__ void head_norm_rope_kernel(const T* __restrict__ q, const float* __restrict__ cs, int64_t rows, int heads, int D, int r, float eps,
                                      bf16* __restrict__ out) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const T* x = q + row * D;
  double sum = 0.0;  // as rmsnorm_kernel: float squares added in double
  for (int p = lane; p < D / 2; p += 32) {
    const float2 v = load_pair(x, p);
    sum += double(v.x * v.x);
    sum += double(v.y * v.y);
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float mean = float(sum / double(D));
  const float scale = 1.0f / sqrtf(mean + eps);
  const float* c = cs + (row / heads) * r;
  __nv_bfloat162* y = reinterpret_cast<__nv_bfloat162*>(out + row * D);
  for (int p = lane; p < D / 2; p += 32) {
    const float2 v = load_pair(x, p);
    float a0 = v.x * scale, a1 = v.y * scale;
    const int i0 = 2 * p - (D - r);
    if (i0 >= 0) {
      const float cv = c[i0], sv = c[i0 + 1], x0 = a0, x1 = a1;
      a0 = __fsub_rn(__fmul_rn(x0, cv), __fmul_rn(x1, sv));
      a1 = __fadd_rn(__fmul_rn(x0, sv), __fmul_rn(x1, cv));
    }
    y[p] = __floats2bfloat162_rn(a0, a1);
  }
}

__global__ void derope_kernel(bf16* __restrict__ o, const float* __restrict__ cs, int64_t n, int H, int D, int r) {
  const int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int pairs = r / 2;
  if (k >= n * H * pairs) return;
  const int64_t t = k / (int64_t(H) * pairs);
  const int h = int((k / pairs) % H), i0 = int(k % pairs) * 2;
  bf16* a = o + (t * H + h) * D + (D - r) + i0;
  const float c = cs[t * r + i0], s = cs[t * r + i0 + 1];
  const float x0 = __bfloat162float(a[0]), x1 = __bfloat162float(a[1]);
  a[0] = __float2bfloat16_rn(x0 * c + x1 * s);
  a[1] = __float2bfloat16_rn(-x0 * s + x1 * c);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float uniform_pm(uint64_t seed, int64_t i) {  // [-1, 1)
  return float(mix64(seed * 0x100000001b3ull + uint64_t(i)) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void rand_bf16_kernel(bf16* p, int64_t n, uint64_t seed, float a) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(a * uniform_pm(seed, i));
}
__global__ void rand_f32_kernel(float* p, int64_t n, uint64_t seed, float a, float mean) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) p[i] = mean + a * uniform_pm(seed, i);
}
__global__ void rand_mxfp4_kernel(uint8_t* blocks, int64_t n_blocks, uint64_t seed, uint8_t e) {
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < n_blocks; b += int64_t(gridDim.x) * blockDim.x) {
    uint8_t* blk = blocks + b * 17;
    blk[0] = e;
    const uint64_t r0 = mix64(seed ^ uint64_t(2 * b)), r1 = mix64(seed ^ uint64_t(2 * b + 1));
    for (int j = 0; j < 8; ++j) { blk[1 + j] = uint8_t(r0 >> (8 * j)); blk[9 + j] = uint8_t(r1 >> (8 * j)); }
  }
}
__global__ void rand_q8_kernel(int8_t* q, float* d, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    q[i] = int8_t(int(127.0f * uniform_pm(seed, i)));
    if (i % 32 == 0) d[i / 32] = scale;
  }
}

constexpr int kT = 256;
inline unsigned grid_stride_blocks(int64_t n) { return unsigned(std::min<int64_t>(blocks_for(n, kT), 65536)); }

}  // namespace

void dsv4_hc_coefs(const float* m, int64_t ldm, const float* inv_rms, const float* base, const float* scale, int64_t n, float hc_eps, int iters,
                    float* mix, cudaStream_t s) {
  if (n <= 0) return;
  hc_coefs_kernel<<<blocks_for(n, 128), 128, 0, s>>>(m, ldm, inv_rms, base, scale, n, hc_eps, iters, mix);
  PDB_CUDA_LAUNCHED();
}

void dsv4_hc_pre_sum(const float* x, const float* mix, int64_t n, int64_t E, float* y, cudaStream_t s) {
  if (n <= 0) return;
  const bool vec = E % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0;
  if (vec) hc_pre_sum_kernel<4><<<grid_stride_blocks(n * E / 4), kT, 0, s>>>(x, mix, n, E, y);
  else hc_pre_sum_kernel<1><<<grid_stride_blocks(n * E), kT, 0, s>>>(x, mix, n, E, y);
  PDB_CUDA_LAUNCHED();
}

bool dsv4_hc_pre_sum_norm_supported(int64_t E) { return E > 0 && E <= int64_t(kNormThreads) * kNormPerThread; }

void dsv4_hc_pre_sum_norm(const float* x, const float* mix, int64_t n, int64_t E, const float* w, float eps, float* y, __nv_bfloat16* y_bf16,
                          cudaStream_t s, int8_t* q8, float* q8_scales) {
  if (n <= 0) return;
  if (!dsv4_hc_pre_sum_norm_supported(E)) throw std::invalid_argument("dsv4_hc_pre_sum_norm: rows of at most 4,096, not " + std::to_string(E));
  if (q8 && (E % 32 || !q8_scales)) throw std::invalid_argument("dsv4_hc_pre_sum_norm: Q8_0 blocks of rows of " + std::to_string(E));
  hc_pre_sum_norm_kernel<<<unsigned(n), kNormThreads, 0, s>>>(x, mix, E, w, eps, y, y_bf16, q8, q8_scales);
  PDB_CUDA_LAUNCHED();
}

void dsv4_hc_mix(const float* m, const float* x, const float* base, const float* scale, int64_t n, int64_t E, float hc_eps, int iters, float* mix,
                 float* y, cudaStream_t s) {
  dsv4_hc_coefs(m, kDsv4MixFloats, nullptr, base, scale, n, hc_eps, iters, mix, s);
  dsv4_hc_pre_sum(x, mix, n, E, y, s);
}

void dsv4_row_inv_rms(const float* x, int64_t n, int64_t width, float eps, float* inv, cudaStream_t s) {
  if (n <= 0) return;
  row_inv_rms_kernel<<<unsigned(n), kRowThreads, 0, s>>>(x, width, eps, inv);
  PDB_CUDA_LAUNCHED();
}

void dsv4_hc_post(const float* f, const float* mix, const float* x, int64_t n, int64_t E, float* x_next, cudaStream_t s, float* inv_next, float eps,
                  const Dsv4Combine& combine) {
  if (n <= 0) return;
  const bool vec = E % 4 == 0 && reinterpret_cast<uintptr_t>(f) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(x_next) % 16 == 0;
  if (vec) hc_post_kernel<4><<<unsigned(n), kRowThreads, 0, s>>>(f, mix, x, E, x_next, inv_next, eps, combine);
  else hc_post_kernel<1><<<unsigned(n), kRowThreads, 0, s>>>(f, mix, x, E, x_next, inv_next, eps, combine);
  PDB_CUDA_LAUNCHED();
}

void dsv4_embed_streams(const float* table, const int32_t* tokens, int64_t n, int64_t E, float* x, cudaStream_t s) {
  if (n <= 0) return;
  embed_streams_kernel<<<blocks_for(n * E, kT), kT, 0, s>>>(table, tokens, n, E, x);
  PDB_CUDA_LAUNCHED();
}


void dsv4_add_ape(float* g, const float* ape, int64_t n, int64_t cw, int64_t pos0, int ratio, cudaStream_t s) {
  if (n <= 0) return;
  add_ape_kernel<<<blocks_for(n * cw, kT), kT, 0, s>>>(g, ape, n, cw, pos0, ratio);
  PDB_CUDA_LAUNCHED();
}

void dsv4_pool(const float* a, const float* g, int64_t h0, int64_t b0, int64_t nb, int ratio, int64_t width, float* out, cudaStream_t s) {
  if (nb <= 0) return;
  if (ratio != 4 && ratio != 128) throw std::invalid_argument("dsv4_pool: ratio 4 or 128");
  pool_kernel<<<dim3(unsigned(nb), blocks_for(width, 128)), 128, 0, s>>>(a, g, h0, b0, ratio, width, out);
  PDB_CUDA_LAUNCHED();
}




void dsv4_route(const float* logits, const float* bias, const int32_t* tid2eid, const int32_t* tokens, int64_t n, int n_expert, int k, float scale,
                int32_t* experts, float* weights, cudaStream_t s) {
  if (n <= 0) return;
  if (n_expert > 256 || k > 16 || k > n_expert) throw std::invalid_argument("dsv4_route: at most 16 of 256 experts");
  route_kernel<<<blocks_for(n, 128), 128, 0, s>>>(logits, bias, tid2eid, tokens, n, n_expert, k, scale, experts, weights);
  PDB_CUDA_LAUNCHED();
}

void swiglu_clamp_rows(const bf16* gu, bf16* out, int64_t rows, int64_t ff, float limit, cudaStream_t s) {
  if (rows <= 0) return;
  swiglu_clamp_kernel<<<blocks_for(rows * ff, kT), kT, 0, s>>>(gu, out, rows, ff, limit);
  PDB_CUDA_LAUNCHED();
}

void mxfp4_to_bf16(const uint8_t* blocks, int64_t n_blocks, bf16* out, cudaStream_t s, int64_t blocks_per_group, int64_t group_stride) {
  if (n_blocks <= 0) return;
  mxfp4_kernel<<<blocks_for(n_blocks * 4, kT), kT, 0, s>>>(blocks, n_blocks, out, blocks_per_group, group_stride);
  PDB_CUDA_LAUNCHED();
}

void mxfp4_to_fp8_tiles(const Mxfp4ToFp8& a, cudaStream_t s) {
  if (a.experts <= 0) return;
  if (a.rows % 128 || a.cols % 128 || a.row0 % 128) throw std::invalid_argument("mxfp4_to_fp8_tiles: rows, cols and row0 multiples of 128");
  mxfp4_fp8_tiles_kernel<<<dim3(unsigned(a.cols / 128), unsigned(a.rows / 128), unsigned(a.experts)), 512, 0, s>>>(a);
  PDB_CUDA_LAUNCHED();
}

void dsv4_gather_keys(const Dsv4KeyGather& g, bf16* kg, uint8_t* valid, cudaStream_t s) {
  if (g.nq <= 0) return;
  if (g.D % 8) throw std::invalid_argument("dsv4_gather_keys: D must be a multiple of 8");
  gather_keys_kernel<<<dim3(unsigned(g.NK), unsigned(g.nq)), 64, 0, s>>>(g, kg, valid);
  PDB_CUDA_LAUNCHED();
}

void dsv4_sink_softmax(const float* sc, const uint8_t* valid, const float* sinks, int64_t nq, int H, int NK, float scale, bf16* p, cudaStream_t st) {
  if (nq <= 0) return;
  sink_softmax_kernel<<<unsigned(nq * H), 128, 0, st>>>(sc, valid, sinks, H, NK, scale, p);
  PDB_CUDA_LAUNCHED();
}

template <class T>
void head_norm_rope(const T* q, const float* cs, int64_t n, int heads, int D, int r, float eps, bf16* out, cudaStream_t s) {
  if (n <= 0) return;
  if (D % 64 || r % 2 || r > D) throw std::invalid_argument("dsv4_head_norm_rope_bf16: D a multiple of 64, r even and <= D");
  const int64_t rows = n * heads;
  head_norm_rope_kernel<T><<<unsigned((rows + 7) / 8), 256, 0, s>>>(q, cs, rows, heads, D, r, eps, out);
  PDB_CUDA_LAUNCHED();
}

void dsv4_head_norm_rope_bf16(const float* q, const float* cs, int64_t n, int heads, int D, int r, float eps, bf16* out, cudaStream_t s) {
  head_norm_rope(q, cs, n, heads, D, r, eps, out, s);
}

void dsv4_head_norm_rope_bf16(const bf16* q, const float* cs, int64_t n, int heads, int D, int r, float eps, bf16* out, cudaStream_t s) {
  head_norm_rope(q, cs, n, heads, D, r, eps, out, s);
}

void dsv4_derope(bf16* o, const float* cs, int64_t n, int H, int D, int r, cudaStream_t s) {
  if (n <= 0) return;
  derope_kernel<<<blocks_for(n * H * (r / 2), kT), kT, 0, s>>>(o, cs, n, H, D, r);
  PDB_CUDA_LAUNCHED();
}

void fill_random_bf16(bf16* p, int64_t n, uint64_t seed, float sd, cudaStream_t s) {
  rand_bf16_kernel<<<grid_stride_blocks(n), kT, 0, s>>>(p, n, seed, sd * 1.7320508f);
  PDB_CUDA_LAUNCHED();
}
void fill_random_f32(float* p, int64_t n, uint64_t seed, float sd, float mean, cudaStream_t s) {
  rand_f32_kernel<<<grid_stride_blocks(n), kT, 0, s>>>(p, n, seed, sd * 1.7320508f, mean);
  PDB_CUDA_LAUNCHED();
}
void fill_random_mxfp4(uint8_t* blocks, int64_t n_blocks, uint64_t seed, uint8_t e8m0, cudaStream_t s) {
  rand_mxfp4_kernel<<<grid_stride_blocks(n_blocks), kT, 0, s>>>(blocks, n_blocks, seed, e8m0);
  PDB_CUDA_LAUNCHED();
}
void fill_random_q8(int8_t* q, float* d, int64_t n, uint64_t seed, float scale, cudaStream_t s) {
  rand_q8_kernel<<<grid_stride_blocks(n), kT, 0, s>>>(q, d, n, seed, scale);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
