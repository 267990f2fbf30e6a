// The grouped FP4 expert products of moe_fp4_gemm.cuh on Hopper's warpgroup tensor cores. A CTA computes a 128 x 128
// tile of y (one expert's rows x 128 outputs) in 64-wide k-steps: x's rows come by cp.async, the weights' codes (16
// bytes per thread and step: one 32-block) are loaded into registers two steps ahead and expanded by every thread
// into a bf16 tile; three stages of each. Step j + 1's products are issued while step j's still run, and the tile of
// step j + 2 is made under them: the tensor cores always have a step queued (one barrier per step, after waiting for
// step j - 1 only). Both tiles sit K-major with the 128-byte swizzle; each warpgroup issues m64n128k16 over its 64 rows.
// e2m1 -> bf16 by table (cuda/fp4_expand.cuh: an E8M0 byte's eight magnitudes, byte permutes; mxfp4_to_bf16's
// values bit for bit), the 256 tables in shared memory, made once per CTA. 100 KB of shared memory: two CTAs per SM.
#include "cuda/moe_fp4_gemm.cuh"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/tuning.h"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/device_helpers.cuh"
#include "cuda/fp4_expand.cuh"
#include "cuda/wgmma.cuh"

namespace pdb::cuda {
namespace {

constexpr int kBM = kFp4TileRows, kBN = 128, kBK = 64, kThreads = 256, kStages = 3;
constexpr uint32_t kATile = kBM * kBK * 2, kBTile = kBN * kBK * 2;  // 16 KB each
constexpr uint32_t kTableBytes = 256 * sizeof(Fp4Table);
constexpr int kSmemBytes = int(kStages * (kATile + kBTile) + kTableBytes) + 1024;  // + alignment slack
static_assert(kThreads == 256, "one thread per E8M0 byte makes the tables");

// 16-byte chunk c (0..7) of row r of a 64-wide bf16 tile: 128-byte rows, chunks XOR-swizzled by r % 8.
__device__ __forceinline__ uint32_t chunk_offset(int r, int c) { return uint32_t(r * 128 + ((c ^ (r & 7)) * 16)); }

struct Fp4Fetch {
  uint4 codes;
  uint32_t scale;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)


// This thread's block of a k-step's weight tile: output row n0 + tid / 2, the (tid % 2)-th 32 of the step's 64 inputs.
__device__ __forceinline__ Fp4Fetch fetch_codes(const Fp4Matrices& w, int expert, int64_t n0, int64_t k0) {
  const int n = threadIdx.x >> 1, kb = threadIdx.x & 1;
  const int64_t blk = (int64_t(expert) * w.rows + n0 + n) * (w.cols / 32) + k0 / 32 + kb;
  return {__ldg(reinterpret_cast<const uint4*>(w.codes) + blk), uint32_t(__ldg(w.scales + blk))};
}

// The fetched block as 32 bf16 into the tile, by its scale's table.
__device__ __forceinline__ void expand_codes(const Fp4Fetch& f, uint32_t sB, uint32_t tables) {
  const int n = threadIdx.x >> 1, kb = threadIdx.x & 1;
  Fp4Table t;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(t.lo[0]), "=r"(t.lo[1]), "=r"(t.hi[0]), "=r"(t.hi[1])
               : "r"(tables + f.scale * uint32_t(sizeof(Fp4Table))));
  const uint32_t w[4] = {f.codes.x, f.codes.y, f.codes.z, f.codes.w};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t out[4];
    fp4_lookup_chunk(w, c, t, out);
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(sB + chunk_offset(n, kb * 4 + c)), "r"(out[0]), "r"(out[1]), "r"(out[2]),
                 "r"(out[3]) : "memory");
  }
}

// x's rows of the tile for one k-step (rows past the tile's are zeros); one cp.async group.
__device__ __forceinline__ void load_rows(uint32_t sA, const __nv_bfloat16* __restrict__ x, int64_t K, const Fp4Tile& t, int64_t k0, bool any) {
  if (any)
    for (int i = threadIdx.x; i < kBM * 8; i += kThreads) {
      const int r = i >> 3, c = i & 7;
      const bool ok = r < t.rows;
      cp_async16(sA + chunk_offset(r, c), x + (ok ? (int64_t(t.row0) + r) * K + k0 + c * 8 : 0), ok);
    }
  cp_async_commit();
}

// Warpgroup w's 64 rows x 128 outputs += one k-step, issued and committed.
// No register fence here: the previous step's products may still be in flight on d, and any other instruction that
// defines d in between makes ptxas serialize the products (C7515).
__device__ __forceinline__ void issue_step(float* d, uint32_t sA, uint32_t sB, int w, bool accumulate) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk)
    wgmma_ss_n128(d, smem_desc(sA + w * 64 * 128 + kk * 32, 16, 1024), smem_desc(sB + kk * 32, 16, 1024), accumulate || kk > 0);
  wgmma_commit();
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

