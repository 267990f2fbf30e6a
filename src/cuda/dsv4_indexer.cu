#include "cuda/dsv4_indexer.cuh"

#include <cub/block/block_scan.cuh>

#include <stdexcept>

#include "cuda/common.cuh"

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

__global__ void topk_kernel(const float* __restrict__ scores, int32_t* __restrict__ idx, IndexerShape sh) {
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

}  // namespace

void indexer_weighted_relu(const float* s, const float* w, float* scores, const IndexerShape& sh, cudaStream_t stream) {
  if (sh.n_q <= 0 || sh.n_blocks <= 0) return;
  if (sh.heads <= 0 || sh.ratio <= 0) throw std::invalid_argument("indexer: heads and ratio must be positive");
  const dim3 grid(unsigned((sh.n_blocks + kThreads - 1) / kThreads), unsigned(sh.n_q));
  weighted_relu_kernel<<<grid, kThreads, 0, stream>>>(s, w, scores, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
}

void indexer_topk(const float* scores, int32_t* idx, const IndexerShape& sh, cudaStream_t stream) {
  if (sh.n_q <= 0) return;
  if (sh.top_k <= 0) throw std::invalid_argument("indexer: top_k must be positive");
  topk_kernel<<<unsigned(sh.n_q), kThreads, 0, stream>>>(scores, idx, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
}

}  // namespace pdb::cuda
