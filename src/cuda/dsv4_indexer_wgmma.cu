// The FP8 lightning indexer's scores (dsv4_indexer.cuh indexer_scores_fp8) on Hopper's warpgroup tensor cores:
// m64n64k32 e4m3 wgmma into f32 accumulators (its adds inside the tensor core keep fewer bits than f32: within
// 8e-4 of a row's largest score against the twin, measured). Measured first with mma.sync m16n8k32 e4m3 (the fragments of the
// bf16 kernel with bytes for halves): on the H200 it was no faster than the bf16 kernel (0.89-0.97x, docs/RESULTS.md)
// -- Hopper's FP8 rate is wgmma's. A block is 2 warpgroups over 256 (query, head) rows, QPB queries of HP rows
// (a query's heads, then zero rows to HP): each warpgroup issues two m64 products against the same 64-row tile
// of LID codes and reduces the first while the second runs. Both operands sit in shared memory K-major with
// 128-byte rows (one swizzle atom per row: chunk c of row r at c ^ (r % 8), swz() with 8 chunks), so a k-step of
// 32 codes moves the descriptors 32 bytes. Per column the scores are w' max(0, s) summed over a warp's 16 rows by
// a reduce-scatter across the lane groups (14 shuffles for 64 columns, not 48), over the query's 16-row slots in
// shared memory, times the row's scale (PDBRIDGE_DSV4_INDEXER_A=smem|registers). The default kernel (below) turns the product
// around: those m64n64 products read 4 KB of shared memory per 32 tensor-core cycles, about shared memory's whole
// bandwidth, and their ReLU sums cost ~4 instructions per score against the product's 1/32 cycle. Built for sm_90a
// only; other targets get a kernel that traps.
#include "cuda/dsv4_indexer.cuh"
#include "cuda/dsv4_indexer_keys.cuh"

#include <stdexcept>
#include <string>

#include "common/tuning.h"
#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"
#include "cuda/wgmma.cuh"

namespace pdb::cuda {
namespace {

constexpr int kD = 128, kRows = 256, kKT = 64, kThreads = 256, kSlots = kRows / 16;
constexpr uint32_t kQBytes = kRows * kD, kTileBytes = kKT * kD;
constexpr int kSmemBytes = int(kQBytes + 2 * kTileBytes) + kSlots * kKT * 4 + 1024;  // + alignment slack (the swizzle's 1024)

__device__ __forceinline__ int64_t visible_to(const IndexerShape& sh, int64_t t) {
  const int64_t v = (sh.pos0 + t + 1) / sh.ratio;
  return v < sh.n_blocks ? v : sh.n_blocks;
}

// A block's (query, head) rows of e4m3 codes into shared memory (n_rows of 128 bytes, swizzled): a query's heads, then
// zero rows to HP; rows past the chunk zero.
template <int HP>
__device__ __forceinline__ void load_query_rows(uint32_t sQ, int n_rows, const uint8_t* q, const IndexerShape& sh, int64_t qb) {
  for (int i = threadIdx.x; i < n_rows * 8; i += blockDim.x) {
    const int r = i / 8, c = i % 8, h = r % HP;
    const int64_t t = qb + r / HP;
    const bool ok = t < sh.n_q && h < sh.heads;
    cp_async16(sQ + swz(r, c, 8), q + (ok ? (t * sh.heads + h) * kD + c * 16 : 0), ok);
  }
}
// One tile of 64 LID rows' codes into a stage (rows past the prompt's blocks zero).
__device__ __forceinline__ void load_key_tile(uint32_t sK, const uint8_t* rows, const IndexerShape& sh, int tile) {
  const int64_t b0 = int64_t(tile) * kKT;
  for (int i = threadIdx.x; i < kKT * 8; i += blockDim.x) {
    const int r = i / 8, c = i % 8;
    const bool ok = b0 + r < sh.n_blocks;
    cp_async16(sK + swz(r, c, 8), rows + (ok ? (b0 + r) * kD + c * 16 : 0), ok);
  }
}

// The blocks past the reach of a block's last query: visible to none of its qpb queries.
__device__ __forceinline__ void fill_unreached(const IndexerShape& sh, int64_t qb, int qpb, int64_t from, float* scores) {
  for (int qq = 0; qq < qpb; ++qq) {
    const int64_t t = qb + qq;
    if (t >= sh.n_q) break;
    for (int64_t b = from + threadIdx.x; b < sh.n_blocks; b += blockDim.x) scores[t * sh.n_blocks + b] = -INFINITY;
  }
}

// The weights of a block's rows as m16n8k16 B fragments, [warpgroup][k-step 16][lane] (dsv4_indexer_keys.cuh b_word).
template <int HP>
__device__ void build_bfrag(const IndexerShape& sh, int64_t qb, const float* q_scale, const float* w, uint2* bfrag) {
  for (int i = threadIdx.x; i < 2 * 16 * 32; i += blockDim.x) {
    const int wg = i / 512, sg = (i / 32) % 16, lane = i % 32;
    const int64_t t = qb + wg * (indexer_keys::kGroupRows / HP) + indexer_keys::query_of_step(HP, sg);
    const bool ok = t < sh.n_q;
    const float* wt = w + (ok ? t * sh.heads : 0);
    const float* st = q_scale + (ok ? t * sh.heads : 0);
    bfrag[i] = make_uint2(indexer_keys::b_word(HP, sh.heads, ok, wt, st, sg, lane, 0), indexer_keys::b_word(HP, sh.heads, ok, wt, st, sg, lane, 1));
  }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// K-major operand with the 128-byte swizzle: 8-row core groups 1024 bytes apart (LBO unused by this mode).
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t addr) { return smem_desc(addr, 16, 1024); }
__device__ __forceinline__ void fence_acc(float* r) { fence_registers<32>(r); }
// D(64x64, f32) (+)= A(64x32, e4m3, shared, K-major) * B(32x64, e4m3, shared, K-major)
__device__ __forceinline__ void wgmma_e4m3(float* d, uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate)
      : "memory");
}

