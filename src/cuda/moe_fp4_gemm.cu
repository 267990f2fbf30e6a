// The grouped FP4 expert products of moe_fp4_gemm.cuh on Hopper's warpgroup tensor cores, the weights as the register
// operand: a CTA computes y^T's outputs x one tile's rows as two warpgroups, each kMB blocks of 64 outputs times the
// tile's rows by wgmma m64nNk16, W's fragment from registers and x's rows (K-major, 128-byte swizzle) from shared
// memory. Two shapes (Fp4Shape): 128 outputs x up to 256 rows (kMB = 1, m64n256k16; session 36's), or 256 outputs x
// up to 128 rows (kMB = 2, m64n128k16; the default): each token row read by half as many CTAs (L2 34% busy against
// 46% at V4-Flash's shapes) and less padding, for twice the fragments per thread per product (docs/RESULTS.md,
// session 40). A tile of at most half the rows runs at half N.
// Each thread makes its own fragments from the repacked codes (cuda/fp4_expand.cuh: a 16-byte load per k-step of
// 64; per pair a funnel shift, a mask and one bf16 product, two where a scale passes 2^0; mxfp4_to_bf16's values)
// while the tensor cores run the chunks before: the weights never pass through shared memory. Session 36 measured
// the kernels that expanded into a shared B tile (lockstep and warp-specialized) at ~0.8x cuBLAS after expansion,
// shared memory 79% busy with the tile's stores and both warpgroups' reads (docs/RESULTS.md). x's rows come by
// cp.async, one barrier a step. The fused form (Fp4Fusion, the engine's default; PDBRIDGE_DSV4_FP4_FUSE=0: not)
// copies each row from its token's row and writes the SwiGLU of the gate/up pairs.
#include "cuda/moe_fp4_gemm.cuh"

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

constexpr int kBK = 64, kThreads = 256;
// A shape's constants: kMB blocks of 64 outputs per warpgroup, the tile's rows at most, a stage of x's rows (one
// k-step of them), the pipeline's depth (kStages stages: copies kStages - 2 steps ahead of the products; the codes
// kAhead steps ahead: two ran the same for outputs256 and slower for rows256, session 40). rows256's four stages are
// the measured depth (six ran the same, session 39); outputs256's six stages are the same 96 KB of shared memory as
// three of rows256's (eight ran no faster, session 40).
template <int kMB>
struct Shape {
  static constexpr int kOutputs = 128 * kMB, kRows = 256 / kMB;
  static constexpr uint32_t kXTile = uint32_t(kRows * kBK * 2);
  static constexpr int kStages = kMB == 1 ? 4 : 6, kAhead = 3;
  static constexpr int smem_bytes() { return int(kStages * kXTile) + 1024; }  // + alignment slack: one CTA per SM
};

// The repacked layout (repack_mxfp4): per expert, per 16 output rows, per k-step of 64, a 512-byte group of codes
// (lane 4g + q's 16 bytes: its words for rows g and g + 8 of the 16, blocks 0 and 1 of the step) and 32 scale bytes
// (4g + 2 half + block: rows g, g + 8).
__host__ __device__ inline int64_t code_group(int64_t expert, int64_t n16, int64_t kstep, const Fp4Matrices& m) {
  return (expert * (m.rows / 16) + n16) * (m.cols / kBK) + kstep;
}

// 16-byte chunk c (0..7) of row r of a 64-wide bf16 tile: 128-byte rows, chunks XOR-swizzled by r % 8.
__device__ __forceinline__ uint32_t chunk_offset(int r, int c) { return uint32_t(r * 128 + ((c ^ (r & 7)) * 16)); }

