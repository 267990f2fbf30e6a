// The 3xTF32 products of f32_tensor.cuh on mma.sync m16n8k8. A warp: 32 rows x WN outputs (2 x WN/8 fragments of
// 16 x 8); a CTA: kWarpsM x kWarpsN warps. k in steps of 32 through cp.async stages of x's and w's rows, each row
// padded to 40 floats. Within a step of 8 a thread's fragment columns q and q + 4 are taken as inputs 2q and 2q + 1
// (the sum over k does not care which input is which column, so long as x and w agree): one 8-byte shared load gives
// both, and the 16 threads of a load phase (g 0..3, q 0..3) fall on banks 8g + 2q: every load one wavefront.
// Each step of 32 inputs is summed by the tensor cores into accumulators of its own, then added to the running sums
// by f32 additions: the tensor cores' accumulation rounds toward zero (Fasi et al., "Numerical behavior of NVIDIA
// tensor cores", 2021), a bias that over 16,384 inputs would grow far past an f32 sum's rounding; within a step
// it stays at a few roundings of that step's partial sum.
#include "cuda/f32_tensor.cuh"

#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/device_helpers.cuh"
#include "cuda/f32_narrow.cuh"

namespace pdb::cuda {
namespace {

// A tile's shape and schedule: kStages stages of kBK inputs (rows padded to kBK + 8 floats); kPromote: each stage
// summed in accumulators of its own, then added to the running sums (below; off only in the twin test's variant).
template <int WN, int kWarpsM, int kWarpsN, int kStages_, bool kPromote_ = true>
struct Tile {
  static constexpr int kBK = 32, kPitch = kBK + 8;
  static constexpr bool kPromote = kPromote_;
  static constexpr int kWN = WN, kNT = WN / 8, kBM = 32 * kWarpsM, kBN = WN * kWarpsN, kThreads = 32 * kWarpsM * kWarpsN, kStages = kStages_;
  static constexpr int kStageFloats = (kBM + kBN) * kPitch;
  static constexpr int kSmem = kStages * kStageFloats * 4;
};
constexpr int kMinK = 32;
// the mixes: 128 rows x all their outputs (x read once; two CTAs per SM); the router and other widths: 128 x 128,
// one CTA of 8 warps per SM. (Measured and not kept, session 42: w split once a stage by the CTA, stages of 64
// inputs, 128 x 64 tiles for the wide widths.)
using Tile24 = Tile<24, 4, 1, 4>;
using Tile48 = Tile<48, 4, 1, 4>;
using TileWide = Tile<64, 4, 2, 4>;

struct Tf32Pair {
  uint32_t hi, lo;
};
// v = hi + lo + (a rest of at most 2^-21 v): hi is v rounded to TF32 (10 fraction bits), ties away from zero
// (cvt.rna.tf32.f32's value for finite v short of the top binade) in two integer instructions, where sm_90 runs the
// cvt as a sequence of ~7 (Nsight Compute put half the kernel's instructions there, session 42); lo = v - hi is exact
// in f32 and goes to the tensor cores as it is (they read its top 19 bits: a truncation, as likely up as down).
__device__ __forceinline__ Tf32Pair split_tf32(float v) {
  const uint32_t hi = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
  return {hi, __float_as_uint(v - __uint_as_float(hi))};
}

// D(16x8, f32) += A(16x8, tf32, row) * B(8x8, tf32, col)
__device__ __forceinline__ void mma_tf32(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A thread's share of a stage's copies: chunk c of rows r0 + RP u (RP rows a pass), x's rows first, then w's; the
// sources worked out once, a stage's copy one addition each (the copies' address arithmetic was a quarter of the
// kernel's instructions). Rows past x's or w's last: zeros.
template <class T>
struct StageCopies {
  static constexpr int kChunks = T::kBK / 4, RP = T::kThreads / kChunks, kXPasses = T::kBM / RP, kWPasses = (T::kBN + RP - 1) / RP;
  static_assert(T::kBM % RP == 0, "x's rows end on a pass");
  const float *xs, *ws;
  int64_t step;  // RP rows
  uint32_t dst;  // the first row's chunk in a stage (bytes)
  int r0, x_valid, w_valid;
  __device__ StageCopies(const float* x, const float* w, int64_t rows, int64_t n, int64_t k, int64_t m0, int64_t n0) {
    r0 = threadIdx.x / kChunks;
    const int c = threadIdx.x % kChunks;
    step = RP * k;
    dst = uint32_t((r0 * T::kPitch + 4 * c) * 4);
    x_valid = m0 + r0 < rows ? int((rows - m0 - r0 + RP - 1) / RP) : 0;
    w_valid = n0 + r0 < n ? int((n - n0 - r0 + RP - 1) / RP) : 0;
    xs = x_valid ? x + (m0 + r0) * k + 4 * c : x;
    ws = w_valid ? w + (n0 + r0) * k + 4 * c : w;
  }
  // one k-step's copies into a stage (its shared address); one cp.async group
  __device__ __forceinline__ void load(uint32_t stage, int64_t k0) const {
    const float* p = xs + k0;
#pragma unroll
    for (int u = 0; u < kXPasses; ++u, p += step) cp_async16(stage + dst + uint32_t(u * RP * T::kPitch * 4), u < x_valid ? p : xs, u < x_valid);
    p = ws + k0;
#pragma unroll
    for (int u = 0; u < kWPasses; ++u, p += step)
      if (T::kBN % RP == 0 || r0 + u * RP < T::kBN)
        cp_async16(stage + dst + uint32_t((T::kBM + u * RP) * T::kPitch * 4), u < w_valid ? p : ws, u < w_valid);
    cp_async_commit();
  }
};

// One step of 8 inputs for a warp: x's fragments (rows g, g + 8 of each 16) and w's (output g of each 8), split, then
// lo.hi, hi.lo and hi.hi into each accumulator, each pass over all of them (the three products of one accumulator
// depend on each other: a pass keeps 2 kNT independent products between them).
template <class T>
__device__ __forceinline__ void step8(const float* A, const float* B, float (&acc)[2][T::kNT][4]) {
  constexpr int P = T::kPitch;
  Tf32Pair a[2][4], b[T::kNT][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const float2 u = *reinterpret_cast<const float2*>(A + mt * 16 * P), v = *reinterpret_cast<const float2*>(A + (mt * 16 + 8) * P);
    a[mt][0] = split_tf32(u.x);
    a[mt][1] = split_tf32(v.x);
    a[mt][2] = split_tf32(u.y);
    a[mt][3] = split_tf32(v.y);
  }
#pragma unroll
  for (int nt = 0; nt < T::kNT; ++nt) {
    const float2 bw = *reinterpret_cast<const float2*>(B + nt * 8 * P);
    b[nt][0] = split_tf32(bw.x);
    b[nt][1] = split_tf32(bw.y);
  }
#pragma unroll
  for (int pass = 0; pass < 3; ++pass)
#pragma unroll
    for (int nt = 0; nt < T::kNT; ++nt)
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const Tf32Pair(&f)[4] = a[mt];
        const Tf32Pair(&e)[2] = b[nt];
        if (pass == 0) mma_tf32(acc[mt][nt], f[0].lo, f[1].lo, f[2].lo, f[3].lo, e[0].hi, e[1].hi);
        else if (pass == 1) mma_tf32(acc[mt][nt], f[0].hi, f[1].hi, f[2].hi, f[3].hi, e[0].lo, e[1].lo);
        else mma_tf32(acc[mt][nt], f[0].hi, f[1].hi, f[2].hi, f[3].hi, e[0].hi, e[1].hi);
      }
}

template <class T>
__device__ __forceinline__ void zero(float (&acc)[2][T::kNT][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < T::kNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) f32_tensor_kernel(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                                                int64_t rows, int64_t k, int64_t n) {
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int wm = warp % (T::kBM / 32), wn = warp / (T::kBM / 32);
  const int64_t m0 = int64_t(blockIdx.x) * T::kBM, n0 = int64_t(blockIdx.y) * T::kBN;
  // split blockIdx.z of gridDim.z: its share of k's steps, its partial sums to y + z rows n
  const int nk = int(k / T::kBK) / int(gridDim.z);
  x += int64_t(blockIdx.z) * nk * T::kBK;
  w += int64_t(blockIdx.z) * nk * T::kBK;
  y += int64_t(blockIdx.z) * rows * n;
  constexpr int P = T::kPitch;
  auto stage = [&](int j) { return sm + (j % T::kStages) * T::kStageFloats; };
  float acc[2][T::kNT][4];
  zero<T>(acc);
  const StageCopies<T> copies(x, w, rows, n, k, m0, n0);
  auto stage_at = [&](int j) { return uint32_t(__cvta_generic_to_shared(stage(j))); };
  for (int j = 0; j < T::kStages - 1; ++j) {
    if (j < nk) copies.load(stage_at(j), int64_t(j) * T::kBK);
    else cp_async_commit();
  }
  const int a_off = (wm * 32 + g) * P + 2 * q, b_off = (T::kBM + wn * T::kWN + g) * P + 2 * q;
  for (int j = 0; j < nk; ++j) {
    cp_async_wait<T::kStages - 2>();  // this thread's copies of step j (one group per step, empty past the last)
    __syncthreads();                  // everyone's; and step j - 1's stage read by all
    const int jn = j + T::kStages - 1;
    if (jn < nk) copies.load(stage_at(jn), int64_t(jn) * T::kBK);
    else cp_async_commit();
    const float* st = stage(j);
    if constexpr (T::kPromote) {
      float part[2][T::kNT][4];
      zero<T>(part);
#pragma unroll
      for (int kk = 0; kk < T::kBK / 8; ++kk) step8<T>(st + a_off + kk * 8, st + b_off + kk * 8, part);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < T::kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] += part[mt][nt][e];
    } else {
#pragma unroll
      for (int kk = 0; kk < T::kBK / 8; ++kk) step8<T>(st + a_off + kk * 8, st + b_off + kk * 8, acc);
    }
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = m0 + wm * 32 + mt * 16 + g + 8 * h;
      if (r >= rows) continue;
#pragma unroll
      for (int nt = 0; nt < T::kNT; ++nt) {
        const int64_t o = n0 + wn * T::kWN + nt * 8 + 2 * q;
        if (o < n) *reinterpret_cast<float2*>(y + r * n + o) = make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
      }
    }
}

template <class T>
void launch(const float* x, const float* w, float* y, int64_t rows, int64_t k, int64_t n, int splits, cudaStream_t s) {
  static const bool configured = [] {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(f32_tensor_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmem));
    return true;
  }();
  (void)configured;
  if ((k / T::kBK) % splits) throw std::invalid_argument("f32_tensor_xwt: " + std::to_string(k / T::kBK) + " k-steps in " + std::to_string(splits) + " splits");
  const dim3 grid(unsigned((rows + T::kBM - 1) / T::kBM), unsigned((n + T::kBN - 1) / T::kBN), unsigned(splits));
  f32_tensor_kernel<T><<<grid, T::kThreads, T::kSmem, s>>>(x, w, y, rows, k, n);
  PDB_CUDA_LAUNCHED();
}

// The tile for n outputs: the mixes' widths, or 128 x 128.
template <bool kPromote>
void launch_for(const float* x, const float* w, float* y, int64_t rows, int64_t k, int64_t n, int splits, cudaStream_t s) {
  if (n == 24) return launch<Tile<24, 4, 1, 4, kPromote>>(x, w, y, rows, k, n, splits, s);
  if (n == 48) return launch<Tile<48, 4, 1, 4, kPromote>>(x, w, y, rows, k, n, splits, s);
  launch<Tile<64, 4, 2, 4, kPromote>>(x, w, y, rows, k, n, splits, s);
}

int64_t tiles(int64_t rows, int64_t n) {
  const int64_t bn = n == 24 ? Tile24::kBN : n == 48 ? Tile48::kBN : TileWide::kBN;
  return (rows + 127) / 128 * ((n + bn - 1) / bn);
}

}  // namespace