__global__ void __launch_bounds__(kThreads, 2)
moe_fp4_kernel(const __nv_bfloat16* __restrict__ x, const __grid_constant__ Fp4Matrices w, const Fp4Tile* __restrict__ tiles,
               __nv_bfloat16* __restrict__ y) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma is sm_90a's
#else
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sA0 = (uint32_t(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u, sB0 = sA0 + kStages * kATile;
  const uint32_t tables = sB0 + kStages * kBTile;
  const int n_tiles_n = int(w.rows / kBN);
  const Fp4Tile t = tiles[blockIdx.x / n_tiles_n];
  const int64_t n0 = int64_t(blockIdx.x % n_tiles_n) * kBN, K = w.cols;
  const int nk = int(K / kBK), wg = threadIdx.x / 128;
  auto a_stage = [&](int j) { return sA0 + uint32_t(j % kStages) * kATile; };
  auto b_stage = [&](int j) { return sB0 + uint32_t(j % kStages) * kBTile; };

  {  // thread i makes E8M0 byte i's table
    const Fp4Table tb = fp4_table(threadIdx.x);
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(tables + threadIdx.x * uint32_t(sizeof(Fp4Table))), "r"(tb.lo[0]), "r"(tb.lo[1]),
                 "r"(tb.hi[0]), "r"(tb.hi[1]) : "memory");
  }
  load_rows(a_stage(0), x, K, t, 0, true);
  load_rows(a_stage(1), x, K, t, kBK, nk > 1);
  Fp4Fetch f = fetch_codes(w, t.expert, n0, 0);
  Fp4Fetch f2 = fetch_codes(w, t.expert, n0, nk > 1 ? kBK : 0);
  __syncthreads();  // the tables
  expand_codes(f, b_stage(0), tables);
  if (nk > 1) expand_codes(f2, b_stage(1), tables);
  if (nk > 2) f = fetch_codes(w, t.expert, n0, 2 * kBK);
  cp_async_wait<1>();  // step 0's rows
  fence_async_shared();
  __syncthreads();

  float d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0.0f;
  fence_registers<64>(d);
  for (int j = 0; j < nk; ++j) {
    issue_step(d, a_stage(j), b_stage(j), wg, j > 0);
    wgmma_wait<1>();     // this warpgroup's step j - 1 done; step j runs on
    cp_async_wait<0>();  // step j + 1's rows (the newest group)
    fence_async_shared();
    __syncthreads();  // step j + 1's tiles visible to both warpgroups; step j - 1's stages free
    if (j + 2 < nk) {
      load_rows(a_stage(j + 2), x, K, t, int64_t(j + 2) * kBK, true);
      expand_codes(f, b_stage(j + 2), tables);
      if (j + 3 < nk) f = fetch_codes(w, t.expert, n0, int64_t(j + 3) * kBK);
    }
  }
  wgmma_wait<0>();
  fence_registers<64>(d);

  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wg * 64 + warp * 16 + g + 8 * h;
    if (r >= t.rows) continue;
    __nv_bfloat16* yr = y + (int64_t(t.row0) + r) * w.rows + n0;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
      *reinterpret_cast<__nv_bfloat162*>(yr + 8 * j + 2 * q) = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
  }
#endif
}

// ---- The warp-specialized kernel (the default): the same tiles, stages and expansion, the work split by role. Two
// producer warpgroups copy x's rows (cp.async, their landing counted on the stage's "full" barrier) and expand the codes
// into the B tile; two consumer warpgroups only wait, issue the products and release stages ("empty"), keeping one
// step in flight. Persistent: one CTA per SM walks the (tile, 128 outputs) items, so the producers fill the next
// item's stages while the consumers write the last one out. The lockstep kernel above left the tensor cores waiting
// on its own expansion: 0.8x cuBLAS after expansion, issue slots half idle (docs/RESULTS.md, session 36).
constexpr int kWsStages = 5, kWsAhead = 4, kWsProducers = 256, kWsConsumers = 256, kWsThreads = kWsProducers + kWsConsumers;
constexpr int kWsSmemBytes = int(kWsStages * (kATile + kBTile) + kTableBytes + 2 * kWsStages * 8) + 1024;