struct Fp4Step {
  uint4 words;     // rows g, g + 8 of block 0, then of block 1
  uint32_t scales;  // their E8M0 bytes: (g, block 0), (g, block 1), (g + 8, block 0), (g + 8, block 1)
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// This thread's share of x's rows: rows r + 32 i (r = tid >> 3), chunk tid & 7 (rows past the tile's: zeros), of a tile
// of at most kRows. Without the gather, the first row's source and the stride are worked out once, so a k-step's
// copies are additions (registers are tight here); with it (kGather), each row's source is worked out once per tile
// (a k-step's copy: one addition, not a 64-bit product, session 41).
template <bool kGather, int kRows>
struct RowCopies {
  const __nv_bfloat16* src0;
  int64_t stride = 0;  // 32 rows (without the gather)
  uint32_t dst0;
  int valid;  // how many of the thread's rows lie in the tile
  const __nv_bfloat16* src[kGather ? kRows / 32 : 1];  // kGather: this thread's chunk of each of its x rows
  __device__ RowCopies(const __nv_bfloat16* x, int64_t K, const Fp4Tile& t, const int32_t* __restrict__ x_rows) {
    const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
    dst0 = chunk_offset(r, c);  // row r + 32 i's: + 4096 i (the swizzle repeats every 8 rows)
    valid = t.rows > r ? (t.rows - r + 31) / 32 : 0;
    if constexpr (kGather) {
      src0 = x + c * 8;
#pragma unroll
      for (int i = 0; i < kRows / 32; ++i) src[i] = src0 + (i < valid ? int64_t(__ldg(x_rows + t.row0 + r + 32 * i)) * K : 0);
    } else {
      src0 = x + (int64_t(t.row0) + r) * K + c * 8;
      stride = 32 * K;
    }
  }
  // one k-step's copies of the first kN rows into a stage; one cp.async group (empty where `any` is false)
  template <int kN>
  __device__ void load(uint32_t sX, int64_t k0, bool any) const {
    if (any) {
      if constexpr (kGather) {
#pragma unroll
        for (int i = 0; i < kN * 8 / kThreads; ++i) cp_async16(sX + dst0 + 4096u * i, src[i] + k0, i < valid);
      } else {
        const __nv_bfloat16* p = src0 + k0;
#pragma unroll
        for (int i = 0; i < kN * 8 / kThreads; ++i, p += stride) cp_async16(sX + dst0 + 4096u * i, i < valid ? p : src0, i < valid);
      }
    }
    cp_async_commit();
  }
};

// k16 chunk c (0..3) of a step as this thread's A fragment: rows g and g + 8, k columns 2q, 2q + 1 (a0, a1) and
// 2q + 8, 2q + 9 (a2, a3) of the chunk.
// kOne: no scale of the matrices is above 128, so the second product (by 1) is left out (real weights' scales sit far
// below; the kernel's other instantiation keeps the values right everywhere).
template <bool kOne>
__device__ __forceinline__ uint32_t pair_of(uint32_t w, int p, const Fp4PairScale& s) {
  const uint32_t v = fp4_mul_bf16x2(fp4_pair_bits(w, p), s.m1);
  return kOne ? v : fp4_mul_bf16x2(v, s.m2);
}
template <bool kOne>
__device__ __forceinline__ void make_fragment(const Fp4Step& st, const Fp4PairScale (&sc)[2][2], int c, uint32_t (&a)[4]) {
  const int blk = c >> 1, p = 2 * (c & 1);
  const uint32_t wg = blk ? st.words.z : st.words.x, wg8 = blk ? st.words.w : st.words.y;
  a[0] = pair_of<kOne>(wg, p, sc[0][blk]);
  a[1] = pair_of<kOne>(wg8, p, sc[1][blk]);
  a[2] = pair_of<kOne>(wg, p + 1, sc[0][blk]);
  a[3] = pair_of<kOne>(wg8, p + 1, sc[1][blk]);
}


// Byte b of a step's scale word as its pair scale. kOne (no E8M0 byte above 128): the first factor alone, 2^(e-1) as
// a bf16 in both halves, is byte b copied to bytes 0 and 2 by one permute, times 128, plus 126's exponent bits: two
// instructions where fp4_pair_scale's general form takes five (the same bits for e <= 128).
template <bool kOne>
__device__ __forceinline__ Fp4PairScale step_scale(uint32_t scales, int b) {
  if constexpr (kOne) return {__byte_perm(scales, 0u, 0x4040u + 0x0101u * uint32_t(b)) * 128u + 0x3F003F00u, 0u};
  else return fp4_pair_scale((scales >> (8 * b)) & 0xffu);
}

// m64 n kN k16 (kN = 256, 128 or 64), W's fragment from registers, x's kN rows from shared memory (K-major)
template <int kN>
__device__ __forceinline__ void chunk_product(float* d, const uint32_t* a, uint64_t desc_x, bool accumulate) {
  if constexpr (kN == 256) wgmma_rs_n256_kmajor(d, a, desc_x, accumulate);
  else if constexpr (kN == 128) wgmma_rs_n128_kmajor(d, a, desc_x, accumulate);
  else wgmma_rs_n64_kmajor(d, a, desc_x, accumulate);
}

// The products' epilogue for one block of 64 outputs, d as the fragments hold it: output rows r64 + 16 warp + g (+ 8),
// the tile's rows 8 jj + 2q (+ 1). kFused: the two output rows are one feature's gate and up
// (Fp4Matrices::gate_up_pairs), and y [rows x w.rows / 2] gets their SwiGLU, each product rounded to bf16 first as
// the unfused path stores it.
template <bool kFused, int kN>
__device__ __forceinline__ void store_outputs(const float (&d)[kN / 2], const Fp4Matrices& w, const Fp4Tile& t, int64_t r64, float limit,
                                              __nv_bfloat16* __restrict__ y) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int jj = 0; jj < kN / 8; ++jj)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * jj + 2 * q + e;
      if (r >= t.rows) continue;
      if constexpr (kFused) {
        const float gate = __bfloat162float(__float2bfloat16_rn(d[4 * jj + e])), up = __bfloat162float(__float2bfloat16_rn(d[4 * jj + 2 + e]));
        y[(int64_t(t.row0) + r) * (w.rows / 2) + fp4_pair_feature(r64 + 16 * warp, g)] = __float2bfloat16_rn(swiglu_clamp(gate, up, limit));
      } else {
        __nv_bfloat16* yr = y + (int64_t(t.row0) + r) * w.rows + r64 + 16 * warp + g;
        yr[0] = __float2bfloat16_rn(d[4 * jj + e]);
        yr[8] = __float2bfloat16_rn(d[4 * jj + 2 + e]);
      }
    }
}

