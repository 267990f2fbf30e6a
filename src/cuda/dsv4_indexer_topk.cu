// The lightning indexer's top-k with a query's scores held in shared memory (PDBRIDGE_DSV4_TOPK=smem; dsv4_indexer.cuh
// indexer_topk): read from global memory once (the first radix pass's histogram built as they arrive), then radix
// passes of 12, 12 and 8 bits over shared memory (lanes of one digit counted once, by __match_any_sync), and the
// selection written in index order by warp ballots. Against the default kernel (a pass per byte over global memory,
// 256 threads per query), measured on the H200 (docs/RESULTS.md): 1.76x faster at 128K tokens in launches of 256
// queries, where the default leaves the GPU underfilled, but 0.3-0.6x at 8K-32K and no faster in the engine's
// launches of 4,096 queries -- its 1,024 threads and up to 128 KB of shared memory hold an SM per query. Rows longer
// than shared memory holds (over ~53K visible blocks) take the default kernel.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "cuda/dsv4_indexer.cuh"

#include "cuda/common.cuh"

namespace pdb::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32, kBins = 4096;

__device__ __forceinline__ uint32_t order_key(float f) {  // float -> unsigned of the same order
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// hist[bin] += 1 for each lane with `on`; lanes of one bin add once together (scores crowd a few digits). Every
// lane of the warp calls it.
__device__ __forceinline__ void count(int* hist, uint32_t bin, bool on) {
  const unsigned peers = __match_any_sync(0xffffffffu, on ? bin : 0xffffffffu);
  if (on && int(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}

// The digit d of `bins` counters that holds the need-th largest key: the counts above d are < need <= those from d
// up. Thread j walks bins [bins - 1 - j*per, ...) downwards after an exclusive scan of the threads' sums.
struct Digit { int d, need; };
template <typename Scan>
__device__ Digit find_digit(const int* hist, int bins, int need, typename Scan::TempStorage& scan, Digit* out) {
  const int per = bins >= kThreads ? bins / kThreads : 1, first = bins - 1 - int(threadIdx.x) * per;
  int sum = 0;
  for (int j = 0; j < per; ++j)
    if (first - j >= 0) sum += hist[first - j];
  int above;
  Scan(scan).ExclusiveSum(sum, above);
  for (int j = 0; j < per && first - j >= 0; ++j) {
    const int c = hist[first - j];
    if (above < need && above + c >= need) *out = Digit{first - j, need - above};
    above += c;
  }
  __syncthreads();
  const Digit r = *out;
  __syncthreads();
  return r;
}

__global__ void __launch_bounds__(kThreads) topk_smem_kernel(const float* __restrict__ scores, int32_t* __restrict__ idx, IndexerShape sh) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist[kBins];
  __shared__ Digit digit;
  __shared__ int warp_above[kWarps], warp_equal[kWarps];
  extern __shared__ uint32_t keys[];
  const int64_t t = blockIdx.x;
  const int k = sh.top_k, lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
  int32_t* out = idx + t * k;
  const int nv = int(min((sh.pos0 + t + 1) / sh.ratio, sh.n_blocks));
  if (nv <= k) {  // every visible block, then -1
    for (int i = int(threadIdx.x); i < k; i += kThreads) out[i] = i < nv ? i : -1;
    return;
  }
  for (int i = int(threadIdx.x); i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  // the row in, four loads in flight per thread; the first 12 bits counted as they land
  const float* row = scores + t * sh.n_blocks;
  for (int base = 0; base < nv; base += 4 * kThreads) {
    float v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      v[u] = i < nv ? __ldcs(row + i) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + u * kThreads + int(threadIdx.x);
      const uint32_t key = order_key(v[u]);
      if (i < nv) keys[i] = key;
      count(hist, key >> 20, i < nv);
    }
  }
  __syncthreads();
  Digit d = find_digit<Scan>(hist, kBins, k, scan, &digit);
  uint32_t prefix = uint32_t(d.d) << 20;
  int need = d.need;
  // the next 12 bits, then the last 8, of the keys that share the digits found so far
  for (int pass = 1; pass < 3; ++pass) {
    const int shift = pass == 1 ? 8 : 0, known = pass == 1 ? 20 : 8, bins = pass == 1 ? kBins : 256;
    for (int i = int(threadIdx.x); i < bins; i += kThreads) hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < nv; base += kThreads) {
      const int i = base + int(threadIdx.x);
      const uint32_t key = i < nv ? keys[i] : 0u;
      count(hist, (key >> shift) & uint32_t(bins - 1), i < nv && key >> known == prefix >> known);
    }
    __syncthreads();
    d = find_digit<Scan>(hist, bins, need, scan, &digit);
    prefix |= uint32_t(d.d) << shift;
    need = d.need;
  }
  // `prefix` is the k-th key: take every key above it and the first `need` equal to it, in index order. Warp w
  // owns one run of indices; its counts first, then the runs' offsets, then the indices.
  const uint32_t kth = prefix;
  const int run = ((nv + kWarps - 1) / kWarps + 31) & ~31, lo = warp * run, hi = min(nv, lo + run);
  int above = 0, equal = 0;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < hi ? keys[i] : 0u;
    above += __popc(__ballot_sync(0xffffffffu, i < hi && key > kth));
    equal += __popc(__ballot_sync(0xffffffffu, i < hi && key == kth));
  }
  if (lane == 0) {
    warp_above[warp] = above;
    warp_equal[warp] = equal;
  }
  __syncthreads();
  int above_before = 0, equal_before = 0;
  for (int w = 0; w < warp; ++w) {
    above_before += warp_above[w];
    equal_before += warp_equal[w];
  }
  int taken = above_before + min(equal_before, need), eq_seen = equal_before;
  const unsigned below_me = (1u << lane) - 1u;
  for (int base = lo; base < hi; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < hi ? keys[i] : 0u;
    const unsigned eq = __ballot_sync(0xffffffffu, i < hi && key == kth);
    const bool take = (i < hi && key > kth) || ((eq >> lane & 1u) && eq_seen + __popc(eq & below_me) < need);
    const unsigned took = __ballot_sync(0xffffffffu, take);
    if (take) out[taken + __popc(took & below_me)] = i;
    taken += __popc(took);
    eq_seen += __popc(eq);
  }
}

// The dynamic shared memory the kernel may take on the current device (the opt-in maximum less its static arrays),
// granted to it there.
int smem_bytes_granted() {
  int dev = 0, optin = 0;
  PDB_CUDA_CHECK(cudaGetDevice(&dev));
  PDB_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  cudaFuncAttributes a{};
  PDB_CUDA_CHECK(cudaFuncGetAttributes(&a, topk_smem_kernel));
  const int bytes = optin - int(a.sharedSizeBytes);
  PDB_CUDA_CHECK(cudaFuncSetAttribute(topk_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return bytes;
}

}  // namespace

int64_t indexer_topk_smem_blocks() { return smem_bytes_granted() / 4; }

bool indexer_topk_smem(const float* scores, int32_t* idx, const IndexerShape& sh, cudaStream_t stream) {
  if (sh.n_blocks > smem_bytes_granted() / 4) return false;
  const size_t smem = size_t(std::max<int64_t>(sh.n_blocks, 1)) * 4;
  topk_smem_kernel<<<unsigned(sh.n_q), kThreads, smem, stream>>>(scores, idx, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
  return true;
}

}  // namespace pdb::cuda
