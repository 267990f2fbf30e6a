#include "cuda/q8_gemm.cuh"

#include <cuda_fp16.h>

#include <stdexcept>

#include "common/tuning.h"
#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

// One warp per 32-element block, lane i owns element i.
__global__ void quantize_q8_kernel(const float* __restrict__ x, int64_t n_blocks, int8_t* __restrict__ q, float* __restrict__ d) {
  const int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (b >= n_blocks) return;
  const Q8Lane e = q8_0_lane(x[b * 32 + lane]);
  q[b * 32 + lane] = e.code;
  if (lane == 0) d[b] = __half2float(__float2half_rn(e.scale));
}

// Tiles: 64 rows x 64 outputs per block of 4 warps (2 x 2, 32 x 32 each), 128 bytes of k (4 quant
// blocks) per shared-memory stage, two stages. Rows of a stage are padded to 144 bytes so the 8 rows
// a fragment load touches fall in different banks.
constexpr int kTile = 64, kStageK = 128, kRowBytes = 144, kThreads = 128;

// C(16x8, s32) = A(16x32, s8, row) * B(32x8, s8, col)
__device__ __forceinline__ void mma_s8(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
      : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// float(c) for |c| < 2^22 (a k32 block's integer sum is at most 32 x 128 x 128 = 2^19) without the
// int->float conversion instruction, which the programming guide rates at a fraction of the FP32 add's
// throughput; four per product made it the bulk of this kernel's non-tensor work: c added into the
// mantissa of 1.5 x 2^23, then 1.5 x 2^23 subtracted. Both steps are exact, so the result is identical.
__device__ __forceinline__ float block_sum_to_float(int c) { return __fsub_rn(__int_as_float(0x4B400000 + c), 12582912.0f); }

// A warp's accumulators of an (MI*16) x 32 tile into y: per thread rows g, g+8 of each 16, columns 2t, 2t+1 of each 8.
template <int MI>
__device__ __forceinline__ void store_tile(const float (&acc)[MI][4][4], float* y, int64_t r0, int64_t c0, int g, int t, int64_t rows, int64_t n) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t r = r0 + mi * 16 + g + h * 8, c = c0 + ni * 8 + 2 * t;
        if (r >= rows) continue;
        if (c + 1 < n && (n & 1) == 0 && (reinterpret_cast<uintptr_t>(y) & 7) == 0) {  // the pair 8-byte aligned
          *reinterpret_cast<float2*>(y + r * n + c) = make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        } else {
          if (c < n) y[r * n + c] = acc[mi][ni][2 * h];
          if (c + 1 < n) y[r * n + c + 1] = acc[mi][ni][2 * h + 1];
        }
      }
}

