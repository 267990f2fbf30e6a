#include "cuda/dsv4_indexer.cuh"

#include <cub/block/block_scan.cuh>

#include <stdexcept>
#include <string>

#include "common/tuning.h"
#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

__device__ __forceinline__ int64_t visible_blocks(const IndexerShape& sh, int64_t t) {
  const int64_t v = (sh.pos0 + t + 1) / sh.ratio;
  return v < sh.n_blocks ? v : sh.n_blocks;
}

// one thread per (query, block): coalesced along the blocks of one head row of S
__global__ void weighted_relu_kernel(const float* __restrict__ s, const float* __restrict__ w, float* __restrict__ scores, IndexerShape sh) {
  const int64_t t = blockIdx.y;
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= sh.n_blocks) return;
  if (b >= visible_blocks(sh, t)) { scores[t * sh.n_blocks + b] = -INFINITY; return; }
  float acc = 0.0f;
  const float* row = s + t * sh.heads * sh.n_blocks + b;
  const float* wt = w + t * sh.heads;
  for (int h = 0; h < sh.heads; ++h) acc += wt[h] * fmaxf(row[int64_t(h) * sh.n_blocks], 0.0f);
  scores[t * sh.n_blocks + b] = acc;
}

// float -> unsigned with the same order (larger float, larger key)
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

constexpr int kThreads = 256;

// The top-k by block scans (PDBRIDGE_DSV4_TOPK=global; the engine's until session 39): one block of 256 threads per query,
// a radix pass per byte over the scores in global memory. The default is by warps (dsv4_indexer_topk.cu).
__global__ void topk_global_kernel(const float* __restrict__ scores, int32_t* __restrict__ idx, IndexerShape sh) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist[256];
  __shared__ uint32_t prefix_s;
  __shared__ int need_s, base_s;
  const int64_t t = blockIdx.x;
  const float* row = scores + t * sh.n_blocks;
  int32_t* out = idx + t * sh.top_k;
  const int64_t nv = visible_blocks(sh, t);
  const int k = sh.top_k;
  if (nv <= k) {  // every visible block, then -1
    for (int64_t i = threadIdx.x; i < k; i += kThreads) out[i] = i < nv ? int32_t(i) : -1;
    return;
  }
  // radix select, most significant byte first: the k-th largest key and how many of its equals to take
  uint32_t prefix = 0;
  int need = k;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = threadIdx.x; i < 256; i += kThreads) hist[i] = 0;
    __syncthreads();
    const uint32_t mask = pass == 0 ? 0u : (0xffffffffu << (32 - 8 * pass));
    for (int64_t i = threadIdx.x; i < nv; i += kThreads) {
      const uint32_t key = order_key(row[i]);
      if ((key & mask) == (prefix & mask)) atomicAdd(&hist[(key >> shift) & 0xff], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int acc = 0, d = 255;
      for (; d > 0; --d) {
        if (acc + hist[d] >= need) break;
        acc += hist[d];
      }
      prefix_s = prefix | (uint32_t(d) << shift);
      need_s = need - acc;
    }
    __syncthreads();
    prefix = prefix_s;
    need = need_s;
    __syncthreads();
  }
  // `prefix` is the k-th key; take every key above it and the first `need` equal to it, in index order
  if (threadIdx.x == 0) base_s = 0;
  int eq_taken = 0;  // equal keys taken so far (block-uniform)
  __syncthreads();
  for (int64_t start = 0; start < nv; start += kThreads) {
    const int64_t i = start + threadIdx.x;
    const uint32_t key = i < nv ? order_key(row[i]) : 0u;
    const int above = i < nv && key > prefix ? 1 : 0, equal = i < nv && key == prefix ? 1 : 0;
    int eq_rank, eq_total;
    Scan(scan).ExclusiveSum(equal, eq_rank, eq_total);
    __syncthreads();
    const int take = above || (equal && eq_taken + eq_rank < need) ? 1 : 0;
    int pos, total;
    Scan(scan).ExclusiveSum(take, pos, total);
    if (take) out[base_s + pos] = int32_t(i);
    __syncthreads();
    if (threadIdx.x == 0) base_s += total;
    eq_taken += eq_total;
    __syncthreads();
  }
}