struct WsSmem {
  uint32_t a0, b0, tables, full, empty;  // shared addresses: A stages, B stages, the E8M0 tables, the two barrier arrays
  __device__ uint32_t a(uint32_t s) const { return a0 + s * kATile; }
  __device__ uint32_t b(uint32_t s) const { return b0 + s * kBTile; }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Producer thread p (0..255) over one item's k-steps: x's rows (p >> 3) + 32 i, chunk p & 7; the codes of output row
// n0 + p / 2, block p % 2 of each step (expand_codes' thread mapping). `it` counts stages used across items.
__device__ __forceinline__ void ws_produce(const WsSmem& sm, const __nv_bfloat16* __restrict__ x, const Fp4Matrices& w, const Fp4Tile& t,
                                           int64_t n0, uint32_t& it) {
  const int p = threadIdx.x, c = p & 7;
  const int64_t K = w.cols;
  const int nk = int(K / kBK);
  const __nv_bfloat16* src[4];
  bool ok[4];
  uint32_t dst[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = (p >> 3) + 32 * i;
    ok[i] = r < t.rows;
    src[i] = x + (ok[i] ? (int64_t(t.row0) + r) * K : 0) + c * 8;
    dst[i] = chunk_offset(r, c);
  }
  const int64_t blk = (int64_t(t.expert) * w.rows + n0 + (p >> 1)) * (K / 32) + (p & 1);
  const uint4* codes = reinterpret_cast<const uint4*>(w.codes) + blk;
  const uint8_t* scales = w.scales + blk;
  // the codes kWsAhead steps ahead, in a ring of registers (a profile of one step ahead: the producers' top stall was
  // waiting on these loads)
  Fp4Fetch f[kWsAhead];
#pragma unroll
  for (int u = 0; u < kWsAhead; ++u)
    if (u < nk) f[u] = {__ldg(codes + 2 * u), uint32_t(__ldg(scales + 2 * u))};
  for (int j0 = 0; j0 < nk; j0 += kWsAhead) {
#pragma unroll
    for (int u = 0; u < kWsAhead; ++u) {
      const int j = j0 + u;
      if (j >= nk) break;
      const uint32_t s = it % kWsStages, phase = (it / kWsStages) & 1;
      mbar_wait(sm.empty + 8 * s, phase ^ 1);
#pragma unroll
      for (int i = 0; i < 4; ++i) cp_async16(sm.a(s) + dst[i], ok[i] ? src[i] + int64_t(j) * kBK : x, ok[i]);
      mbar_arrive_on_copies(sm.full + 8 * s);
      expand_codes(f[u], sm.b(s), sm.tables);
      fence_async_shared();
      mbar_arrive(sm.full + 8 * s);
      if (j + kWsAhead < nk) f[u] = {__ldg(codes + 2 * (j + kWsAhead)), uint32_t(__ldg(scales + 2 * (j + kWsAhead)))};
      ++it;
    }
  }
}

// Consumer warpgroup wg (0 or 1) over one item: its 64 rows x 128 outputs, then written out as bf16.
__device__ __forceinline__ void ws_consume(const WsSmem& sm, const Fp4Matrices& w, const Fp4Tile& t, int64_t n0, __nv_bfloat16* __restrict__ y,
                                           uint32_t& it, float (&d)[64]) {
  const int ct = threadIdx.x - kWsProducers, wg = ct / 128;
  const int nk = int(w.cols / kBK);
  int held = -1;  // the stage of the step still in flight
  for (int j = 0; j < nk; ++j, ++it) {
    const uint32_t s = it % kWsStages, phase = (it / kWsStages) & 1;
    mbar_wait(sm.full + 8 * s, phase);
    fence_async_shared();  // the stage's cp.async rows, landed, for the products' proxy
    issue_step(d, sm.a(s), sm.b(s), wg, j > 0);
    wgmma_wait<1>();  // the step before is done with its stage
    if (held >= 0) mbar_arrive(sm.empty + 8 * held);
    held = int(s);
  }
  wgmma_wait<0>();
  fence_registers<64>(d);
  mbar_arrive(sm.empty + 8 * held);
  const int warp = (ct % 128) / 32, lane = ct % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wg * 64 + warp * 16 + g + 8 * h;
    if (r >= t.rows) continue;
    __nv_bfloat16* yr = y + (int64_t(t.row0) + r) * w.rows + n0;
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j)
      *reinterpret_cast<__nv_bfloat162*>(yr + 8 * j + 2 * q) = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

__global__ void __launch_bounds__(kWsThreads, 1)
moe_fp4_ws_kernel(const __nv_bfloat16* __restrict__ x, const __grid_constant__ Fp4Matrices w, const Fp4Tile* __restrict__ tiles, int64_t n_items,
                  __nv_bfloat16* __restrict__ y) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma is sm_90a's
#else
  extern __shared__ uint8_t smem_raw[];
  WsSmem sm;
  sm.a0 = (uint32_t(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  sm.b0 = sm.a0 + kWsStages * kATile;
  sm.tables = sm.b0 + kWsStages * kBTile;
  sm.full = sm.tables + kTableBytes;
  sm.empty = sm.full + 8 * kWsStages;
  if (threadIdx.x < 256) {  // thread i makes E8M0 byte i's table
    const Fp4Table tb = fp4_table(threadIdx.x);
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(sm.tables + threadIdx.x * uint32_t(sizeof(Fp4Table))), "r"(tb.lo[0]),
                 "r"(tb.lo[1]), "r"(tb.hi[0]), "r"(tb.hi[1]) : "memory");
  }
  if (threadIdx.x == 0)
    for (int s = 0; s < kWsStages; ++s) {
      mbar_init(sm.full + 8 * s, 2 * kWsProducers);  // each producer: its copies landed, its codes stored
      mbar_init(sm.empty + 8 * s, kWsConsumers);
    }
  __syncthreads();
  const int64_t n_tiles_n = w.rows / kBN;
  uint32_t it = 0;
  if (threadIdx.x < kWsProducers) {
    for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x)
      ws_produce(sm, x, w, tiles[item / n_tiles_n], (item % n_tiles_n) * kBN, it);
    cp_async_wait<0>();
  } else {
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    fence_registers<64>(d);
    for (int64_t item = blockIdx.x; item < n_items; item += gridDim.x)
      ws_consume(sm, w, tiles[item / n_tiles_n], (item % n_tiles_n) * kBN, y, it, d);
  }
#endif
}

