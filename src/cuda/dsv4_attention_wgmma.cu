// DeepSeek-V4's sparse attention (dsv4_attention.cuh; CPU twin numerics/deepseek4_blocks.h dsv4_attend) on Hopper's
// warpgroup tensor cores, for V4-Flash's 64 heads of 512: the mma.sync kernel's algorithm (a query's window and
// compressed rows read in place, the sink as one more logit) with the products issued as wgmma. A query's 64 heads
// are exactly one m64 product, so the two warpgroups split the head dimension instead of the rows: warpgroup w
// multiplies Q's and the keys' dimensions 256w .. 256w + 255 (its half of S, 16 k-steps), the two halves are summed
// through shared memory in f32 (both warpgroups then hold the whole S, bitwise the same: a + b = b + a), each runs
// the same online softmax on it, and each accumulates its half of O = P V (m64n256, P from registers, the key rows
// read MN-major as V). Q (64 KB) stays in shared memory; key tiles of 64 rows (64 KB) in two cp.async stages; the
// partial S in 2 x 16 KB: 225 KB in all, one block per SM. Built for sm_90a only; other targets get a kernel that
// traps (the launcher checks the device first).
//
// Per tile the instruction count bounded the kernel (docs/RESULTS.md, session 41), so the descriptors are uniform
// offsets, a warp copies 16 rows as 512-byte runs, a tile whose slots all hold keys skips the mask, O is rescaled
// only when a row's max rises, and the output leaves by bulk copies. Each warpgroup copies only its half of a tile's
// columns (the only ones it reads), so P V can run on into the next tile's barrier. Measured and not kept (same
// section): the overlap of a tile's softmax with the previous tile's P V (FlashAttention-3's; it needs a third
// stage, so 32-row tiles), a block per SM taking query after query, a stale running max (FlashAttention-4's).
#include "cuda/dsv4_attention.cuh"
#include "cuda/dsv4_attention_keys.cuh"

#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/device_helpers.cuh"
#include "cuda/wgmma.cuh"

namespace pdb::cuda {
namespace {

constexpr int kD = 512, kHalf = kD / 2, kKT = 64, kThreads = 256;
constexpr uint32_t kQBytes = 64 * kD * 2;      // 64 heads (rows past H are zeros)
constexpr uint32_t kTileBytes = kKT * kD * 2;  // one stage of key rows
constexpr uint32_t kXBytes = 128 * 32 * 4;     // one warpgroup's partial S: 32 f32 per thread
// + the stages' valid masks (8 bytes: a bit a row), alignment slack
constexpr int kSmemBytes = int(kQBytes + 2 * kTileBytes + 2 * kXBytes) + 2 * 8 + 1024;
constexpr float kLog2e = 1.4426950408889634f;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Byte offset of 16-byte chunk c (0..63) of row r in a rows x 512 bf16 tile stored as eight 64-column blocks, each
// rows x 128 bytes with its chunks XOR-swizzled by r % 8 (the 128-byte swizzle wgmma reads; attention_wgmma.cu's
// layout with eight blocks instead of two).
__device__ __forceinline__ uint32_t tile_offset(int rows, int r, int c) {
  return uint32_t((c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16));
}

// Warpgroup w's half of a tile of key rows (columns 256w .. 256w + 255, the only ones its products read) into a stage
// in tile_offset's layout: its warp v copies rows 16v .. 16v + 15, lane l chunk 32w + l of each (512 contiguous bytes a
// warp instruction), the rows' sources worked out by lanes 0 .. 15 (from the indexer's choice fetched a step before)
// and taken by shuffle. So a warpgroup may refill its half of a stage as soon as its own P V from it is done. A slot
// without a key copies Q's first row instead of zeros: its score is masked, so P is 0 and the row adds nothing to
// P V. The warp's valid rows as 16 bits of the stage's mask (both warpgroups write the same). One cp.async group.
__device__ __forceinline__ void copy_keys(const Dsv4QueryKeys<kD>& qk, int tile, int32_t chosen, uint32_t sK, uint8_t* valid, int w) {
  constexpr int kRows = kKT / 4;
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  const __nv_bfloat16* mine = lane < kRows ? qk.row(tile * kKT + warp * kRows + lane, chosen) : nullptr;
  const unsigned bits = __ballot_sync(0xffffffffu, mine != nullptr);
  if (lane == 0) reinterpret_cast<uint16_t*>(valid)[warp] = uint16_t(bits);
  if (!mine) mine = qk.a->q;
  const int c = 32 * w + lane;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const auto src = reinterpret_cast<const __nv_bfloat16*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(mine), i));
    cp_async16(sK + tile_offset(kKT, warp * kRows + i, c), src + c * 8, true);
  }
  cp_async_commit();
}

