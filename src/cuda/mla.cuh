// Multi-head latent attention (deepseek2) for the engine's prefill, in the decompressed form: the
// latent c_kv is expanded per head by kv_b_proj into 128-wide k_nope and v, the shared 64-wide k_pe is
// roped once and appended to every head's key, and the 192-wide keys / 128-wide values go through
// attention.cuh's causal kernel (absorbing kv_b into the queries instead would score 576-wide rows:
// three times the attention's products for a prompt). Kernels here: a strided bf16 RMSNorm (c_kv and
// the q LoRA sit inside one fused product's output), the RoPE of q_pe / k_pe in ggml's NORM pair layout
// with host-made cos/sin (the YaRN angles as llama.cpp computes them: numerics/rope_ggml.h), and the
// scatter of k_nope / v into the caches. CPU twin: model/cpu_engine_mla.cpp (the same forward, absorbed).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

struct MlaShape {
  int64_t rows = 0, pos0 = 0;
  int n_heads = 0, nope = 0, rope = 0, v_dim = 0;  // nope + rope = the key width (192 for V2/V2-Lite)
  int64_t kv_capacity = 0;                         // rows per head in the K/V caches
};

// y[r][:dim] = rms_norm(x[r][:dim]) * w, bf16 in and out with row strides (f32 statistics).
void rmsnorm_rows_strided_bf16(const __nv_bfloat16* x, int64_t x_stride, const float* w, __nv_bfloat16* y, int64_t y_stride, int64_t rows,
                               int64_t dim, float eps, cudaStream_t s);

// q: [rows x q_stride], head h's nope | rope at h * (nope + rope); k_pe: [rows x kpe_stride] (its first
// `rope` elements); cs: [rows x rope] interleaved cos, sin per pair (ggml_rope_cache). Writes q_out
// [rows x n_heads x (nope + rope)] with q_pe roped, and RoPE(k_pe) into every head's key columns
// [nope, nope + rope) of k_cache [n_heads x kv_capacity x (nope + rope)] at rows pos0...
void mla_rope_qk(const __nv_bfloat16* q, int64_t q_stride, const __nv_bfloat16* k_pe, int64_t kpe_stride, const float* cs, __nv_bfloat16* q_out,
                 __nv_bfloat16* k_cache, const MlaShape& m, cudaStream_t s);

// kvb: [rows x n_heads x (nope + v_dim)] (kv_b_proj's output per head: k_nope | v) into k_cache's
// columns [0, nope) and v_cache [n_heads x kv_capacity x v_dim] at rows pos0...
void mla_scatter_kv(const __nv_bfloat16* kvb, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const MlaShape& m, cudaStream_t s);

}  // namespace pdb::cuda
