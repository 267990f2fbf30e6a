// The lightning indexer's top-k with a query's scores held in shared memory (PDBRIDGE_DSV4_TOPK=smem; dsv4_indexer.cuh
// indexer_topk): read from global memory once (the first radix pass's histogram built as they arrive), then radix
// passes of 12, 12 and 8 bits over shared memory (lanes of one digit counted once, by __match_any_sync), and the
// selection written in index order by warp ballots. Against the default kernel (a pass per byte over global memory,
// 256 threads per query), measured on the H200 (docs/RESULTS.md): 1.76x faster at 128K tokens in launches of 256
// queries, where the default leaves the GPU underfilled, but 0.3-0.6x at 8K-32K and no faster in the engine's
// launches of 4,096 queries -- its 1,024 threads and up to 128 KB of shared memory hold an SM per query. Rows longer
// than shared memory holds (over ~53K visible blocks) take the warps' kernel. Below it, the default (by warps): the
// same counting and selection with the scores left in global memory, 256 threads per query.
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
// up. Thread j walks bins [bins - 1 - j*per, ...) downwards after an exclusive scan of the threads' sums (per =
// bins / 1024, or 1: a block of 256 threads takes 256 bins).
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

// The selection once the k-th key and each warp's counts over its run [lo, hi) are known: warp w writes, in index
// order, its run's keys above the k-th and those equal to it whose rank among all the equal ones is below `need`.
template <typename KeyAt>
__device__ void select_in_runs(KeyAt key_at, uint32_t kth, int need, int lo, int hi, int warp, int lane, const int* warp_above, const int* warp_equal,
                               int32_t* out) {
  int above_before = 0, equal_before = 0;
  for (int w = 0; w < warp; ++w) {
    above_before += warp_above[w];
    equal_before += warp_equal[w];
  }
  int taken = above_before + min(equal_before, need), eq_seen = equal_before;
  const unsigned below_me = (1u << lane) - 1u;
  for (int base = lo; base < hi; base += 128) {  // four keys a lane read before any is used: the loads overlap
    uint32_t keys4[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) keys4[u] = base + 32 * u + lane < hi ? key_at(base + 32 * u + lane) : 0u;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + 32 * u + lane;
      const uint32_t key = keys4[u];
      const unsigned eq = __ballot_sync(0xffffffffu, i < hi && key == kth);
      const bool take = (i < hi && key > kth) || ((eq >> lane & 1u) && eq_seen + __popc(eq & below_me) < need);
      const unsigned took = __ballot_sync(0xffffffffu, take);
      if (take) out[taken + __popc(took & below_me)] = i;
      taken += __popc(took);
      eq_seen += __popc(eq);
    }
  }
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
  select_in_runs([](int i) { return keys[i]; }, kth, need, lo, hi, warp, lane, warp_above, warp_equal, out);
}

// ---- the default top-k, by warps: the scores stay in global memory (8 warps per query, any row length), with the
// default kernel's five reads of a row but not its work per score: lanes of one digit counted once (count), the
// digit found by a scan over the bins (find_digit, a bin per thread) instead of one thread's walk, the last pass
// counted per warp over each warp's run of indices so that the selection is one read of ballots, without the
// default's two block scans and five barriers per 256 scores.
constexpr int kWThreads = 256, kWWarps = kWThreads / 32;