// One thread per 32-block: 17 bytes in, its 16 code bytes (one 16-byte store) and its scale out.
__global__ void repack_mxfp4_kernel(const uint8_t* __restrict__ blocks, int64_t n_blocks, int64_t per_expert, int64_t row0_blocks,
                                    int64_t expert_blocks, uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= n_blocks) return;
  const uint8_t* src = blocks + b * 17;
  const int64_t o = (b / per_expert) * expert_blocks + row0_blocks + b % per_expert;
  uint32_t v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    v[i] = uint32_t(src[1 + 4 * i]) | uint32_t(src[2 + 4 * i]) << 8 | uint32_t(src[3 + 4 * i]) << 16 | uint32_t(src[4 + 4 * i]) << 24;
  reinterpret_cast<uint4*>(codes)[o] = make_uint4(v[0], v[1], v[2], v[3]);
  scales[o] = src[0];
}

}  // namespace

void repack_mxfp4(const uint8_t* blocks, int64_t rows, int64_t row0, const Fp4Matrices& m, cudaStream_t s) {
  if (m.cols % 32 || row0 < 0 || row0 + rows > m.rows) throw std::invalid_argument("repack_mxfp4: rows outside the matrices, or a width not of 32-blocks");
  const int64_t per_row = m.cols / 32, n_blocks = m.experts * rows * per_row;
  if (n_blocks == 0) return;
  repack_mxfp4_kernel<<<unsigned((n_blocks + 255) / 256), 256, 0, s>>>(blocks, n_blocks, rows * per_row, row0 * per_row, m.rows * per_row, m.codes,
                                                                      m.scales);
  PDB_CUDA_LAUNCHED();
}

bool moe_fp4_products_supported(int64_t in, int64_t out) { return in > 0 && out > 0 && in % kBK == 0 && out % kBN == 0 && device_is_sm90(); }

void moe_fp4_products(const __nv_bfloat16* x, const Fp4Matrices& w, const Fp4Tile* tiles, int64_t n_tiles, __nv_bfloat16* y, cudaStream_t s) {
  if (n_tiles <= 0) return;
  if (!moe_fp4_products_supported(w.cols, w.rows))
    throw std::invalid_argument("moe_fp4_products: needs an sm_90 GPU, inputs a multiple of 64 and outputs of 128, not " + std::to_string(w.cols) +
                                " -> " + std::to_string(w.rows));
  const int64_t items = n_tiles * (w.rows / kBN);
  if (items > 0x7fffffff) throw std::invalid_argument("moe_fp4_products: too many tiles for one launch");
  static const bool configured = [] {  // once per process
    PDB_CUDA_CHECK(cudaFuncSetAttribute(moe_fp4_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    PDB_CUDA_CHECK(cudaFuncSetAttribute(moe_fp4_ws_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWsSmemBytes));
    return true;
  }();
  (void)configured;
  if (Tuning::from_env().dsv4_fp4_kernel == "lockstep") {
    moe_fp4_kernel<<<unsigned(items), kThreads, kSmemBytes, s>>>(x, w, tiles, y);
  } else {
    const int64_t grid = std::min<int64_t>(items, std::max(1, multiprocessor_count()));
    moe_fp4_ws_kernel<<<unsigned(grid), kWsThreads, kWsSmemBytes, s>>>(x, w, tiles, items, y);
  }
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