// The indexer's choice for this lane's row of a tile (copy_keys' lanes 0 .. 15).
__device__ __forceinline__ int32_t tile_choice(const Dsv4QueryKeys<kD>& qk, int tile) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  return lane < kKT / 4 ? qk.choice(tile * kKT + warp * (kKT / 4) + lane) : -1;
}

// Warpgroup w's half of S for one tile: dimensions 256w .. 256w + 255 in 16 steps of 16; a step moves 32 bytes
// inside a 64-column block, every fourth the next block. Issued and committed (one wgmma group).
__device__ __forceinline__ void issue_partial_scores(float* s, uint32_t sQ, uint32_t sK, int w) {
  // the descriptors of step 0; a step's are these plus its byte offset / 16 (the address field never carries)
  const uint64_t q0 = smem_desc(sQ + w * (kHalf / 64) * (64 * 128), 16, 1024), k0 = smem_desc(sK + w * (kHalf / 64) * (kKT * 128), 16, 1024);
  fence_registers<kKT / 2>(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHalf / 16; ++kk) {
    const uint32_t off = (kk % 4) * 32;
    const uint64_t qd = q0 + (((kk / 4) * (64 * 128) + off) >> 4), kd = k0 + (((kk / 4) * (kKT * 128) + off) >> 4);
    wgmma_ss_n64(s, qd, kd, kk > 0);
  }
  wgmma_commit();
}

// The two warpgroups' halves summed: each stores its 32 values per thread (thread i of a warpgroup holds the same
// elements as thread i of the other), a block barrier, each adds the other's.
__device__ __forceinline__ void sum_halves(float* s, uint32_t sX, int w) {
  const int tw = threadIdx.x % 128;
#pragma unroll
  for (int i = 0; i < kKT / 8; ++i)
    asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(sX + w * kXBytes + (i * 128 + tw) * 16), "f"(s[4 * i]), "f"(s[4 * i + 1]),
                 "f"(s[4 * i + 2]), "f"(s[4 * i + 3]) : "memory");
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kKT / 8; ++i) {
    float x[4];
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(sX + (w ^ 1) * kXBytes + (i * 128 + tw) * 16) : "memory");
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * i + e] += x[e];  // own + other's in both warpgroups: the same f32 sums
  }
}

// The online softmax of one tile's whole S (this thread's rows g and g + 8, columns 8j + 2t + e) in place: empty
// slots masked (none in most tiles: then no per-score test), S turned into P = 2^(S scale log2 e - m) with m the
// running max in log2 units. Returns whether O must be rescaled by corr: only when some row of the warp has a new max
// (skipping corr = 1 changes nothing). Both warpgroups hold the same S, so they decide alike. A stale max (P up to
// 2^8 before a rescale, FlashAttention-4's rule) ran 3.5% faster and took the error on the dominant weight from 0 to
// bf16's rounding (session 41): not kept.
__device__ __forceinline__ bool softmax_tile(float* s, const uint8_t* valid, int t, float scale_log2, float (&m_run)[2], float (&l_run)[2], float (&corr)[2]) {
  const uint64_t mask = *reinterpret_cast<const uint64_t*>(valid);
  if (mask != ~0ull) {
#pragma unroll
    for (int j = 0; j < kKT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (!((mask >> (8 * j + 2 * t + e)) & 1)) s[4 * j + e] = s[4 * j + 2 + e] = -INFINITY;
      }
  }
  float mx[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKT / 8; ++j) mx[h] = fmaxf(mx[h], fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    mx[h] *= scale_log2;  // the scale is positive: the max of the scaled scores
  }
  const bool rescale = __any_sync(0xffffffffu, mx[0] > m_run[0] || mx[1] > m_run[1]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    corr[h] = 1.0f;
    if (rescale) {
      const float m_new = fmaxf(m_run[h], mx[h]);  // finite: the running max starts at the sink's logit
      corr[h] = exp2f(m_run[h] - m_new);
      m_run[h] = m_new;
    }
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kKT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        x = exp2f(fmaf(x, scale_log2, -m_run[h]));
        sum += x;
      }
    l_run[h] = l_run[h] * corr[h] + sum;
  }
  return rescale;
}