// The same with A from registers (a[4]: the warp's 16 rows x 32 codes, mma.m16n8k32's A fragment): the queries are
// the block's for the whole prompt, so they are read from shared memory once, not by every product.
__device__ __forceinline__ void wgmma_e4m3_rs(float* d, const uint32_t* a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)
      : "memory");
}

// D(64x128, f32) (+)= A(64x32, e4m3, registers) * B(32x128, e4m3, shared, K-major): the keys' scores against 128
// (query, head) rows.
__device__ __forceinline__ void wgmma_e4m3_rs_n128(float* d, const uint32_t* a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)
      : "memory");
}

// bf16x2 of max(0, lo) and max(0, hi) in one instruction (lo in the low half: the first of an A fragment's pair)
__device__ __forceinline__ uint32_t relu_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// One m64 product's scores into its warp's 16-row slot: per thread 2 rows x 16 columns (column 8j + 2t + e of
// d[4j + e] and d[4j + 2 + e]); the reduce-scatter leaves lane group g with columns 8g + 2t and 8g + 2t + 1.
__device__ __forceinline__ void reduce_to_slot(const float* d, float w0, float w1, int lane, float* slot_row) {
  float v[16];
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) v[2 * j + e] = w0 * fmaxf(d[4 * j + e], 0.0f) + w1 * fmaxf(d[4 * j + 2 + e], 0.0f);
#pragma unroll
  for (int k = 0; k < 8; ++k) {  // lane bit 4 (group bit 2): keep one half, add the partner's
    const bool hi = lane & 16;
    const float send = hi ? v[k] : v[k + 8], keep = hi ? v[k + 8] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const bool hi = lane & 8;
    const float send = hi ? v[k] : v[k + 4], keep = hi ? v[k + 4] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const bool hi = lane & 4;
    const float send = hi ? v[k] : v[k + 2], keep = hi ? v[k + 2] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
  }
  // v[k] is the column of index 2 g + k in the order 2j + e: j = g, e = k
  *reinterpret_cast<float2*>(slot_row + 8 * (lane / 4) + 2 * (lane % 4)) = make_float2(v[0], v[1]);
}

