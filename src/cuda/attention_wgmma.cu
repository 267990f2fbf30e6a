// Causal flash attention on Hopper's warpgroup tensor cores (wgmma), head_dim 128, bf16 in/out, f32
// scores and softmax statistics: the same online-softmax algorithm as attention.cu (its CPU twin is
// the same f64 reference), with the products issued per warpgroup as m64n128k16 wgmma instead of
// per warp as m16n8k16 mma.sync. A block is 2 warpgroups x 64 query rows of one head; K and V tiles
// of 128 keys are copied into shared memory (cp.async, double-buffered) in the 128-byte-swizzled
// layouts wgmma reads: K rows K-major for S = Q K^T, V rows read as MN-major (transposed) for O += P V.
// P stays in registers: an S accumulator fragment is exactly a wgmma A fragment. Built for sm_90a only
// (wgmma); other targets get a stub that reports it. A second kernel, the default, runs the two warpgroups
// half a tile apart so that one's softmax overlaps the other's products (PDBRIDGE_ATTN_WGMMA=1: the first).
// FlashAttention-3's intra-warpgroup overlap (each warpgroup's softmax of tile j under its own P V of tile
// j-1) was measured as a third schedule on the H200 and was slower than the ping-pong (23,838 vs 24,586 tok/s
// at 32K, same run; commit 1cdd595 has it).
#include "cuda/attention.cuh"

#include <stdexcept>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <string>

#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/device_helpers.cuh"
#include "cuda/wgmma.cuh"

namespace pdb::cuda {
namespace {

constexpr int kD = 128, kRowsPerGroup = 64, kGroups = 2, kKeys = 128, kThreads = 128 * kGroups;
constexpr uint32_t kQBytes = kRowsPerGroup * kD * 2;  // one warpgroup's Q: 16 KB
constexpr uint32_t kKVBytes = kKeys * kD * 2;         // one K or V tile: 32 KB
constexpr int kSmemBytes = int(kGroups * kQBytes + 4 * kKVBytes) + 1024;  // + alignment slack

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Byte offset of element (row, col) of a rows x 128 bf16 tile stored as two 64-column halves, each
// rows x 128 bytes with its 16-byte chunks XOR-swizzled by (row % 8): CUTLASS's Swizzle<3,4,3>
// atoms, K-major for Q and K (col = head_dim index), and the MN-major view of V (row = key).
__device__ __forceinline__ uint32_t tile_offset(int rows, int row, int chunk /* 0..15 */) {
  return uint32_t((chunk / 8) * rows * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) * 16));
}

__device__ __forceinline__ void fence_operands(float* r) { fence_registers<64>(r); }


// S = Q K^T for one warpgroup's 64 rows and one 128-key tile, issued and committed, not waited for:
// 8 steps of 16 head_dim columns; a step moves 32 bytes inside a swizzle atom, and the second four
// steps read the second 64-column half.
__device__ __forceinline__ void issue_qk(float* sc, uint32_t sQg, uint32_t sK) {
  fence_operands(sc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t off = (kk % 4) * 32;
    const uint64_t da = smem_desc(sQg + (kk / 4) * (kRowsPerGroup * 128) + off, 16, 1024);
    const uint64_t db = smem_desc(sK + (kk / 4) * (kKeys * 128) + off, 16, 1024);
    wgmma_ss_n128(sc, da, db, kk > 0);
  }
  wgmma_commit();
}

// O += P V for one tile, issued and committed, not waited for: 8 steps of 16 keys; P's fragment for
// keys 16kk..16kk+15 is S blocks 2kk and 2kk+1. V is read transposed (MN-major): LBO = the 64-column
// halves, SBO = 8 keys.
__device__ __forceinline__ void issue_pv(float* o, const uint32_t (&pa)[kKeys / 16][4], uint32_t sV) {
  fence_operands(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) wgmma_rs_n128(o, pa[kk], smem_desc(sV + kk * 16 * 128, kKeys * 128, 1024));
  wgmma_commit();
}

