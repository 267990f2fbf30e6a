// Which key rows a query of DeepSeek-V4's sparse attention reads, and their copy into a shared-memory tile: the part
// both kernels share (dsv4_attention.cu on mma.sync, dsv4_attention_wgmma.cu on wgmma). Included by .cu files only.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/dsv4_attention.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {

// Which keys a query sees, slot by slot: the window's W positions t - W + 1 .. t, then its compressed rows (ratio
// 128: the finished blocks; ratio 4: the indexer's choices, -1 for none). nullptr: no key in that slot.
template <int D>
struct Dsv4QueryKeys {
  const Dsv4SparseAttention* a;  // the kernel's __grid_constant__ parameter: read in place
  int64_t qi, t;
  int n_slots;
  // The indexer's choice for a slot (ratio 4's compressed slots; -1 for any other): a load a kernel can issue a step
  // before it resolves the row.
  __device__ int32_t choice(int slot) const {
    return a->ratio == 4 && slot >= a->W && slot < n_slots ? a->idx[qi * a->top_k + (slot - a->W)] : -1;
  }
  __device__ const __nv_bfloat16* row(int slot, int32_t chosen) const {
    if (slot < a->W) {
      const int64_t p = t - a->W + 1 + slot;
      return p >= 0 && p >= a->win_first ? a->win + (p - a->win_first) * D : nullptr;
    }
    if (slot >= n_slots) return nullptr;
    const int j = slot - a->W;
    if (a->ratio == 128) return a->pool + int64_t(j) * D;
    return chosen >= 0 && chosen < a->n_pool ? a->pool + int64_t(chosen) * D : nullptr;
  }
  __device__ const __nv_bfloat16* row(int slot) const { return row(slot, choice(slot)); }
};

// The block's query: the latest queries (the most keys) first.
template <int D>
__device__ __forceinline__ Dsv4QueryKeys<D> dsv4_query_keys(const Dsv4SparseAttention& a) {
  Dsv4QueryKeys<D> k{&a, int64_t(gridDim.x) - 1 - blockIdx.x, 0, 0};
  k.t = a.t0 + k.qi;
  int n_comp = 0;
  if (a.ratio == 128) {
    const int64_t v = (k.t + 1) / 128;
    n_comp = int(v < a.n_pool ? v : a.n_pool);
  } else if (a.ratio == 4) {
    const int64_t v = (k.t + 1) / 4;
    n_comp = int(v < a.top_k ? v : a.top_k);
  }
  k.n_slots = a.W + n_comp;
  return k;
}

// One tile of KT key rows into a shared-memory stage (chunk c of row r at stage + offset(r, c)), and which of its
// slots hold a key; one cp.async group. Each thread copies one 16-byte column chunk of rows r0, r0 + kStep, ...; the
// lanes that copy the same rows (a whole warp at D = 512, 8 lanes at D = 64) work out each row's source once, lane k
// the k-th, and take the others' by shuffle. Every lane working out every row (64 times the work at D = 512: ~50
// dependent instructions per row, the indexer's choice read inside) made a tile of chosen rows cost 1.6x a
// contiguous one (docs/RESULTS.md, session 35). Every thread of the block calls it.
template <int D, int KT, int kThreads, typename Offset>
__device__ __forceinline__ void dsv4_load_key_tile(const Dsv4QueryKeys<D>& qk, int tile, uint32_t stage, uint8_t* valid, Offset offset) {
  constexpr int C = D / 8, kPer = KT * C / kThreads, kStep = kThreads / C, kWidth = C < 32 ? C : 32;
  static_assert(KT * C % kThreads == 0 && kThreads % C == 0, "each thread copies the same column chunk of every row it copies");
  static_assert(kPer <= kWidth && 32 % kWidth == 0, "the lanes that share a row set have a lane for each of its rows");
  const int c = threadIdx.x % C, r0 = threadIdx.x / C, k_mine = threadIdx.x % kWidth;
  const auto mine = reinterpret_cast<unsigned long long>(k_mine < kPer ? qk.row(tile * KT + r0 + k_mine * kStep) : nullptr);
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const auto src = reinterpret_cast<const __nv_bfloat16*>(__shfl_sync(0xffffffffu, mine, k, kWidth));
    const int r = r0 + k * kStep;
    cp_async16(stage + offset(r, c), src ? src + c * 8 : qk.a->q, src != nullptr);
    if (c == 0) valid[r] = src != nullptr;
  }
  cp_async_commit();
}

}  // namespace pdb::cuda