// The fused scores. A block of 8 warps holds 128 (query, head) rows: 128 / H queries of H heads, each warp 16
// heads of one query, their q fragments in registers for the whole prompt. It walks the blocks its last query
// can see in tiles of 64 LID rows (two shared-memory stages, cp.async), 16 x 64 dot products per warp on the
// tensor cores (bf16, f32 accumulation), then per column: the warp's two rows per lane as w * max(0, s), summed
// over the warp's 16 heads by shuffles and over the query's H / 16 warps through shared memory.
template <int H>
__global__ void __launch_bounds__(256) indexer_scores_kernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ rows,
                                                             const float* __restrict__ w, float* __restrict__ scores, IndexerShape sh) {
  constexpr int D = 128, C = D / 8, KS = D / 16, KT = 64, QPB = 128 / H, WPQ = H / 16;
  constexpr uint32_t kTileBytes = KT * D * 2;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t sQ = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t sK0 = sQ + 128 * D * 2;
  float* red = reinterpret_cast<float*>(smem_raw + 128 * D * 2 + 2 * kTileBytes);  // [8 warps x KT]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t qb = (int64_t(gridDim.x) - 1 - blockIdx.x) * QPB;  // the block's first query; the most blocks first
  const int64_t last_q = (qb + QPB < sh.n_q ? qb + QPB : sh.n_q) - 1;
  const int64_t reach = visible_blocks(sh, last_q);
  const int n_tiles = int((reach + KT - 1) / KT);
  for (int i = threadIdx.x; i < 128 * C; i += 256) {
    const int r = i / C, c = i % C;
    const int64_t t = qb + r / H;
    const bool ok = t < sh.n_q;
    cp_async16(sQ + swz(r, c, C), q + ((ok ? t : 0) * H + r % H) * D + c * 8, ok);
  }
  cp_async_commit();
  auto load = [&](int tile, int stage) {
    const int64_t b0 = int64_t(tile) * KT;
    for (int i = threadIdx.x; i < KT * C; i += 256) {
      const int r = i / C, c = i % C;
      const bool ok = b0 + r < sh.n_blocks;
      cp_async16(sK0 + stage * kTileBytes + swz(r, c, C), rows + (ok ? (b0 + r) * D + c * 8 : 0), ok);
    }
    cp_async_commit();
  };
  if (n_tiles > 0) load(0, 0);
  cp_async_wait<0>();
  __syncthreads();
  const int mat = lane / 8, lr = lane % 8;
  uint32_t qf[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) ldmatrix_x4(sQ + swz(warp * 16 + lr + (mat & 1) * 8, kk * 2 + (mat >> 1), C), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
  const int64_t my_t = qb + warp / WPQ;
  const int h0 = (warp % WPQ) * 16 + lane / 4;
  const float w0 = my_t < sh.n_q ? w[my_t * H + h0] : 0.0f, w1 = my_t < sh.n_q ? w[my_t * H + h0 + 8] : 0.0f;
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    cp_async_wait<0>();
    __syncthreads();  // this tile landed; every warp is past the previous one (its stage and `red` are free)
    if (tile + 1 < n_tiles) load(tile + 1, stage ^ 1);
    float sc[KT / 8][4];
#pragma unroll
    for (int j = 0; j < KT / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
#pragma unroll
      for (int j = 0; j < KT / 8; j += 2) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(sK0 + stage * kTileBytes + swz((j + (mat >> 1)) * 8 + lr, kk * 2 + (mat & 1), C), b0, b1, b2, b3);
        mma_bf16(sc[j], qf[kk], b0, b1);
        mma_bf16(sc[j + 1], qf[kk], b2, b3);
      }
#pragma unroll
    for (int j = 0; j < KT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = w0 * fmaxf(sc[j][e], 0.0f) + w1 * fmaxf(sc[j][2 + e], 0.0f);
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (lane < 4) red[warp * KT + j * 8 + 2 * lane + e] = v;
      }
    __syncthreads();
    for (int i = threadIdx.x; i < QPB * KT; i += 256) {
      const int qq = i / KT, col = i % KT;
      const int64_t t = qb + qq, b = int64_t(tile) * KT + col;
      if (t >= sh.n_q || b >= sh.n_blocks) continue;
      float v = -INFINITY;
      if (b < visible_blocks(sh, t)) {
        v = 0.0f;
#pragma unroll
        for (int k = 0; k < WPQ; ++k) v += red[(qq * WPQ + k) * KT + col];
      }
      scores[t * sh.n_blocks + b] = v;
    }
  }
  // the blocks past the last query's reach: not visible to any query of the block
  for (int qq = 0; qq < QPB; ++qq) {
    const int64_t t = qb + qq;
    if (t >= sh.n_q) break;
    for (int64_t b = int64_t(n_tiles) * KT + threadIdx.x; b < sh.n_blocks; b += 256) scores[t * sh.n_blocks + b] = -INFINITY;
  }
}

