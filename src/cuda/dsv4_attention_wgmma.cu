// DeepSeek-V4's sparse attention (dsv4_attention.cuh; CPU twin numerics/deepseek4_blocks.h dsv4_attend) on Hopper's
// warpgroup tensor cores, for V4-Flash's 64 heads of 512: the mma.sync kernel's algorithm (one block per query, its
// window and compressed rows read in place, the sink as one more logit) with the products issued as wgmma. A query's
// 64 heads are exactly one m64 product, so the two warpgroups split the head dimension instead of the rows: warpgroup
// w multiplies Q's and the keys' dimensions 256w .. 256w + 255 (S_w, m64n64, 16 k-steps), the two halves are summed
// through shared memory in f32 (both warpgroups then hold the whole S, bitwise the same: a + b = b + a), each runs
// the same online softmax on it, and each accumulates its half of O = P V (m64n256, P from registers, the key rows
// read MN-major as V). Q (64 KB) stays in shared memory; key tiles of 64 rows (64 KB) in two cp.async stages; the
// partial S in 2 x 16 KB: 225 KB in all, one block per SM. Built for sm_90a only; other targets get a kernel that
// traps (the launcher checks the device first).
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
constexpr int kSmemBytes = int(kQBytes + 2 * kTileBytes + 2 * kXBytes) + 2 * kKT + 1024;  // + valid flags, alignment slack
constexpr float kLog2e = 1.4426950408889634f;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Byte offset of 16-byte chunk c (0..63) of row r in a rows x 512 bf16 tile stored as eight 64-column blocks, each
// rows x 128 bytes with its chunks XOR-swizzled by r % 8 (the 128-byte swizzle wgmma reads; attention_wgmma.cu's
// layout with eight blocks instead of two).
__device__ __forceinline__ uint32_t tile_offset(int rows, int r, int c) {
  return uint32_t((c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16));
}


// One tile of key rows into a stage in tile_offset's layout (dsv4_attention_keys.cuh).
__device__ __forceinline__ void load_keys(const Dsv4QueryKeys<kD>& qk, int tile, uint32_t sK, uint8_t* valid) {
  dsv4_load_key_tile<kD, kKT, kThreads>(qk, tile, sK, valid, [](int r, int c) { return tile_offset(kKT, r, c); });
}

// Warpgroup w's half of S for one tile: dimensions 256w .. 256w + 255 in 16 steps of 16; a step moves 32 bytes
// inside a 64-column block, every fourth the next block. Issued and committed: scores_ready waits for it, so the
// next tile's copies are issued while the tensor cores work.
__device__ __forceinline__ void issue_partial_scores(float* s, uint32_t sQ, uint32_t sK, int w) {
  fence_registers<32>(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kHalf / 16; ++kk) {
    const int block = w * (kHalf / 64) + kk / 4;
    const uint32_t off = (kk % 4) * 32;
    wgmma_ss_n64(s, smem_desc(sQ + block * (64 * 128) + off, 16, 1024), smem_desc(sK + block * (kKT * 128) + off, 16, 1024), kk > 0);
  }
  wgmma_commit();
}

__device__ __forceinline__ void scores_ready(float* s) {
  wgmma_wait<0>();
  fence_registers<32>(s);
}

// The two warpgroups' halves summed: each stores its 32 values per thread (thread i of a warpgroup holds the same
// elements as thread i of the other), a block barrier, each adds the other's.
__device__ __forceinline__ void sum_halves(float* s, uint32_t sX, int w) {
  const int tw = threadIdx.x % 128;
#pragma unroll
  for (int i = 0; i < 8; ++i)
    asm volatile("st.shared.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(sX + w * kXBytes + (i * 128 + tw) * 16), "f"(s[4 * i]), "f"(s[4 * i + 1]),
                 "f"(s[4 * i + 2]), "f"(s[4 * i + 3]) : "memory");
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float x[4];
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(sX + (w ^ 1) * kXBytes + (i * 128 + tw) * 16) : "memory");
#pragma unroll
    for (int e = 0; e < 4; ++e) s[4 * i + e] += x[e];  // own + other's in both warpgroups: the same f32 sums
  }
}