// 2^x in one MUFU instruction. exp2f (no fast-math) wraps the same instruction in a range check and two
// multiplies so that results below 2^-126 stay denormal; here such a P is 0, which changes nothing a bf16 P
// could hold, and the softmax runs under the other warpgroup's products only if it is short.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The online softmax of one tile's scores (in sc, complete, not yet scaled) for this thread's two rows, in
// place: causal mask, running max and sum (in log2 units of the scaled scores), P = 2^(scaled score - max).
// Returns through corr the factor O must be rescaled by before this tile's P V is added. The scale is folded into
// one FMA per score: the max of the raw scores, scaled, is the max of the scaled ones (scale > 0).
__device__ __forceinline__ void softmax_scores(float* sc, int64_t key0, bool needs_mask, const int64_t (&qpos)[2], int t, float scale_log2,
                                               float (&m_run)[2], float (&l_run)[2], float (&corr)[2]) {
  if (needs_mask) {
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (key0 + j * 8 + 2 * t + (e & 1) > qpos[e >> 1]) sc[j * 4 + e] = -INFINITY;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float raw = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) raw = fmaxf(raw, fmaxf(sc[j * 4 + 2 * h], sc[j * 4 + 2 * h + 1]));
    raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 1));
    raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 2));
    const float mx = fmaxf(m_run[h], raw * scale_log2);
    // A row with every key masked so far keeps m = -inf: exp2(-inf - -inf) would be NaN.
    corr[h] = mx == -INFINITY ? 1.0f : exp2_ftz(m_run[h] - mx);
    const float neg_base = mx == -INFINITY ? 0.0f : -mx;
    m_run[h] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
      sc[j * 4 + 2 * h] = exp2_ftz(fmaf(sc[j * 4 + 2 * h], scale_log2, neg_base));
      sc[j * 4 + 2 * h + 1] = exp2_ftz(fmaf(sc[j * 4 + 2 * h + 1], scale_log2, neg_base));
      sum += sc[j * 4 + 2 * h] + sc[j * 4 + 2 * h + 1];
    }
    l_run[h] = l_run[h] * corr[h] + sum;
  }
}

__device__ __forceinline__ void rescale_o(float* o, const float (&corr)[2]) {
#pragma unroll
  for (int j = 0; j < kD / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j * 4 + e] *= corr[e >> 1];
}

// One tile's softmax step, called with no product in flight: O rescaled, then all of P packed before the
// next product, so no product waits on registers still being written.
__device__ __forceinline__ void softmax_tile(float* sc, int64_t key0, bool needs_mask, const int64_t (&qpos)[2], int t, float scale_log2,
                                             float (&m_run)[2], float (&l_run)[2], float* o, uint32_t (&pa)[kKeys / 16][4]) {
  float corr[2];
  softmax_scores(sc, key0, needs_mask, qpos, t, scale_log2, m_run, l_run, corr);
  rescale_o(o, corr);
  pack_p_fragments<kKeys>(sc, pa);
}

// What one block of either kernel works on: 2 x 64 query rows of one head (heaviest blocks first),
// the keys they see, and this thread's place in the wgmma accumulator layout (warp w of a warpgroup
// owns rows 16w..16w+15; per 8-column block j the thread holds (g, 8j+2t), (g, 8j+2t+1), (g+8, 8j+2t),
// (g+8, 8j+2t+1)).
struct BlockPlan {
  int group, t, head;
  int64_t q_first, n_keys, row_in_block;
  int n_tiles;
  int64_t qpos[2];
  const __nv_bfloat16* kh;
  const __nv_bfloat16* vh;
};

__device__ __forceinline__ BlockPlan plan_block(const AttentionShape& s, const __nv_bfloat16* k, const __nv_bfloat16* v) {
  BlockPlan b;
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4;
  b.group = threadIdx.x / 128;
  b.t = lane % 4;
  b.head = int(blockIdx.y);
  const int kvh = b.head / (s.n_heads / s.n_kv_heads);
  b.q_first = int64_t(int(gridDim.x) - 1 - int(blockIdx.x)) * (kGroups * kRowsPerGroup);
  b.n_keys = s.pos0 + (s.n_q < b.q_first + kGroups * kRowsPerGroup ? s.n_q : b.q_first + kGroups * kRowsPerGroup);
  b.n_tiles = int((b.n_keys + kKeys - 1) / kKeys);
  b.row_in_block = int64_t(b.group) * kRowsPerGroup + warp * 16 + g;
  b.qpos[0] = s.pos0 + b.q_first + b.row_in_block;
  b.qpos[1] = b.qpos[0] + 8;
  b.kh = k + int64_t(kvh) * s.kv_capacity * kD;
  b.vh = v + int64_t(kvh) * s.kv_capacity * kD;
  return b;
}

// Q: warpgroup w's 64 rows in its own swizzled region; one cp.async group.
__device__ __forceinline__ void load_q(uint32_t sQ, const __nv_bfloat16* __restrict__ q, const AttentionShape& s, const BlockPlan& b) {
  const int64_t q_stride = int64_t(s.n_heads) * kD;
  for (int i = threadIdx.x; i < kGroups * kRowsPerGroup * 16; i += kThreads) {
    const int row = i / 16, c = i % 16, w = row / kRowsPerGroup, r = row % kRowsPerGroup;
    const int64_t pos = b.q_first + row;
    const bool ok = pos < s.n_q;
    cp_async16(sQ + w * kQBytes + tile_offset(kRowsPerGroup, r, c), q + (ok ? pos * q_stride + int64_t(b.head) * kD + c * 8 : 0), ok);
  }
  cp_async_commit();
}

