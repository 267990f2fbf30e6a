// Device-side pieces several kernel families share (included by .cu files only).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

// 16-byte asynchronous global->shared copy; an invalid source writes zeros (rows past the end).
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ggml-cpu's x86 quantize_row_q8_0 for one 32-element block held one element per lane of a warp:
// scale = amax / 127 (stored as f16 by the caller), code = round-half-even(x * (127 / amax)).
struct Q8Lane {
  int8_t code;
  float scale;  // before its f16 rounding
};
__device__ __forceinline__ Q8Lane q8_0_lane(float v) {
  float amax = fabsf(v);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  return {int8_t(rintf(__fmul_rn(v, id))), amax / 127.0f};  // no contraction: the CPU multiplies, then rounds
}

}  // namespace pdb::cuda