// One tile's products for this CTA's outputs from n0, as kN token rows (the shape's, or half of them for a tile of
// at most half: half the products and copies), then written out (kFused: x's rows gathered, the SwiGLU of each
// gate/up pair written). Warpgroup wg's outputs: n0 + 64 kMB wg + 64 mb + 16 warp + g (+ 8), m-block mb < kMB.
template <bool kOne, int kMB, int kN, bool kFused>
__device__ __forceinline__ void tile_products(const __nv_bfloat16* __restrict__ x, const Fp4Matrices& w, const Fp4Tile& t, int64_t n0,
                                              const int32_t* __restrict__ x_rows, float limit, __nv_bfloat16* __restrict__ y, uint32_t sX0) {
  using S = Shape<kMB>;
  constexpr int kStages = S::kStages, kAhead = S::kAhead;
  auto stage = [&](int j) { return sX0 + uint32_t(j % kStages) * S::kXTile; };
  // the stages of step j (its products) and j + kStages - 2 (its copies), stepped along, not worked out by a modulo
  auto next_stage = [&](uint32_t a) { return a + S::kXTile == sX0 + kStages * S::kXTile ? sX0 : a + S::kXTile; };
  const int64_t K = w.cols;
  const int nk = int(K / kBK), wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4;
  // a last block of 128 outputs (w.rows not a multiple of 256) leaves outputs256's second warpgroup nothing: it
  // multiplies the first one's weights again and stores nothing (no branch around the barriers and the products)
  const bool stores = n0 + 64 * kMB * wg < w.rows;
  const int64_t wg_n0 = stores ? n0 + 64 * kMB * wg : n0;
  // this warp's 16 output rows of m-block mb: wg_n0 + 64 mb + 16 warp, 4 groups of 16 rows apart per m-block
  const int64_t group0 = code_group(t.expert, (wg_n0 + 16 * warp) / 16, 0, w), mb_groups = 4 * (K / kBK);
  const uint4* codes = reinterpret_cast<const uint4*>(w.codes) + group0 * 32 + lane;
  const uint32_t* scales = reinterpret_cast<const uint32_t*>(w.scales) + group0 * 8 + g;
  auto fetch = [&](int j, int mb) { return Fp4Step{__ldg(codes + 32 * (j + mb * mb_groups)), __ldg(scales + 8 * (j + mb * mb_groups))}; };
  // the step the loop fetches next (min(j + kAhead, nk - 1)), its m-block 0's codes and scales, stepped along rather
  // than worked out from j (a 64-bit product and addition per m-block a step)
  const uint4* codes_next = codes + 32 * min(kAhead, nk - 1);
  const uint32_t* scales_next = scales + 8 * min(kAhead, nk - 1);
  uint32_t s_products = stage(0), s_copies = stage(kStages - 2);

  const RowCopies<kFused, S::kRows> rows(x, K, t, x_rows);
  for (int j = 0; j < kStages - 2; ++j) rows.template load<kN>(stage(j), int64_t(j) * kBK, j < nk);
  // The codes of step j in slot j % kRing, fetched kAhead steps ahead into the slot step j - 1 read (a load straight
  // into the registers it fills: session 39's ring copied each step's codes out of the slot before refilling it, and
  // that copy waited for the load it had just issued, 23% of rows256's stalls). Always a load (the last steps fetch
  // the last step's codes again), so that no predicate or select stands between the load and its registers.
  constexpr int kRing = kAhead + 1;
  Fp4Step ring[kRing][kMB];
#pragma unroll
  for (int u = 0; u < kAhead; ++u)
#pragma unroll
    for (int mb = 0; mb < kMB; ++mb) ring[u][mb] = fetch(min(u, nk - 1), mb);
  float d[kMB][kN / 2];
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) d[mb][i] = 0.0f;
    fence_registers<kN / 2>(d[mb]);
  }
  uint32_t a[4][kMB][4];
  for (int j0 = 0; j0 < nk; j0 += kRing) {
#pragma unroll
    for (int u = 0; u < kRing; ++u) {
      const int j = j0 + u;
      if (j >= nk) break;
      cp_async_wait<kStages - 3>();  // this thread's copies of step j
      fence_async_shared();
      __syncthreads();  // everyone's; and step j - 2's products done in both warpgroups (their waits below)
      rows.template load<kN>(s_copies, int64_t(j + kStages - 2) * kBK, j + kStages - 2 < nk);
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb)
        ring[(u + kAhead) % kRing][mb] = Fp4Step{__ldg(codes_next + 32 * mb * mb_groups), __ldg(scales_next + 8 * mb * mb_groups)};
      if (j + kAhead + 1 < nk) codes_next += 32, scales_next += 8;
      const Fp4Step(&st)[kMB] = ring[u];
      Fp4PairScale sc[kMB][2][2];
#pragma unroll
      for (int mb = 0; mb < kMB; ++mb)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int blk = 0; blk < 2; ++blk) sc[mb][h][blk] = step_scale<kOne>(st[mb].scales, 2 * h + blk);
      const uint64_t desc = smem_desc(s_products, 16, 1024);  // chunk c's: + 32 c bytes, 2 c in the address field
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        wgmma_wait<3>();  // the chunk that last read a[c] (step j - 1's) is done
#pragma unroll
        for (int mb = 0; mb < kMB; ++mb) make_fragment<kOne>(st[mb], sc[mb], c, a[c][mb]);
        wgmma_fence();