// One 128-key tile of K and V into a stage; one cp.async group. Keys past the block's last are zeros.
__device__ __forceinline__ void load_kv(uint32_t sK, uint32_t sV, const BlockPlan& b, int tile) {
  const int64_t k0 = int64_t(tile) * kKeys;
  for (int i = threadIdx.x; i < kKeys * 16; i += kThreads) {
    const int r = i / 16, c = i % 16;
    const bool ok = k0 + r < b.n_keys;
    const int64_t src = ok ? (k0 + r) * kD + c * 8 : 0;
    cp_async16(sK + tile_offset(kKeys, r, c), b.kh + src, ok);
    cp_async16(sV + tile_offset(kKeys, r, c), b.vh + src, ok);
  }
  cp_async_commit();
}

// The fp8 K/V option: one 128-key tile of e4m3 K and V rows (128 bytes each) into a staging area,
// row-major, K then V (16 KB each); one cp.async group. Keys past the block's last are zeros.
__device__ __forceinline__ void load_kv_fp8(uint32_t sStage, const uint8_t* k8, const uint8_t* v8, const BlockPlan& b, int tile) {
  const int64_t k0 = int64_t(tile) * kKeys;
  for (int i = threadIdx.x; i < kKeys * (kD / 16); i += kThreads) {
    const int r = i / (kD / 16), c = i % (kD / 16);
    const bool ok = k0 + r < b.n_keys;
    const int64_t src = ok ? (k0 + r) * kD + c * 16 : 0;
    cp_async16(sStage + r * kD + c * 16, k8 + src, ok);
    cp_async16(sStage + kKeys * kD + r * kD + c * 16, v8 + src, ok);
  }
  cp_async_commit();
}

// A staged fp8 tile into the bf16 tiles wgmma reads: code x its row's scale, rounded to bf16, written
// in the swizzled layout of load_kv. Ordinary shared stores: the caller fences them for the async proxy.
__device__ __forceinline__ void convert_kv_fp8(uint32_t sStage, uint32_t sK, uint32_t sV, const float* ks, const float* vs, const BlockPlan& b,
                                               int tile) {
  const int64_t k0 = int64_t(tile) * kKeys;
  for (int i = threadIdx.x; i < 2 * kKeys * (kD / 16); i += kThreads) {
    const bool is_v = i >= kKeys * (kD / 16);
    const int j = i % (kKeys * (kD / 16)), r = j / (kD / 16), c = j % (kD / 16);
    const float scale = k0 + r < b.n_keys ? (is_v ? vs : ks)[k0 + r] : 0.0f;
    uint32_t w[4];
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(sStage + (is_v ? kKeys * kD : 0) + r * kD + c * 16));
    uint32_t out[8];
#pragma unroll
    for (int q = 0; q < 4; ++q) fp8x4_to_bf16(w[q], scale, out + 2 * q);
    const uint32_t dst = is_v ? sV : sK;
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + tile_offset(kKeys, r, 2 * c)), "r"(out[0]), "r"(out[1]), "r"(out[2]), "r"(out[3]) : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + tile_offset(kKeys, r, 2 * c + 1)), "r"(out[4]), "r"(out[5]), "r"(out[6]), "r"(out[7]) : "memory");
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL (device helpers)

// kFp8KV: K and V are the engine's fp8 option (e4m3 rows + one scale per head row, ks/vs): each tile is
// staged as fp8 (double-buffered, cp.async) and converted into one bf16 tile before its products, in
// the same shared memory as the bf16 kernel's two stages.
template <bool kFp8KV>
__global__ void __launch_bounds__(kThreads, 1)
flash_attention_wgmma(const __nv_bfloat16* __restrict__ q, const void* __restrict__ k, const void* __restrict__ v, const float* __restrict__ ks,
                      const float* __restrict__ vs, __nv_bfloat16* __restrict__ out, AttentionShape s) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // only the sm_90a build has this kernel; the launcher checks the device first