// One 128-row half of a warpgroup's product, its heads summed on the tensor cores: the accumulator (the warp's 16
// keys x the half's 128 rows) is, as bf16 ReLUs, the A fragments of eight m16n8k16 products whose B is the rows'
// weights (w x the q row's scale, bf16 hi and lo parts in columns 2 slot and 2 slot + 1, zero for the other slots'
// rows: bfrag, built once per block). A k-step's 16 rows are one query's, so its product adds into the accumulator
// of that query's group of four.
template <int HP, int HALF, int NACC>
__device__ __forceinline__ void sum_heads(const float* d, const uint2* bfrag, int lane, float (&out)[NACC][4]) {
  using namespace indexer_keys;
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const int sg = HALF * 8 + s;
    uint32_t pa[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pa[j] = relu_bf16x2(d[a_source(s, j)], d[a_source(s, j) + 1]);
    const uint2 b = bfrag[sg * 32 + lane];
    mma_bf16(out[group_of_step(HP, sg)], pa, b.x, b.y);
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <int HP, bool a_in_registers>
__global__ void __launch_bounds__(kThreads, 2) indexer_fp8_wgmma_kernel(const uint8_t* __restrict__ q, const float* __restrict__ q_scale,
                                                                    const uint8_t* __restrict__ rows, const float* __restrict__ row_scale,
                                                                    const float* __restrict__ w, float* __restrict__ scores, IndexerShape sh) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int QPB = kRows / HP, SPQ = HP / 16;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t sQ = (raw + 1023) & ~1023u, sK0 = sQ + kQBytes;
  float* red = reinterpret_cast<float*>(smem_raw + (sK0 + 2 * kTileBytes - raw));  // [kSlots x kKT]
  __shared__ int64_t vis[QPB];
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int H = sh.heads;
  const int64_t qb = (int64_t(gridDim.x) - 1 - blockIdx.x) * QPB;  // the block's first query; the most blocks first
  const int64_t last_q = (qb + QPB < sh.n_q ? qb + QPB : sh.n_q) - 1;
  const int n_tiles = int((visible_to(sh, last_q) + kKT - 1) / kKT);
  if (threadIdx.x < QPB) vis[threadIdx.x] = qb + threadIdx.x < sh.n_q ? visible_to(sh, qb + threadIdx.x) : 0;
  load_query_rows<HP>(sQ, kRows, q, sh, qb);
  cp_async_commit();
  auto load = [&](int tile, int stage) {
    load_key_tile(sK0 + stage * kTileBytes, rows, sh, tile);
    cp_async_commit();
  };
  if (n_tiles > 0) load(0, 0);
  // this thread's rows of the warpgroup's two m64 products: w x the q row's scale (0 for padding rows)
  float wq[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int r = wg * 128 + i * 64 + warp * 16 + lane / 4 + 8 * k, h = r % HP;
      const int64_t t = qb + r / HP;
      wq[i][k] = t < sh.n_q && h < H ? w[t * H + h] * q_scale[t * H + h] : 0.0f;
    }
  float acc[2][32];
  uint32_t qa[2][kD / 32][4];  // this warp's query rows as A fragments, read once (PDBRIDGE_DSV4_INDEXER_A=registers)
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // this tile landed for every thread; every thread is past the previous tile's `red`
    if (tile + 1 < n_tiles) load(tile + 1, stage ^ 1);
    if (a_in_registers && tile == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int kk = 0; kk < kD / 32; ++kk) {
          // ldmatrix's four 8 x 16-byte matrices: rows 0-7 / 8-15 of the warp's 16, bytes 0-15 / 16-31 of the k-step
          const int r = wg * 128 + i * 64 + warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, chunk = 2 * kk + (lane >> 4);
          ldmatrix_x4(sQ + swz(r, chunk, 8), qa[i][kk][0], qa[i][kk][1], qa[i][kk][2], qa[i][kk][3]);
        }
    }
    const uint32_t sK = sK0 + stage * kTileBytes;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      fence_acc(acc[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 32; ++kk) {
        if constexpr (a_in_registers)
          wgmma_e4m3_rs(acc[i], qa[i][kk], kmajor_desc(sK + kk * 32), kk > 0);
        else
          wgmma_e4m3(acc[i], kmajor_desc(sQ + (wg * 128 + i * 64) * kD + kk * 32), kmajor_desc(sK + kk * 32), kk > 0);
      }
      wgmma_commit();
    }
    wgmma_wait<1>();
    fence_acc(acc[0]);
    reduce_to_slot(acc[0], wq[0][0], wq[0][1], lane, red + (wg * 8 + warp) * kKT);
    wgmma_wait<0>();
    fence_acc(acc[1]);
    reduce_to_slot(acc[1], wq[1][0], wq[1][1], lane, red + (wg * 8 + 4 + warp) * kKT);
    __syncthreads();
    for (int i = threadIdx.x; i < QPB * kKT; i += kThreads) {
      const int qq = i / kKT, col = i % kKT;
      const int64_t t = qb + qq, b = int64_t(tile) * kKT + col;
      if (t >= sh.n_q || b >= sh.n_blocks) continue;
      float v = -INFINITY;
      if (b < vis[qq]) {
        v = 0.0f;
#pragma unroll
        for (int k = 0; k < SPQ; ++k) v += red[(qq * SPQ + k) * kKT + col];
        v *= row_scale[b];
      }
      scores[t * sh.n_blocks + b] = v;
    }
  }
  cp_async_wait<0>();  // no copy outlives the block (the Q copy when there is no tile)
  fill_unreached(sh, qb, QPB, int64_t(n_tiles) * kKT, scores);