#pragma unroll
        for (int mb = 0; mb < kMB; ++mb) chunk_product<kN>(d[mb], a[c][mb], desc + 2 * c, j > 0 || c > 0);
        wgmma_commit();
      }
      s_products = next_stage(s_products);
      s_copies = next_stage(s_copies);
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int mb = 0; mb < kMB; ++mb) {
    fence_registers<kN / 2>(d[mb]);
    if (stores) store_outputs<kFused, kN>(d[mb], w, t, wg_n0 + 64 * mb, limit, y);
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <bool kOne, int kMB, bool kFused>
__global__ void __launch_bounds__(kThreads, 1)
moe_fp4_kernel(const __nv_bfloat16* __restrict__ x, const __grid_constant__ Fp4Matrices w, const Fp4Tile* __restrict__ tiles,
               const int32_t* __restrict__ x_rows, float limit, __nv_bfloat16* __restrict__ y) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma is sm_90a's
#else
  using S = Shape<kMB>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sX0 = (uint32_t(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  const int n_tiles_n = int((w.rows + S::kOutputs - 1) / S::kOutputs);
  const Fp4Tile t = tiles[blockIdx.x / n_tiles_n];
  const int64_t n0 = int64_t(blockIdx.x % n_tiles_n) * S::kOutputs;
  if (t.rows > S::kRows) __trap();  // tiles made for the other shape (fp4_tiles)
  if (t.rows > S::kRows / 2) tile_products<kOne, kMB, S::kRows, kFused>(x, w, t, n0, x_rows, limit, y, sX0);
  else tile_products<kOne, kMB, S::kRows / 2, kFused>(x, w, t, n0, x_rows, limit, y, sX0);
#endif
}

// One thread per 32-block: its scale and its four lanes' words to their places in the repacked layout.
__global__ void repack_mxfp4_kernel(const uint8_t* __restrict__ blocks, int64_t n_blocks, int64_t rows, int64_t row0,
                                    const __grid_constant__ Fp4Matrices m, unsigned* wide) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= n_blocks) return;
  const int64_t per_row = m.cols / 32, per_expert = rows * per_row;
  const int64_t expert = b / per_expert, r = (b % per_expert) / per_row, kb = b % per_row, n = fp4_stored_row(row0 + r, m);
  const int g = int(n % 8), half = int((n % 16) / 8), blk = int(kb % 2);
  const int64_t group = code_group(expert, n / 16, kb / 2, m);
  const uint8_t* src = blocks + b * 17;
  uint8_t codes[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) codes[i] = src[1 + i];
  uint32_t* words = reinterpret_cast<uint32_t*>(m.codes) + group * 128;
#pragma unroll
  for (int q = 0; q < 4; ++q) words[(4 * g + q) * 4 + blk * 2 + half] = fp4_fragment_word(codes, q);
  m.scales[group * 32 + g * 4 + half * 2 + blk] = src[0];
  if (src[0] > 128) *wide = 1u;
}