bool f32_tensor_supported(const float* x, const float* w, const float* y, int64_t k, int64_t n) {
  auto aligned = [](const float* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return n > 0 && n % 8 == 0 && k > 0 && k % kMinK == 0 && aligned(x) && aligned(w) && aligned(y) && device_count() > 0;
}

int f32_tensor_splits(int64_t rows, int64_t n, int64_t k) {
  const int sms = multiprocessor_count();
  const int64_t steps = k / kMinK;
  int splits = 1;
  while (tiles(rows, n) * splits < sms && splits < 8 && steps % (2 * splits) == 0 && steps / (2 * splits) >= 8) splits *= 2;
  return splits;
}

void f32_tensor_xwt(const float* x, const float* w, float* y, int64_t rows, int64_t k, int64_t n, cudaStream_t s, float* partials, int splits,
                    int variant) {
  if (rows <= 0) return;
  if (!f32_tensor_supported(x, w, y, k, n))
    throw std::invalid_argument("f32_tensor_xwt: needs outputs of a multiple of 8, inputs of 32, 16-byte aligned operands and a GPU; not " +
                                std::to_string(rows) + " x " + std::to_string(k) + " -> " + std::to_string(n));
  if (rows > int64_t(0x7fffffff) * 64) throw std::invalid_argument("f32_tensor_xwt: too many rows for one launch");
  if (splits < 1 || (splits > 1 && !partials)) throw std::invalid_argument("f32_tensor_xwt: " + std::to_string(splits) + " splits without a workspace");
  float* out = splits > 1 ? partials : y;
  if (variant == 2) launch_for<false>(x, w, out, rows, k, n, splits, s);
  else launch_for<true>(x, w, out, rows, k, n, splits, s);
  if (splits > 1) f32_add_splits(partials, splits, rows * n, y, s);
}

}  // namespace pdb::cuda