#else
  __trap();  // wgmma is sm_90a's
#endif
}

// The keys as the products' rows (the default): a block of two warpgroups holds 512
// (query, head) rows (256 per warpgroup, a query's heads then zero rows to HP) as the shared B operand, read by
// m64n128k32 products whose A is a 64-key tile in registers (ldmatrix, once per tile for both halves); the ReLU
// and the weighted sum over heads are one cvt per two scores and m16n8k16 products (sum_heads), not shuffles. The
// scores come out as four per thread and group: query slot lane % 4, keys lane / 4 and lane / 4 + 8 of its warp's 16.
constexpr int kKeyRows = 512, kKeyStages = 4, kBfragWords = 2 * 16 * 32;
constexpr int kKeySmemBytes = kKeyRows * kD + kKeyStages * int(kTileBytes) + kBfragWords * 8 + 1024;

template <int HP>
__global__ void __launch_bounds__(kThreads, 1) indexer_fp8_keys_kernel(const uint8_t* __restrict__ q, const float* __restrict__ q_scale,
                                                                     const uint8_t* __restrict__ rows, const float* __restrict__ row_scale,
                                                                     const float* __restrict__ w, float* __restrict__ scores, IndexerShape sh) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int QW = indexer_keys::kGroupRows / HP, QPB = 2 * QW, NACC = indexer_keys::groups(HP);
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t sQ = (raw + 1023) & ~1023u, sK0 = sQ + kKeyRows * kD;
  uint2* bfrag = reinterpret_cast<uint2*>(smem_raw + (sK0 + kKeyStages * kTileBytes - raw));  // [warpgroup][k-step 16][lane]
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int64_t qb = (int64_t(gridDim.x) - 1 - blockIdx.x) * QPB;  // the block's first query; the most blocks first
  const int64_t last_q = (qb + QPB < sh.n_q ? qb + QPB : sh.n_q) - 1;
  const int n_tiles = int((visible_to(sh, last_q) + kKT - 1) / kKT);
  load_query_rows<HP>(sQ, kKeyRows, q, sh, qb);
  cp_async_commit();
  auto load = [&](int tile) { load_key_tile(sK0 + (tile % kKeyStages) * kTileBytes, rows, sh, tile); };
#pragma unroll
  for (int s = 0; s < kKeyStages - 1; ++s) {
    if (s < n_tiles) load(s);
    cp_async_commit();
  }
  build_bfrag<HP>(sh, qb, q_scale, w, bfrag);
  int64_t vis[NACC];  // this thread's query of each group (its slot lane % 4): the blocks it sees
  int64_t tq[NACC];
#pragma unroll
  for (int a = 0; a < NACC; ++a) {
    const int slot = indexer_keys::score_slot(lane, a);
    tq[a] = slot < QW ? qb + wg * QW + slot : sh.n_q;
    vis[a] = tq[a] < sh.n_q ? visible_to(sh, tq[a]) : 0;
  }
  for (int tile = 0; tile < n_tiles; ++tile) {
    cp_async_wait<kKeyStages - 2>();
    fence_async_shared();
    __syncthreads();  // this tile (and the queries) landed for every thread; every thread is past the stage reloaded next
    if (tile + kKeyStages - 1 < n_tiles) load(tile + kKeyStages - 1);
    cp_async_commit();
    const uint32_t sK = sK0 + (tile % kKeyStages) * kTileBytes;
    float rs[2];  // this thread's two keys' scales, read before the products so that the load hides behind them
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t b = int64_t(tile) * kKT + indexer_keys::score_key(warp, lane, k);
      rs[k] = b < sh.n_blocks ? __ldg(row_scale + b) : 0.0f;
    }
    uint32_t ka[kD / 32][4];  // the warp's 16 keys as A fragments
#pragma unroll
    for (int kk = 0; kk < kD / 32; ++kk) {
      const int r = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, chunk = 2 * kk + (lane >> 4);
      ldmatrix_x4(sK + swz(r, chunk, 8), ka[kk][0], ka[kk][1], ka[kk][2], ka[kk][3]);
    }
    float acc[2][64];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      fence_registers<64>(acc[half]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kD / 32; ++kk)
        wgmma_e4m3_rs_n128(acc[half], ka[kk], kmajor_desc(sQ + (wg * 256 + half * 128) * kD + kk * 32), kk > 0);
      wgmma_commit();
    }
    float out[NACC][4];