__global__ void __launch_bounds__(kThreads) q8_block_gemm_kernel(const int8_t* __restrict__ qx, const float* __restrict__ dx,
                                                                   const int8_t* __restrict__ qw, const float* __restrict__ dw,
                                                                   float* __restrict__ y, int64_t rows, int64_t k, int64_t n) {
  __shared__ __align__(16) uint8_t sA[2][kTile * kRowBytes], sB[2][kTile * kRowBytes];
  __shared__ __align__(16) float sDx[2][kTile][4], sDw[2][kTile][4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wm = warp / 2, wn = warp % 2;
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const int64_t nb = k / 32;  // quant blocks per row
  const int stages = int(k / kStageK);

  auto load = [&](int st, int buf) {
    const int64_t k0 = int64_t(st) * kStageK;
    for (int i = threadIdx.x; i < kTile * 8; i += kThreads) {  // 8 chunks of 16 bytes per 128-byte row
      const int r = i / 8, c = i % 8;
      const bool ra = row0 + r < rows, rb = col0 + r < n;
      cp_async16(uint32_t(__cvta_generic_to_shared(&sA[buf][r * kRowBytes + c * 16])), qx + (ra ? (row0 + r) * k + k0 + c * 16 : 0), ra);
      cp_async16(uint32_t(__cvta_generic_to_shared(&sB[buf][r * kRowBytes + c * 16])), qw + (rb ? (col0 + r) * k + k0 + c * 16 : 0), rb);
    }
    if (threadIdx.x < kTile) {  // the 4 scales of this stage for each row and each output
      const int r = threadIdx.x;
      const bool ra = row0 + r < rows, rb = col0 + r < n;
      cp_async16(uint32_t(__cvta_generic_to_shared(&sDx[buf][r][0])), dx + (ra ? (row0 + r) * nb + st * 4 : 0), ra);
      cp_async16(uint32_t(__cvta_generic_to_shared(&sDw[buf][r][0])), dw + (rb ? (col0 + r) * nb + st * 4 : 0), rb);
    }
    cp_async_commit();
  };

  float acc[2][4][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) acc[mi][ni][0] = acc[mi][ni][1] = acc[mi][ni][2] = acc[mi][ni][3] = 0.0f;

  load(0, 0);
  for (int st = 0; st < stages; ++st) {
    const int buf = st & 1;
    if (st + 1 < stages) { load(st + 1, buf ^ 1); cp_async_wait<1>(); }
    else cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {  // one quant block: one k32 product per tile, then its scale
      uint32_t a[2][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wm * 32 + mi * 16 + g;
        const uint8_t* p = &sA[buf][r * kRowBytes + kb * 32 + 4 * t];
        a[mi][0] = *reinterpret_cast<const uint32_t*>(p);
        a[mi][1] = *reinterpret_cast<const uint32_t*>(p + 8 * kRowBytes);
        a[mi][2] = *reinterpret_cast<const uint32_t*>(p + 16);
        a[mi][3] = *reinterpret_cast<const uint32_t*>(p + 8 * kRowBytes + 16);
      }
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const uint8_t* p = &sB[buf][(wn * 32 + ni * 8 + g) * kRowBytes + kb * 32 + 4 * t];
        b[ni][0] = *reinterpret_cast<const uint32_t*>(p);
        b[ni][1] = *reinterpret_cast<const uint32_t*>(p + 16);
      }
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wm * 32 + mi * 16 + g;
        const float dx0 = sDx[buf][r][kb], dx1 = sDx[buf][r + 8][kb];
        int cs[4][4];  // the four products first: their latencies overlap instead of each one's scale waiting on it
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_s8(cs[ni], a[mi], b[ni][0], b[ni][1]);
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int* c = cs[ni];
          const int col = wn * 32 + ni * 8 + 2 * t;
          const float dw0 = sDw[buf][col][kb], dw1 = sDw[buf][col + 1][kb];
          // The host's order: scale = d_x * d_w (rounded), then one fused multiply-add per block.
          acc[mi][ni][0] = __fmaf_rn(__fmul_rn(dx0, dw0), block_sum_to_float(c[0]), acc[mi][ni][0]);
          acc[mi][ni][1] = __fmaf_rn(__fmul_rn(dx0, dw1), block_sum_to_float(c[1]), acc[mi][ni][1]);
          acc[mi][ni][2] = __fmaf_rn(__fmul_rn(dx1, dw0), block_sum_to_float(c[2]), acc[mi][ni][2]);
          acc[mi][ni][3] = __fmaf_rn(__fmul_rn(dx1, dw1), block_sum_to_float(c[3]), acc[mi][ni][3]);
        }
      }
    }
    __syncthreads();  // the next prefetch overwrites this buffer
  }

  store_tile<2>(acc, y, row0 + wm * 32, col0 + wn * 32, g, t, rows, n);
}

// The same product in 128 x 128 tiles of 8 warps (2 x 4, 64 x 32 each): twice the tensor work per fragment loaded,
// the fragments by ldmatrix (one instruction where the 64-tile kernel issues four loads), and each block sum's
// integer-to-float offset folded into the product's accumulator input: the tensor core adds 0x4B400000 to the sum,
// so one f32 subtraction makes it a float (block_sum_to_float's integer add gone). Per output and block three f32
// operations remain (that subtraction, d_x * d_w, the fused add), in the host's order: bit-identical as before.
constexpr int kBigTile = 128, kBigThreads = 256, kBigStages = 2;
constexpr int kBigStageBytes = 2 * kBigTile * kRowBytes + 2 * kBigTile * 16;  // A and B codes, then their 4 scales per row
constexpr int kBigSmemBytes = kBigStages * kBigStageBytes;