// The online softmax of one tile's whole S (this thread's rows g and g + 8, columns 8j + 2t + e) in place: empty
// slots masked, the running max and sum in log2 units of the scaled scores, O rescaled, P packed as the A fragments
// of the P V product (keys 16kk .. 16kk + 15: S blocks 2kk and 2kk + 1).
__device__ __forceinline__ void softmax_tile(float* s, const uint8_t* valid, int t, float scale_log2, float (&m_run)[2], float (&l_run)[2], float* o,
                                             uint32_t (&pa)[kKT / 16][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        x = valid[8 * j + 2 * t + e] ? x * scale_log2 : -INFINITY;
        mx = fmaxf(mx, x);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[h], mx);  // finite: the running max starts at the sink's logit
    const float corr = exp2f(m_run[h] - m_new);
    m_run[h] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kKT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        x = exp2f(x - m_new);
        sum += x;
      }
    l_run[h] = l_run[h] * corr + sum;
#pragma unroll
    for (int j = 0; j < kHalf / 8; ++j) { o[4 * j + 2 * h] *= corr; o[4 * j + 2 * h + 1] *= corr; }
  }
  pack_p_fragments<kKT>(s, pa);
}

// O_w += P V_w: the tile's rows read MN-major, columns 256w .. 256w + 255 (four 64-column blocks, LBO apart), 4
// steps of 16 keys (SBO = 8 keys). Issued, committed and waited for.
__device__ __forceinline__ void accumulate_pv(float* o, const uint32_t (&pa)[kKT / 16][4], uint32_t sK, int w) {
  fence_registers<128>(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKT / 16; ++kk) wgmma_rs_n256(o, pa[kk], smem_desc(sK + w * (kHalf / 64) * (kKT * 128) + kk * 16 * 128, kKT * 128, 1024));
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers<128>(o);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

__global__ void __launch_bounds__(kThreads, 1) sparse_attention_wgmma_kernel(const __grid_constant__ Dsv4SparseAttention a, __nv_bfloat16* __restrict__ out) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // wgmma is sm_90a's
#else
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t sQ = (raw + 1023u) & ~1023u, sK0 = sQ + kQBytes, sX = sK0 + 2 * kTileBytes;  // swizzle atoms: 1024-aligned
  uint8_t* valid0 = smem_raw + (sX + 2 * kXBytes - raw);  // [2][kKT]
  const int w = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, t = lane % 4;
  const Dsv4QueryKeys<kD> qk = dsv4_query_keys<kD>(a);
  const int n_tiles = (qk.n_slots + kKT - 1) / kKT;

  for (int i = threadIdx.x; i < 64 * (kD / 8); i += kThreads) {
    const int r = i / (kD / 8), c = i % (kD / 8);
    const bool ok = r < a.H;
    cp_async16(sQ + tile_offset(64, r, c), a.q + (qk.qi * a.H + (ok ? r : 0)) * kD + c * 8, ok);
  }
  cp_async_commit();
  load_keys(qk, 0, sK0, valid0);

  const int row0 = warp * 16 + lane / 4;  // this thread's heads: row0 and row0 + 8
  float o[kHalf / 2], s[kKT / 2];
#pragma unroll
  for (int i = 0; i < kHalf / 2; ++i) o[i] = 0.0f;
  // the sink is one more logit: the running max starts at it, the running sum at its weight exp(sink - max) = 1
  // (counted once per row: by the thread of column 0)
  float m_run[2], l_run[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m_run[h] = (row0 + 8 * h < a.H ? a.sinks[row0 + 8 * h] : 0.0f) * kLog2e;
    l_run[h] = t == 0 ? 1.0f : 0.0f;
  }
  const float scale_log2 = a.scale * kLog2e;
  uint32_t pa[kKT / 16][4];

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    cp_async_wait<0>();  // this tile (and on the first, Q)
    fence_async_shared();
    __syncthreads();  // every copy visible; both warpgroups are done with the other stage and with sX
    const uint32_t sK = sK0 + stage * kTileBytes;
    issue_partial_scores(s, sQ, sK, w);
    if (tile + 1 < n_tiles) load_keys(qk, tile + 1, sK0 + (stage ^ 1) * kTileBytes, valid0 + (stage ^ 1) * kKT);
    scores_ready(s);
    sum_halves(s, sX, w);
    softmax_tile(s, valid0 + stage * kKT, t, scale_log2, m_run, l_run, o, pa);
    accumulate_pv(o, pa, sK, w);
  }
  cp_async_wait<0>();
  store_normalized_rows<kHalf>(o, l_run, row0, a.H, kD, int64_t(w) * kHalf, t, out + qk.qi * a.H * kD);
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