__global__ void __launch_bounds__(kWThreads) topk_warps_kernel(const float* __restrict__ scores, int32_t* __restrict__ idx, IndexerShape sh) {
  using Scan = cub::BlockScan<int, kWThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist[256], warp_hist[kWWarps][256], warp_above[kWWarps], warp_equal[kWWarps];
  __shared__ Digit digit;
  const int64_t t = blockIdx.x;
  const int k = sh.top_k, lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
  int32_t* out = idx + t * k;
  const int nv = int(min((sh.pos0 + t + 1) / sh.ratio, sh.n_blocks));
  if (nv <= k) {  // every visible block, then -1
    for (int i = int(threadIdx.x); i < k; i += kWThreads) out[i] = i < nv ? i : -1;
    return;
  }
  const float* row = scores + t * sh.n_blocks;
  uint32_t prefix = 0;
  int need = k;
  // the first three bytes over the whole block, four loads in flight per thread
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = 24 - 8 * pass;
    const uint32_t known = pass == 0 ? 0u : 0xffffffffu << (32 - 8 * pass);
    hist[threadIdx.x] = 0;
    __syncthreads();
    for (int base = 0; base < nv; base += 4 * kWThreads) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + u * kWThreads + int(threadIdx.x);
        v[u] = i < nv ? row[i] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + u * kWThreads + int(threadIdx.x);
        const uint32_t key = order_key(v[u]);
        count(hist, (key >> shift) & 0xffu, i < nv && (key & known) == prefix);
      }
    }
    __syncthreads();
    const Digit d = find_digit<Scan>(hist, 256, need, scan, &digit);
    prefix |= uint32_t(d.d) << shift;
    need = d.need;
  }
  // the last byte per warp over its run of indices, with the keys above the first three bytes counted on the way
  const int run = ((nv + kWWarps - 1) / kWWarps + 31) & ~31, lo = warp * run, hi = min(nv, lo + run);
  for (int b = lane; b < 256; b += 32) warp_hist[warp][b] = 0;
  __syncwarp();
  int above = 0;
  for (int base = lo; base < hi; base += 128) {
    uint32_t keys4[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) keys4[u] = base + 32 * u + lane < hi ? order_key(row[base + 32 * u + lane]) : 0u;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const bool in = base + 32 * u + lane < hi;
      above += __popc(__ballot_sync(0xffffffffu, in && (keys4[u] >> 8) > (prefix >> 8)));
      count(warp_hist[warp], keys4[u] & 0xffu, in && (keys4[u] >> 8) == (prefix >> 8));
    }
  }
  __syncthreads();
  int c = 0;
#pragma unroll
  for (int w = 0; w < kWWarps; ++w) c += warp_hist[w][threadIdx.x];
  hist[threadIdx.x] = c;
  __syncthreads();
  const Digit d = find_digit<Scan>(hist, 256, need, scan, &digit);
  const uint32_t kth = prefix | uint32_t(d.d);
  need = d.need;
  // this warp's keys above the k-th (the first three bytes' count, every lane's alike, and the last byte's bins
  // above the digit) and equal to it
  int mine = lane == 0 ? above : 0;
  for (int b = d.d + 1 + lane; b < 256; b += 32) mine += warp_hist[warp][b];
  for (int off = 16; off > 0; off >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, off);
  if (lane == 0) {
    warp_above[warp] = mine;
    warp_equal[warp] = warp_hist[warp][d.d];
  }
  __syncthreads();
  select_in_runs([row](int i) { return order_key(row[i]); }, kth, need, lo, hi, warp, lane, warp_above, warp_equal, out);
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

void indexer_topk_warps(const float* scores, int32_t* idx, const IndexerShape& sh, cudaStream_t stream) {
  topk_warps_kernel<<<unsigned(sh.n_q), kWThreads, 0, stream>>>(scores, idx, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
}

int64_t indexer_topk_smem_blocks() { return smem_bytes_granted() / 4; }

bool indexer_topk_smem(const float* scores, int32_t* idx, const IndexerShape& sh, cudaStream_t stream) {
  if (sh.n_blocks > smem_bytes_granted() / 4) return false;
  const size_t smem = size_t(std::max<int64_t>(sh.n_blocks, 1)) * 4;
  topk_smem_kernel<<<unsigned(sh.n_q), kThreads, smem, stream>>>(scores, idx, sh);
  PDB_CUDA_CHECK(cudaGetLastError());
  return true;
}

}  // namespace pdb::cuda
