// Device-side pieces several kernel families share (included by .cu files only).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

// DeepSeek-V4's clamped SwiGLU of one gate/up pair (llama.cpp's: silu(min(g, L)) * clamp(u, -L, L); L <= 1e-6: no
// clamp): one function for the elementwise kernel and the FP4 products' fused epilogue, so both give the same bits.
__device__ __forceinline__ float swiglu_clamp(float g, float u, float L) {
  if (L > 1e-6f) {
    g = fminf(g, L);
    u = fmaxf(-L, fminf(u, L));
  }
  return g / (1.0f + expf(-g)) * u;
}

// 16-byte asynchronous global->shared copy; an invalid source writes zeros (rows past the end).
__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Shared tiles of bf16 rows in 16-byte chunks: chunk c of row r lives at chunk (c ^ (r & 7)), so that the 8 rows
// an ldmatrix reads fall in 8 different bank groups (the attention kernels and DSV4's fused kernels).
__device__ __forceinline__ uint32_t swz(int row, int chunk, int chunks_per_row) {
  return uint32_t((row * chunks_per_row + (chunk ^ (row & 7))) * 16);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
// D(16x8, f32) += A(16x16, bf16, row) * B(16x8, bf16, col)
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The FP8 block quantizer's two steps (fp8.cu's activation blocks, the engine's fp8 K/V rows in
// rope.cu): scale = amax / 448 (1 for an all-zero block), code = e4m3(x / scale), round-to-nearest-even,
// saturating. CPU twin: numerics/reference_ops.h quantize_rows_fp8.
__device__ __forceinline__ float fp8_scale_for(float amax) { return amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f; }
__device__ __forceinline__ uint8_t fp8_code(float x, float scale) {
  return uint8_t(__nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
// fp8 K/V values as the attention reads them: bf16(e4m3 code x its row's scale), round-to-nearest-even,
// for a 32-bit word of four codes (two bf16 pairs into out[0], out[1]). The e4m3 -> f32 step is exact.
__device__ __forceinline__ void fp8x4_to_bf16(uint32_t codes, float scale, uint32_t* out) {
#pragma unroll
  for (int hlf = 0; hlf < 2; ++hlf) {
    const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((codes >> (16 * hlf)) & 0xffffu), __NV_E4M3);
    const float2 f = __half22float2(__half2(h2));
    out[hlf] = pack_bf16(f.x * scale, f.y * scale);
  }
}

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

// The end of an online softmax: O / l for one thread's two accumulator rows (first_row and
// first_row + 8; columns 8j + 2t and 8j + 2t + 1 of each 8-column block j: the m16n8 mma.sync and the
// m64nN wgmma accumulator layouts agree on this), as bf16 into out's rows of row_stride elements from
// column col0. l_run holds this thread's partial sums; the 4 threads of a row share them here.
template <int D>
__device__ __forceinline__ void store_normalized_rows(const float* o, const float (&l_run)[2], int64_t first_row, int64_t n_rows, int64_t row_stride,
                                                      int64_t col0, int t, __nv_bfloat16* __restrict__ out) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t row = first_row + h * 8;
    if (row >= n_rows) continue;
    __nv_bfloat16* orow = out + row * row_stride + col0;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<__nv_bfloat162*>(orow + j * 8 + 2 * t) = __floats2bfloat162_rn(o[j * 4 + 2 * h] * inv, o[j * 4 + 2 * h + 1] * inv);
  }
}

}  // namespace pdb::cuda