// C(16x8, s32) = A(16x32, s8, row) * B(32x8, s8, col) + 0x4B400000: float bits 1.5 x 2^23 + the block sum
__device__ __forceinline__ void mma_s8_offset(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
      : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0x4B400000));
}
__device__ __forceinline__ float offset_sum_to_float(int c) { return __fsub_rn(__int_as_float(c), 12582912.0f); }

__global__ void __launch_bounds__(kBigThreads) q8_block_gemm_big_kernel(const int8_t* __restrict__ qx, const float* __restrict__ dx,
                                                                          const int8_t* __restrict__ qw, const float* __restrict__ dw,
                                                                          float* __restrict__ y, int64_t rows, int64_t k, int64_t n) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wm = warp / 4, wn = warp % 4;
  const int64_t row0 = int64_t(blockIdx.y) * kBigTile, col0 = int64_t(blockIdx.x) * kBigTile;
  const int64_t nb = k / 32;
  const int stages = int(k / kStageK);
  auto sA = [&](int buf) { return smem + buf * kBigStageBytes; };
  auto sB = [&](int buf) { return smem + buf * kBigStageBytes + kBigTile * kRowBytes; };
  auto sDx = [&](int buf) { return reinterpret_cast<float*>(smem + buf * kBigStageBytes + 2 * kBigTile * kRowBytes); };
  auto sDw = [&](int buf) { return sDx(buf) + kBigTile * 4; };

  auto load = [&](int st, int buf) {
    const int64_t k0 = int64_t(st) * kStageK;
    for (int i = threadIdx.x; i < kBigTile * 8; i += kBigThreads) {
      const int r = i / 8, c = i % 8;
      const bool ra = row0 + r < rows, rb = col0 + r < n;
      cp_async16(uint32_t(__cvta_generic_to_shared(sA(buf) + r * kRowBytes + c * 16)), qx + (ra ? (row0 + r) * k + k0 + c * 16 : 0), ra);
      cp_async16(uint32_t(__cvta_generic_to_shared(sB(buf) + r * kRowBytes + c * 16)), qw + (rb ? (col0 + r) * k + k0 + c * 16 : 0), rb);
    }
    const int r = threadIdx.x % kBigTile;  // threads 0-127 the rows' 4 scales, 128-255 the outputs'
    if (threadIdx.x < kBigTile) {
      const bool ra = row0 + r < rows;
      cp_async16(uint32_t(__cvta_generic_to_shared(sDx(buf) + r * 4)), dx + (ra ? (row0 + r) * nb + st * 4 : 0), ra);
    } else {
      const bool rb = col0 + r < n;
      cp_async16(uint32_t(__cvta_generic_to_shared(sDw(buf) + r * 4)), dw + (rb ? (col0 + r) * nb + st * 4 : 0), rb);
    }
    cp_async_commit();
  };

  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) acc[mi][ni][0] = acc[mi][ni][1] = acc[mi][ni][2] = acc[mi][ni][3] = 0.0f;
  // ldmatrix rows: A's four 8x16-byte matrices (rows 0-7 / 8-15, bytes 0-15 / 16-31), B's for two 8-output groups
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_byte = (lane >> 4) * 16;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_byte = ((lane >> 3) & 1) * 16;

  load(0, 0);
  for (int st = 0; st < stages; ++st) {
    const int buf = st & 1;
    if (st + 1 < stages) { load(st + 1, buf ^ 1); cp_async_wait<1>(); }
    else cp_async_wait<0>();
    __syncthreads();
    const uint32_t a_base = uint32_t(__cvta_generic_to_shared(sA(buf))), b_base = uint32_t(__cvta_generic_to_shared(sB(buf)));
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      uint32_t a[4][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
        ldmatrix_x4(a_base + (wm * 64 + mi * 16 + a_row) * kRowBytes + kb * 32 + a_byte, a[mi][0], a[mi][1], a[mi][2], a[mi][3]);
#pragma unroll
      for (int np = 0; np < 2; ++np)
        ldmatrix_x4(b_base + (wn * 32 + np * 16 + b_row) * kRowBytes + kb * 32 + b_byte, b[2 * np][0], b[2 * np][1], b[2 * np + 1][0], b[2 * np + 1][1]);
      float sw[4][2];
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int col = wn * 32 + ni * 8 + 2 * t;
        sw[ni][0] = sDw(buf)[col * 4 + kb];
        sw[ni][1] = sDw(buf)[(col + 1) * 4 + kb];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int r = wm * 64 + mi * 16 + g;
        const float dx0 = sDx(buf)[r * 4 + kb], dx1 = sDx(buf)[(r + 8) * 4 + kb];
        int cs[4][4];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_s8_offset(cs[ni], a[mi], b[ni][0], b[ni][1]);
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int* c = cs[ni];
          acc[mi][ni][0] = __fmaf_rn(__fmul_rn(dx0, sw[ni][0]), offset_sum_to_float(c[0]), acc[mi][ni][0]);
          acc[mi][ni][1] = __fmaf_rn(__fmul_rn(dx0, sw[ni][1]), offset_sum_to_float(c[1]), acc[mi][ni][1]);
          acc[mi][ni][2] = __fmaf_rn(__fmul_rn(dx1, sw[ni][0]), offset_sum_to_float(c[2]), acc[mi][ni][2]);
          acc[mi][ni][3] = __fmaf_rn(__fmul_rn(dx1, sw[ni][1]), offset_sum_to_float(c[3]), acc[mi][ni][3]);
        }
      }
    }
    __syncthreads();
  }

  store_tile<4>(acc, y, row0 + wm * 64, col0 + wn * 32, g, t, rows, n);
}

}  // namespace