#pragma unroll
    for (int a = 0; a < NACC; ++a) out[a][0] = out[a][1] = out[a][2] = out[a][3] = 0.0f;
    wgmma_wait<1>();
    fence_registers<64>(acc[0]);
    sum_heads<HP, 0>(acc[0], bfrag + wg * 512, lane, out);
    wgmma_wait<0>();
    fence_registers<64>(acc[1]);
    sum_heads<HP, 1>(acc[1], bfrag + wg * 512, lane, out);
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
      if (tq[a] >= sh.n_q) continue;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int64_t b = int64_t(tile) * kKT + indexer_keys::score_key(warp, lane, k);
        if (b >= sh.n_blocks) continue;
        scores[tq[a] * sh.n_blocks + b] = b < vis[a] ? (out[a][2 * k] + out[a][2 * k + 1]) * rs[k] : -INFINITY;
      }
    }
  }
  cp_async_wait<0>();  // no copy outlives the block
  fill_unreached(sh, qb, QPB, int64_t(n_tiles) * kKT, scores);
#else
  __trap();  // wgmma is sm_90a's
#endif
}

template <int HP, bool RS>
void launch(const uint8_t* q, const float* q_scale, const uint8_t* rows, const float* row_scale, const float* w, float* scores, const IndexerShape& sh,
            cudaStream_t stream) {
  static bool configured = false;  // once per process and instantiation
  if (!configured) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(indexer_fp8_wgmma_kernel<HP, RS>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    configured = true;
  }
  const int64_t blocks = (sh.n_q + kRows / HP - 1) / (kRows / HP);
  indexer_fp8_wgmma_kernel<HP, RS><<<unsigned(blocks), kThreads, kSmemBytes, stream>>>(q, q_scale, rows, row_scale, w, scores, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
}

template <int HP>
void launch_keys(const uint8_t* q, const float* q_scale, const uint8_t* rows, const float* row_scale, const float* w, float* scores,
                 const IndexerShape& sh, cudaStream_t stream) {
  static bool configured = false;  // once per process and instantiation
  if (!configured) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(indexer_fp8_keys_kernel<HP>, cudaFuncAttributeMaxDynamicSharedMemorySize, kKeySmemBytes));
    configured = true;
  }
  const int64_t blocks = (sh.n_q + kKeyRows / HP - 1) / (kKeyRows / HP);
  indexer_fp8_keys_kernel<HP><<<unsigned(blocks), kThreads, kKeySmemBytes, stream>>>(q, q_scale, rows, row_scale, w, scores, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
}

template <int HP>
void launch(const uint8_t* q, const float* q_scale, const uint8_t* rows, const float* row_scale, const float* w, float* scores, const IndexerShape& sh,
            cudaStream_t stream) {
  // the keys as A (the default: 1.2-1.3x the queries-as-A kernel at 32K-128K, docs/RESULTS.md session 39);
  // "smem" | "registers": the queries as A, from shared memory or as register fragments
  const std::string a = Tuning::from_env().dsv4_indexer_a;
  if (a == "registers") return launch<HP, true>(q, q_scale, rows, row_scale, w, scores, sh, stream);
  if (a == "smem") return launch<HP, false>(q, q_scale, rows, row_scale, w, scores, sh, stream);
  launch_keys<HP>(q, q_scale, rows, row_scale, w, scores, sh, stream);
}

}  // namespace

bool indexer_scores_fp8_supported(int heads, int dim) { return dim == kD && heads >= 1 && heads <= 128; }

void indexer_scores_fp8(const uint8_t* q, const float* q_scale, const uint8_t* rows, const float* row_scale, const float* w, float* scores,
                        const IndexerShape& sh, int dim, cudaStream_t stream) {
  if (sh.n_q <= 0 || sh.n_blocks <= 0) return;
  if (sh.ratio <= 0) throw std::invalid_argument("indexer: ratio must be positive");
  if (!indexer_scores_fp8_supported(sh.heads, dim))
    throw std::invalid_argument("indexer_scores_fp8: takes 1 to 128 heads of 128 dims, not " + std::to_string(sh.heads) + " x " + std::to_string(dim));
  if (sh.heads <= 32) return launch<32>(q, q_scale, rows, row_scale, w, scores, sh, stream);
  if (sh.heads <= 64) return launch<64>(q, q_scale, rows, row_scale, w, scores, sh, stream);
  return launch<128>(q, q_scale, rows, row_scale, w, scores, sh, stream);
}

}  // namespace pdb::cuda