__device__ __forceinline__ void rescale_rows(float* o, const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < kHalf / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) { o[4 * j + 2 * h] *= corr[h]; o[4 * j + 2 * h + 1] *= corr[h]; }
}

// O_w += P V_w: the tile's rows read MN-major, columns 256w .. 256w + 255 (four 64-column blocks, LBO apart), k4
// steps of 16 keys (SBO = 8 keys). Issued and committed (one wgmma group); pa and o belong to it until it is waited for.
__device__ __forceinline__ void issue_pv(float* o, const uint32_t (&pa)[kKT / 16][4], uint32_t sK, int w) {
  const uint64_t v0 = smem_desc(sK + w * (kHalf / 64) * (kKT * 128), kKT * 128, 1024);
  fence_registers<128>(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKT / 16; ++kk) wgmma_rs_n256(o, pa[kk], v0 + ((kk * 16 * 128) >> 4));
  wgmma_commit();
}

// Every thread's state of one query: its warpgroup, its rows, the running softmax, the accumulators.
struct QueryState {
  int w, t, row0;
  float m_run[2], l_run[2], corr[2];
  float o[kHalf / 2];

  __device__ __forceinline__ void start(const Dsv4SparseAttention& a) {
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    w = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);  // warp-uniform to the compiler: descriptors in uniform registers
    t = lane % 4;
    row0 = warp * 16 + lane / 4;  // this thread's heads: row0 and row0 + 8
#pragma unroll
    for (int i = 0; i < kHalf / 2; ++i) o[i] = 0.0f;
    // the sink is one more logit: the running max starts at it, the running sum at its weight exp(sink - max) = 1
    // (counted once per row: by the thread of column 0)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_run[h] = (row0 + 8 * h < a.H ? a.sinks[row0 + 8 * h] : 0.0f) * kLog2e;
      l_run[h] = t == 0 ? 1.0f : 0.0f;
    }
  }
};

__device__ __forceinline__ void copy_q(const Dsv4SparseAttention& a, const Dsv4QueryKeys<kD>& qk, uint32_t sQ) {
  for (int i = threadIdx.x; i < 64 * (kD / 8); i += kThreads) {
    const int r = i / (kD / 8), c = i % (kD / 8);
    const bool ok = r < a.H;
    cp_async16(sQ + tile_offset(64, r, c), a.q + (qk.qi * a.H + (ok ? r : 0)) * kD + c * 8, ok);
  }
  cp_async_commit();
}

// A query's tiles: tile i in stage i % 2. P V of tile i - 1 is left running through the next step's barrier (waited
// for before the scores: 1-3% faster than at once; waiting after the scores' issue, so that it overlaps that too,
// measured no better, session 41); then the warpgroup refills its half of that stage with tile i + 1 while tile i's
// scores run; the indexer's choices for the tile after are read a step before. P V of the last tile is waited for
// after the loop.
struct Tiles {
  const Dsv4SparseAttention& a;
  uint32_t sQ, sK0, sX;
  uint8_t* valid0;
  float scale_log2;
  Dsv4QueryKeys<kD> qk;
  int n_tiles;
  int32_t next;  // the indexer's choice for this lane's row of the tile copied next step
  float s[kKT / 2];
  uint32_t pa[kKT / 16][4];

  __device__ __forceinline__ uint32_t stage(int i) const { return sK0 + (i % 2) * kTileBytes; }
  __device__ __forceinline__ uint8_t* mask(int i) const { return valid0 + (i % 2) * 8; }