#else
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sbase = (uint32_t(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;  // swizzle atoms: 1024-aligned
  // bf16: K stages 0/1 then V stages 0/1. fp8: one bf16 K and V tile, then two fp8 staging areas.
  const uint32_t sQ = sbase, sK0 = sQ + kGroups * kQBytes, sV0 = sK0 + (kFp8KV ? 1 : 2) * kKVBytes, sStage0 = sK0 + 2 * kKVBytes;
  const BlockPlan b = plan_block(s, static_cast<const __nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(v));
  const int kvh = b.head / (s.n_heads / s.n_kv_heads);
  const uint8_t* k8 = static_cast<const uint8_t*>(k) + int64_t(kvh) * s.kv_capacity * kD;
  const uint8_t* v8 = static_cast<const uint8_t*>(v) + int64_t(kvh) * s.kv_capacity * kD;
  const float* ksh = kFp8KV ? ks + int64_t(kvh) * s.kv_capacity : nullptr;
  const float* vsh = kFp8KV ? vs + int64_t(kvh) * s.kv_capacity : nullptr;
  load_q(sQ, q, s, b);
  if constexpr (kFp8KV) load_kv_fp8(sStage0, k8, v8, b, 0);
  else load_kv(sK0, sV0, b, 0);

  float o[64], sc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  const float scale_log2 = s.scale * 1.4426950408889634f;
  const uint32_t sQg = sQ + b.group * kQBytes;
  const int n_tiles = b.n_tiles;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    uint32_t sK = sK0, sV = sV0;
    if constexpr (kFp8KV) {
      cp_async_wait<0>();  // this tile's fp8 rows (and Q)
      __syncthreads();     // every copy visible; the bf16 tile's last products were waited for
      if (tile + 1 < n_tiles) load_kv_fp8(sStage0 + (stage ^ 1) * kKVBytes, k8, v8, b, tile + 1);
      convert_kv_fp8(sStage0 + stage * kKVBytes, sK, sV, ksh, vsh, b, tile);
      fence_async_shared();  // ordinary stores, read next by wgmma
      __syncthreads();
    } else {
      if (tile + 1 < n_tiles) { load_kv(sK0 + (stage ^ 1) * kKVBytes, sV0 + (stage ^ 1) * kKVBytes, b, tile + 1); cp_async_wait<1>(); }
      else cp_async_wait<0>();
      fence_async_shared();
      __syncthreads();
      sK = sK0 + stage * kKVBytes;
      sV = sV0 + stage * kKVBytes;
    }

    issue_qk(sc, sQg, sK);
    wgmma_wait<0>();
    fence_operands(sc);

    const int64_t key0 = int64_t(tile) * kKeys;
    uint32_t pa[kKeys / 16][4];
    softmax_tile(sc, key0, key0 + kKeys - 1 > s.pos0 + b.q_first, b.qpos, b.t, scale_log2, m_run, l_run, o, pa);
    issue_pv(o, pa, sV);
    wgmma_wait<0>();
    fence_operands(o);
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }
  store_normalized_rows<kD>(o, l_run, b.q_first + b.row_in_block, s.n_q, int64_t(s.n_heads) * kD, int64_t(b.head) * kD, b.t, out);
#endif
}

// The same product with the two warpgroups half a tile apart, so that one's softmax runs while the
// other's products hold the tensor cores (FlashAttention-3's "ping-pong", here without a producer
// warp): in the interval of tile j, warpgroup 0 issues PV(j-1) and QK(j), then runs softmax(j);
// warpgroup 1 runs softmax(j-1), then issues PV(j-1) and QK(j). Both need tile j-1's V and tile j's
// K in the same interval, so K/V take three shared-memory stages (225 KB with Q). Each warpgroup still
// computes QK(j), softmax(j), PV(j) in that order: the results are the other kernel's.
constexpr int kStagesPingPong = 3;
constexpr int kSmemBytesPingPong = int(kGroups * kQBytes + 2 * kStagesPingPong * kKVBytes) + 1024;

__global__ void __launch_bounds__(kThreads, 1)
flash_attention_wgmma_pingpong(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v,
                               __nv_bfloat16* __restrict__ out, AttentionShape s) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // only the sm_90a build has this kernel; the launcher checks the device first
