// Hopper warpgroup MMA plumbing the sm_90a kernels share (attention_wgmma.cu, dsv4_indexer_wgmma.cu): shared-memory
// descriptors, the fence / commit / wait of asynchronous products, the proxy fence for tiles written by ordinary or
// cp.async stores. Included by sm_90a translation units inside their __CUDA_ARCH_FEAT_SM90_ALL section.
#pragma once
#include <cstdint>

namespace pdb::cuda {

// wgmma shared-memory descriptor: start address, leading/stride byte offsets (16-byte units), 128-byte swizzle
// (layout type 1 in bits 62-63).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3ffff) >> 4) | (uint64_t((lbo >> 4) & 0x3fff) << 16) | (uint64_t((sbo >> 4) & 0x3fff) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// waits until at most N committed groups of this warpgroup are still in flight
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Shared memory written through the generic proxy (stores, cp.async) must be visible to wgmma's async proxy.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins N accumulator registers at this point of the program: the compiler must not move their other uses across
// the asynchronous wgmma that writes them (issue ... wait).
template <int N>
__device__ __forceinline__ void fence_registers(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

}  // namespace pdb::cuda
