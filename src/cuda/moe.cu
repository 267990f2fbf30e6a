#include "cuda/moe.cuh"

#include <stdexcept>
#include <string>

#include "cuda/common.cuh"

namespace pdb::cuda {
namespace {

constexpr int kMaxExperts = 256;
constexpr int kPerLane = kMaxExperts / 32;

// One warp per token.
__global__ void route_kernel(const float* __restrict__ logits, int32_t* __restrict__ experts, float* __restrict__ weights, MoeRouteArgs a) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.rows) return;
  const float* lg = logits + row * a.n_expert;
  float p[kPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < a.n_expert ? lg[e] : -INFINITY;
    mx = fmaxf(mx, p[i]);
  }
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    p[i] = lane + 32 * i < a.n_expert ? expf(p[i] - mx) : 0.0f;
    sum += p[i];
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float inv = 1.0f / sum;
  uint32_t taken = 0;  // bit i: this lane's expert lane + 32 i is selected
  float picked_sum = 0.0f, mine = 0.0f;
  int my_e = -1;
  for (int j = 0; j < a.n_used; ++j) {
    float bv = -1.0f;
    int be = 1 << 30;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < a.n_expert && !(taken >> i & 1u) && p[i] > bv) bv = p[i], be = e;  // ascending e per lane: ties keep the lower
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (ov > bv || (ov == bv && oe < be)) bv = ov, be = oe;
    }
    if (be % 32 == lane) taken |= 1u << (be / 32);
    const float prob = bv * inv;
    picked_sum += prob;
    if (lane == j) mine = prob, my_e = be;
  }
  if (lane < a.n_used) {
    float w = mine;
    if (a.renormalize) w = w / fmaxf(picked_sum, 6.103515625e-5f);
    experts[row * a.n_used + lane] = my_e;
    weights[row * a.n_used + lane] = w * a.scale;
  }
}

// One block: the histogram and its exclusive scan.
__global__ void count_kernel(const int32_t* __restrict__ experts, int64_t entries, int n_expert, int32_t* counts, int32_t* offsets) {
  __shared__ int32_t c[kMaxExperts];
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) c[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < entries; i += blockDim.x) atomicAdd(&c[experts[i]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int e = 0; e < n_expert; ++e) {
      counts[e] = c[e];
      offsets[e] = run;
      run += c[e];
    }
  }
}

// One block per expert: an ordered compaction of the pairs that chose it.
__global__ void place_kernel(const int32_t* __restrict__ experts, int64_t entries, int n_used, const int32_t* __restrict__ offsets,
                             int32_t* __restrict__ slot_of, int32_t* __restrict__ token_of) {
  const int e = blockIdx.x;
  __shared__ int32_t warp_base[32];
  __shared__ int32_t running;
  if (threadIdx.x == 0) running = offsets[e];
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int64_t b = 0; b < entries; b += blockDim.x) {
    const int64_t i = b + threadIdx.x;
    const bool mine = i < entries && experts[i] == e;
    const unsigned m = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_base[warp] = __popc(m);
    __syncthreads();
    if (threadIdx.x == 0) {
      int32_t run = running;
      for (int w = 0; w < warps; ++w) { const int32_t n = warp_base[w]; warp_base[w] = run; run += n; }
      running = run;
    }
    __syncthreads();
    if (mine) {
      const int32_t slot = warp_base[warp] + __popc(m & ((1u << lane) - 1u));
      slot_of[i] = slot;
      token_of[slot] = int32_t(i / n_used);
    }
    __syncthreads();
  }
}

__global__ void gather_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ token_of, int64_t vecs_per_row, uint4* __restrict__ xg) {
  const int64_t g = blockIdx.x;
  const uint4* src = x + int64_t(token_of[g]) * vecs_per_row;
  for (int64_t c = threadIdx.x; c < vecs_per_row; c += blockDim.x) xg[g * vecs_per_row + c] = src[c];
}

__global__ void combine_kernel(const __nv_bfloat16* __restrict__ y, const int32_t* __restrict__ slot_of, const float* __restrict__ weights,
                               int n_used, int64_t dim, float* __restrict__ h) {
  const int64_t r = blockIdx.x;
  const int32_t* so = slot_of + r * n_used;
  const float* w = weights + r * n_used;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < n_used; ++j) acc += w[j] * __bfloat162float(y[int64_t(so[j]) * dim + c]);
    h[r * dim + c] += acc;
  }
}

}  // namespace

void moe_route(const float* logits, int32_t* experts, float* weights, const MoeRouteArgs& a, cudaStream_t s) {
  if (a.rows <= 0) return;
  if (a.n_expert <= 0 || a.n_expert > kMaxExperts || a.n_used <= 0 || a.n_used > a.n_expert || a.n_used > 32)
    throw std::invalid_argument("moe_route: " + std::to_string(a.n_used) + " of " + std::to_string(a.n_expert) + " experts (at most 32 of 256)");
  const int warps = 8;
  route_kernel<<<unsigned((a.rows + warps - 1) / warps), 32 * warps, 0, s>>>(logits, experts, weights, a);
  PDB_CUDA_LAUNCHED();
}

void moe_count(const int32_t* experts, int64_t rows, int n_used, int n_expert, int32_t* counts, int32_t* offsets, cudaStream_t s) {
  if (rows <= 0) return;
  if (n_expert > kMaxExperts) throw std::invalid_argument("moe_count: more than 256 experts");
  count_kernel<<<1, 1024, 0, s>>>(experts, rows * n_used, n_expert, counts, offsets);
  PDB_CUDA_LAUNCHED();
}

void moe_group(const int32_t* experts, int64_t rows, int n_used, int n_expert, int32_t* counts, int32_t* offsets, int32_t* slot_of,
               int32_t* token_of, cudaStream_t s) {
  moe_count(experts, rows, n_used, n_expert, counts, offsets, s);
  moe_place(experts, rows, n_used, n_expert, offsets, slot_of, token_of, s);
}

void moe_place(const int32_t* experts, int64_t rows, int n_used, int n_expert, const int32_t* offsets, int32_t* slot_of, int32_t* token_of,
               cudaStream_t s) {
  if (rows <= 0) return;
  if (n_expert > kMaxExperts) throw std::invalid_argument("moe_place: more than 256 experts");
  place_kernel<<<unsigned(n_expert), 1024, 0, s>>>(experts, rows * n_used, n_used, offsets, slot_of, token_of);
  PDB_CUDA_LAUNCHED();
}

void gather_rows(const __nv_bfloat16* x, const int32_t* token_of, int64_t grouped_rows, int64_t dim, __nv_bfloat16* xg, cudaStream_t s) {
  if (grouped_rows <= 0) return;
  if (dim % 8) throw std::invalid_argument("gather_rows: dim must be a multiple of 8");
  gather_kernel<<<unsigned(grouped_rows), 128, 0, s>>>(reinterpret_cast<const uint4*>(x), token_of, dim / 8, reinterpret_cast<uint4*>(xg));
  PDB_CUDA_LAUNCHED();
}

void moe_combine(const __nv_bfloat16* y, const int32_t* slot_of, const float* weights, int64_t rows, int n_used, int64_t dim, float* h,
                 cudaStream_t s) {
  if (rows <= 0) return;
  combine_kernel<<<unsigned(rows), 256, 0, s>>>(y, slot_of, weights, n_used, dim, h);
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