template <int H>
void launch_scores(const __nv_bfloat16* q, const __nv_bfloat16* rows, const float* w, float* scores, const IndexerShape& sh, cudaStream_t stream) {
  constexpr int smem = 128 * 128 * 2 + 2 * 64 * 128 * 2 + 8 * 64 * 4;
  static bool configured = false;  // once per process and instantiation
  if (!configured) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(indexer_scores_kernel<H>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured = true;
  }
  const int64_t blocks = (sh.n_q + 128 / H - 1) / (128 / H);
  indexer_scores_kernel<H><<<unsigned(blocks), 256, smem, stream>>>(q, rows, w, scores, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
}

// The FP8 operands: one warp per 128-wide row, 4 values per lane; scale = 2^ceil(log2(amax / 448)) as the CPU twin
// (dsv4_indexer_fp8_rows) computes it, so codes and scales agree bit for bit.
template <typename T>
__global__ void fp8_rows_kernel(const T* __restrict__ x, int64_t rows, uint8_t* __restrict__ codes, float* __restrict__ scales) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = float(x[r * 128 + lane * 4 + i]);
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float scale = 1.0f;
  if (amax > 0.0f) {
    int e;
    const float m = frexpf(__fdiv_rn(amax, 448.0f), &e);
    scale = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
  }
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) packed |= uint32_t(__nv_cvt_float_to_fp8(__fdiv_rn(v[i], scale), __NV_SATFINITE, __NV_E4M3)) << (8 * i);
  reinterpret_cast<uint32_t*>(codes + r * 128)[lane] = packed;
  if (lane == 0) scales[r] = scale;
}

}  // namespace

void indexer_weighted_relu(const float* s, const float* w, float* scores, const IndexerShape& sh, cudaStream_t stream) {
  if (sh.n_q <= 0 || sh.n_blocks <= 0) return;
  if (sh.heads <= 0 || sh.ratio <= 0) throw std::invalid_argument("indexer: heads and ratio must be positive");
  const dim3 grid(unsigned((sh.n_blocks + kThreads - 1) / kThreads), unsigned(sh.n_q));
  weighted_relu_kernel<<<grid, kThreads, 0, stream>>>(s, w, scores, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
}

bool indexer_scores_supported(int heads, int dim) { return dim == 128 && (heads == 16 || heads == 32 || heads == 64 || heads == 128); }

void indexer_scores(const __nv_bfloat16* q, const __nv_bfloat16* rows, const float* w, float* scores, const IndexerShape& sh, int dim,
                    cudaStream_t stream) {
  if (sh.n_q <= 0 || sh.n_blocks <= 0) return;
  if (sh.ratio <= 0) throw std::invalid_argument("indexer: ratio must be positive");
  if (!indexer_scores_supported(sh.heads, dim))
    throw std::invalid_argument("indexer_scores: takes 16, 32, 64 or 128 heads of 128 dims, not " + std::to_string(sh.heads) + " x " +
                                std::to_string(dim));
  switch (sh.heads) {
    case 16: return launch_scores<16>(q, rows, w, scores, sh, stream);
    case 32: return launch_scores<32>(q, rows, w, scores, sh, stream);
    case 64: return launch_scores<64>(q, rows, w, scores, sh, stream);
    default: return launch_scores<128>(q, rows, w, scores, sh, stream);
  }
}

void indexer_topk(const float* scores, int32_t* idx, const IndexerShape& sh, cudaStream_t stream) {
  if (sh.n_q <= 0) return;
  if (sh.top_k <= 0) throw std::invalid_argument("indexer: top_k must be positive");
  // by warps (the default: 1.4-1.9x the block scans' kernel in the engine, docs/RESULTS.md session 39); =global: the
  // block scans; =smem: shared memory, where a row fits (longer ones by warps)
  const std::string way = Tuning::from_env().dsv4_topk;
  if (way == "smem" && indexer_topk_smem(scores, idx, sh, stream)) return;
  if (way != "global") return indexer_topk_warps(scores, idx, sh, stream);
  topk_global_kernel<<<unsigned(sh.n_q), kThreads, 0, stream>>>(scores, idx, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
}

void indexer_fp8_rows(const float* x, int64_t rows, int dim, uint8_t* codes, float* scales, cudaStream_t stream) {
  if (rows <= 0) return;
  if (dim != 128) throw std::invalid_argument("indexer_fp8_rows: takes rows of 128, not " + std::to_string(dim));
  fp8_rows_kernel<float><<<unsigned((rows + 7) / 8), 256, 0, stream>>>(x, rows, codes, scales);
  PDB_CUDA_CHECK(cudaGetLastError());
}

void indexer_fp8_rows(const __nv_bfloat16* x, int64_t rows, int dim, uint8_t* codes, float* scales, cudaStream_t stream) {
  if (rows <= 0) return;
  if (dim != 128) throw std::invalid_argument("indexer_fp8_rows: takes rows of 128, not " + std::to_string(dim));
  fp8_rows_kernel<__nv_bfloat16><<<unsigned((rows + 7) / 8), 256, 0, stream>>>(x, rows, codes, scales);
  PDB_CUDA_CHECK(cudaGetLastError());
}

}  // namespace pdb::cuda
