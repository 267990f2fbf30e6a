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
// shared memory, times the row's scale. Built for sm_90a only; other targets get a kernel that traps.
#include "cuda/dsv4_indexer.cuh"

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
  for (int i = threadIdx.x; i < kRows * 8; i += kThreads) {
    const int r = i / 8, c = i % 8, h = r % HP;
    const int64_t t = qb + r / HP;
    const bool ok = t < sh.n_q && h < H;
    cp_async16(sQ + swz(r, c, 8), q + (ok ? (t * H + h) * kD + c * 16 : 0), ok);
  }
  cp_async_commit();
  auto load = [&](int tile, int stage) {
    const int64_t b0 = int64_t(tile) * kKT;
    for (int i = threadIdx.x; i < kKT * 8; i += kThreads) {
      const int r = i / 8, c = i % 8;
      const bool ok = b0 + r < sh.n_blocks;
      cp_async16(sK0 + stage * kTileBytes + swz(r, c, 8), rows + (ok ? (b0 + r) * kD + c * 16 : 0), ok);
    }
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
  uint32_t qa[2][kD / 32][4];  // this warp's query rows as A fragments, read once (PDBRIDGE_DSV4_INDEXER_A=registers; not yet measured)
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
  for (int qq = 0; qq < QPB; ++qq) {  // the blocks past the last query's reach: not visible to any query of the block
    const int64_t t = qb + qq;
    if (t >= sh.n_q) break;
    for (int64_t b = int64_t(n_tiles) * kKT + threadIdx.x; b < sh.n_blocks; b += kThreads) scores[t * sh.n_blocks + b] = -INFINITY;
  }
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
void launch(const uint8_t* q, const float* q_scale, const uint8_t* rows, const float* row_scale, const float* w, float* scores, const IndexerShape& sh,
            cudaStream_t stream) {
  const std::string a = Tuning::from_env().dsv4_indexer_a;  // "registers" | "smem"; the default: shared memory
  if (a == "registers") return launch<HP, true>(q, q_scale, rows, row_scale, w, scores, sh, stream);
  launch<HP, false>(q, q_scale, rows, row_scale, w, scores, sh, stream);
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