#else
  extern __shared__ uint8_t smem_raw[];
  const uint32_t sbase = (uint32_t(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;  // swizzle atoms: 1024-aligned
  const uint32_t sQ = sbase, sK0 = sQ + kGroups * kQBytes, sV0 = sK0 + kStagesPingPong * kKVBytes;
  const BlockPlan b = plan_block(s, k, v);
  auto load_tile = [&](int tile) {
    const int stage = tile % kStagesPingPong;
    load_kv(sK0 + stage * kKVBytes, sV0 + stage * kKVBytes, b, tile);
  };
  load_q(sQ, q, s, b);
  load_tile(0);

  float o[64], sc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  uint32_t pa[kKeys / 16][4];
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  const float scale_log2 = s.scale * 1.4426950408889634f;
  const uint32_t sQg = sQ + b.group * kQBytes;
  const bool tensor_first = b.group == 0;
  const int n_tiles = b.n_tiles;
  auto needs_mask = [&](int64_t key0) { return key0 + kKeys - 1 > s.pos0 + b.q_first; };

  for (int tile = 0; tile < n_tiles; ++tile) {
    cp_async_wait<0>();  // this tile, issued an interval ago (and Q)
    fence_async_shared();
    __syncthreads();  // every copy visible; tile-2's stage free: its last products were waited for
    if (tile + 1 < n_tiles) load_tile(tile + 1);
    const uint32_t sK = sK0 + (tile % kStagesPingPong) * kKVBytes;
    const uint32_t sV_prev = sV0 + ((tile + kStagesPingPong - 1) % kStagesPingPong) * kKVBytes;
    const int64_t key0 = int64_t(tile) * kKeys;
    if (tensor_first) {
      if (tile > 0) issue_pv(o, pa, sV_prev);
      issue_qk(sc, sQg, sK);
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(sc);
      softmax_tile(sc, key0, needs_mask(key0), b.qpos, b.t, scale_log2, m_run, l_run, o, pa);
    } else {
      if (tile > 0) {
        softmax_tile(sc, key0 - kKeys, needs_mask(key0 - kKeys), b.qpos, b.t, scale_log2, m_run, l_run, o, pa);
        issue_pv(o, pa, sV_prev);
      }
      issue_qk(sc, sQg, sK);
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(sc);
    }
  }
  const int64_t last_key0 = int64_t(n_tiles - 1) * kKeys;
  if (!tensor_first) softmax_tile(sc, last_key0, needs_mask(last_key0), b.qpos, b.t, scale_log2, m_run, l_run, o, pa);
  issue_pv(o, pa, sV0 + ((n_tiles - 1) % kStagesPingPong) * kKVBytes);
  wgmma_wait<0>();
  fence_operands(o);
  store_normalized_rows<kD>(o, l_run, b.q_first + b.row_in_block, s.n_q, int64_t(s.n_heads) * kD, int64_t(b.head) * kD, b.t, out);
#endif
}

}  // namespace

bool wgmma_attention_supported(const AttentionShape& s) { return s.head_dim == kD && s.v_dim() == kD && device_is_sm90(); }

void causal_attention_wgmma(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                            const AttentionShape& s, cudaStream_t stream, WgmmaSchedule schedule) {
  if (!wgmma_attention_supported(s)) throw std::invalid_argument("attention: the wgmma kernel needs head_dim 128 on an sm_90 GPU");
  if (s.n_q <= 0) return;
  static bool configured = false;
  if (!configured) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_wgmma<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    PDB_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_wgmma<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    PDB_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_wgmma_pingpong, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytesPingPong));
    configured = true;
  }
  const int64_t rows = kGroups * kRowsPerGroup;
  const dim3 grid(unsigned((s.n_q + rows - 1) / rows), unsigned(s.n_heads));
  if (schedule == WgmmaSchedule::kPingPong) flash_attention_wgmma_pingpong<<<grid, kThreads, kSmemBytesPingPong, stream>>>(q, k, v, out, s);
  else flash_attention_wgmma<false><<<grid, kThreads, kSmemBytes, stream>>>(q, k, v, nullptr, nullptr, out, s);
  PDB_CUDA_LAUNCHED();
}

void causal_attention_fp8kv(const __nv_bfloat16* q, const uint8_t* k, const uint8_t* v, const float* k_scale, const float* v_scale,
                            __nv_bfloat16* out, const AttentionShape& s, cudaStream_t stream) {
  if (!wgmma_attention_supported(s)) throw std::invalid_argument("attention: fp8 K/V needs head_dim 128 on an sm_90 GPU (the wgmma kernel)");
  if (s.n_q <= 0) return;
  if (s.n_kv_heads <= 0 || s.n_heads % s.n_kv_heads != 0) throw std::invalid_argument("attention: heads not a multiple of kv heads");
  if (s.pos0 + s.n_q > s.kv_capacity) throw std::invalid_argument("attention: keys past the cache capacity");
  static bool configured = false;
  if (!configured) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_wgmma<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    configured = true;
  }
  const int64_t rows = kGroups * kRowsPerGroup;
  const dim3 grid(unsigned((s.n_q + rows - 1) / rows), unsigned(s.n_heads));
  flash_attention_wgmma<true><<<grid, kThreads, kSmemBytes, stream>>>(q, k, v, k_scale, v_scale, out, s);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