template <int kMB, bool kFused>
void launch(const __nv_bfloat16* x, const Fp4Matrices& w, const Fp4Tile* tiles, int64_t grid, const Fp4Fusion& f, __nv_bfloat16* y, cudaStream_t s) {
  constexpr int smem = Shape<kMB>::smem_bytes();
  static const bool configured = [] {  // once per process and instantiation
    PDB_CUDA_CHECK(cudaFuncSetAttribute(moe_fp4_kernel<true, kMB, kFused>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    PDB_CUDA_CHECK(cudaFuncSetAttribute(moe_fp4_kernel<false, kMB, kFused>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)configured;
  const unsigned blocks = unsigned(grid);
  if (w.wide_scales) moe_fp4_kernel<false, kMB, kFused><<<blocks, kThreads, smem, s>>>(x, w, tiles, f.x_rows, f.limit, y);
  else moe_fp4_kernel<true, kMB, kFused><<<blocks, kThreads, smem, s>>>(x, w, tiles, f.x_rows, f.limit, y);
  PDB_CUDA_LAUNCHED();
}

template <int kMB>
void launch(const __nv_bfloat16* x, const Fp4Matrices& w, const Fp4Tile* tiles, int64_t grid, const Fp4Fusion& f, __nv_bfloat16* y, cudaStream_t s) {
  if (f.swiglu) return launch<kMB, true>(x, w, tiles, grid, f, y, s);
  launch<kMB, false>(x, w, tiles, grid, f, y, s);
}

}  // namespace

bool repack_mxfp4(const uint8_t* blocks, int64_t rows, int64_t row0, const Fp4Matrices& m, cudaStream_t s) {
  if (m.cols % kBK || m.rows % 16 || row0 < 0 || row0 + rows > m.rows)
    throw std::invalid_argument("repack_mxfp4: rows outside the matrices, or widths not of 64 inputs and 16 outputs");
  const int64_t n_blocks = m.experts * rows * (m.cols / 32);
  if (n_blocks == 0) return false;
  DeviceBuffer wide(4);
  PDB_CUDA_CHECK(cudaMemsetAsync(wide.get(), 0, 4, s));
  repack_mxfp4_kernel<<<unsigned((n_blocks + 255) / 256), 256, 0, s>>>(blocks, n_blocks, rows, row0, m, wide.as<unsigned>());
  PDB_CUDA_LAUNCHED();
  unsigned any = 0;
  PDB_CUDA_CHECK(cudaMemcpyAsync(&any, wide.get(), 4, cudaMemcpyDeviceToHost, s));
  PDB_CUDA_CHECK(cudaStreamSynchronize(s));
  return any != 0;
}

bool moe_fp4_products_supported(int64_t in, int64_t out) { return in > 0 && out > 0 && in % kBK == 0 && out % 128 == 0 && device_is_sm90(); }

Fp4Shape fp4_shape(const Tuning& t) { return t.dsv4_fp4_tile == "rows256" ? Fp4Shape::kRows256 : Fp4Shape::kOutputs256; }

void moe_fp4_products(const __nv_bfloat16* x, const Fp4Matrices& w, const Fp4Tile* tiles, int64_t n_tiles, Fp4Shape shape, __nv_bfloat16* y,
                      cudaStream_t s, const Fp4Fusion& f) {
  if (n_tiles <= 0) return;
  if (!moe_fp4_products_supported(w.cols, w.rows))
    throw std::invalid_argument("moe_fp4_products: needs an sm_90 GPU, inputs a multiple of 64 and outputs of 128, not " + std::to_string(w.cols) +
                                " -> " + std::to_string(w.rows));
  // the fused form gathers and pairs together (the only use: DeepSeek-V4's gate|up products)
  if (f.swiglu != w.gate_up_pairs || f.swiglu != (f.x_rows != nullptr))
    throw std::invalid_argument("moe_fp4_products: the SwiGLU epilogue takes gate/up-paired weights and gathered rows, and only it does");
  const int64_t per_tile = (w.rows + fp4_tile_outputs(shape) - 1) / fp4_tile_outputs(shape), grid = n_tiles * per_tile;
  if (grid > 0x7fffffff) throw std::invalid_argument("moe_fp4_products: too many tiles for one launch");
  if (shape == Fp4Shape::kRows256) return launch<1>(x, w, tiles, grid, f, y, s);
  launch<2>(x, w, tiles, grid, f, y, s);
}

}  // namespace pdb::cuda