void quantize_rows_q8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, cudaStream_t s) {
  if (k % 32) throw std::invalid_argument("quantize_rows_q8: width not a multiple of 32");
  const int64_t nb = rows * k / 32;
  if (nb == 0) return;
  quantize_q8_kernel<<<unsigned((nb * 32 + 255) / 256), 256, 0, s>>>(x, nb, q, d);
  PDB_CUDA_LAUNCHED();
}

void q8_block_gemm(const int8_t* qx, const float* dx, const int8_t* qw, const float* dw, float* y, int64_t rows, int64_t k, int64_t n,
                   cudaStream_t s) {
  if (k % kStageK) throw std::invalid_argument("q8_block_gemm: k must be a multiple of 128");
  if (rows == 0 || n == 0) return;
  // the 128-row tiles where they fill the GPU (PDBRIDGE_Q8_GEMM=64 or =128: one kernel whatever the size, the A/B)
  const int64_t big_tiles = ((n + kBigTile - 1) / kBigTile) * ((rows + kBigTile - 1) / kBigTile);
  int dev = 0, sms = 0;
  PDB_CUDA_CHECK(cudaGetDevice(&dev));
  PDB_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const std::string way = Tuning::from_env().q8_gemm;
  if (way == "128" || (way != "64" && big_tiles >= 2 * int64_t(sms))) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(q8_block_gemm_big_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBigSmemBytes));
    const dim3 grid(unsigned((n + kBigTile - 1) / kBigTile), unsigned((rows + kBigTile - 1) / kBigTile));
    q8_block_gemm_big_kernel<<<grid, kBigThreads, kBigSmemBytes, s>>>(qx, dx, qw, dw, y, rows, k, n);
  } else {
    const dim3 grid(unsigned((n + kTile - 1) / kTile), unsigned((rows + kTile - 1) / kTile));
    q8_block_gemm_kernel<<<grid, kThreads, 0, s>>>(qx, dx, qw, dw, y, rows, k, n);
  }
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