  __device__ __forceinline__ void start_copies(int w) {
    copy_q(a, qk, sQ);
    copy_keys(qk, 0, tile_choice(qk, 0), stage(0), mask(0), w);
    next = tile_choice(qk, 1);
  }
  __device__ __forceinline__ void step(QueryState& q, int i) {
    cp_async_wait<0>();  // this tile (and on the first, Q)
    fence_async_shared();
    __syncthreads();  // every copy visible; both warpgroups are done with sX and with the masks' stage for tile i + 1
    wgmma_wait<0>();  // this warpgroup's P V of tile i - 1, which ran through the barrier
    fence_registers<128>(q.o);
    issue_partial_scores(s, sQ, stage(i), q.w);
    if (i + 1 < n_tiles) {  // into this warpgroup's half of the stage its P V of tile i - 1 read
      copy_keys(qk, i + 1, next, stage(i + 1), mask(i + 1), q.w);
      next = tile_choice(qk, i + 2);
    }
    wgmma_wait<0>();
    fence_registers<kKT / 2>(s);
    sum_halves(s, sX, q.w);
    if (softmax_tile(s, mask(i), q.t, scale_log2, q.m_run, q.l_run, q.corr)) rescale_rows(q.o, q.corr);
    pack_p_fragments<kKT>(s, pa);
    issue_pv(q.o, pa, stage(i), q.w);
  }
};

// The output's rows, normalized: each thread's bf16 pairs into shared memory rows of 1,040 bytes (the 16-byte pad
// spreads a warp's 8 rows over all banks), then one bulk copy a row (cp.async.bulk, the TMA engine) to the output.
// So the stores leave as 64 instructions a block instead of 64 a thread, and the block does not wait on them to drain,
// only on the copies' reads of shared memory (profile: the per-thread stores and their drain were 13% of the samples).
// sO: Q's buffer and the first stage's, free once every warp is past its last P V (the barrier).
constexpr uint32_t kORowBytes = kD * 2 + 16;
__device__ __forceinline__ void store_rows(const QueryState& q, uint32_t sO, int H, __nv_bfloat16* out_q) {
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = q.l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const uint32_t row = sO + (q.row0 + 8 * h) * kORowBytes + q.w * kHalf * 2;
#pragma unroll
    for (int j = 0; j < kHalf / 8; ++j) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(q.o[4 * j + 2 * h] * inv, q.o[4 * j + 2 * h + 1] * inv);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(row + (8 * j + 2 * q.t) * 2), "r"(*reinterpret_cast<const uint32_t*>(&v)) : "memory");
    }
  }
  fence_async_shared();
  __syncthreads();
  if (int(threadIdx.x) < H) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(out_q + threadIdx.x * kD), "r"(sO + threadIdx.x * kORowBytes),
                 "n"(kD * 2) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // shared memory stays until the copy has read it
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

__global__ void __launch_bounds__(kThreads, 1) sparse_attention_wgmma_kernel(const __grid_constant__ Dsv4SparseAttention a, __nv_bfloat16* __restrict__ out) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma is sm_90a's
#else
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t sQ = (raw + 1023u) & ~1023u, sK0 = sQ + kQBytes, sX = sK0 + 2 * kTileBytes;  // swizzle atoms: 1024-aligned
  uint8_t* valid0 = smem_raw + (sX + 2 * kXBytes - raw);  // [2][8], 8-byte aligned
  Tiles tiles{a, sQ, sK0, sX, valid0, a.scale * kLog2e, dsv4_query_keys<kD>(a)};
  QueryState q;
  q.start(a);
  tiles.start_copies(q.w);
  tiles.n_tiles = (tiles.qk.n_slots + kKT - 1) / kKT;
  for (int i = 0; i < tiles.n_tiles; ++i) tiles.step(q, i);
  wgmma_wait<0>();  // the last tile's P V
  fence_registers<128>(q.o);
  cp_async_wait<0>();
  static_assert(64 * kORowBytes <= kQBytes + kTileBytes, "the rows fit Q's buffer and the first stage");
  store_rows(q, sQ, a.H, out + tiles.qk.qi * a.H * kD);
#endif
}

}  // namespace

bool dsv4_sparse_attention_wgmma_supported(int heads, int dim) { return heads > 0 && heads <= 64 && dim == kD && device_is_sm90(); }

void dsv4_sparse_attention_wgmma(const Dsv4SparseAttention& a, __nv_bfloat16* out, cudaStream_t s) {
  if (a.nq <= 0) return;
  if (!dsv4_sparse_attention_wgmma_supported(a.H, a.D))
    throw std::invalid_argument("dsv4_sparse_attention_wgmma: takes <= 64 heads of 512 on an sm_90 GPU, not " + std::to_string(a.H) + " x " +
                                std::to_string(a.D));
  static bool configured = false;  // once per process
  if (!configured) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    configured = true;
  }
  sparse_attention_wgmma_kernel<<<unsigned(a.nq), kThreads, kSmemBytes, s>>>(a, out);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
