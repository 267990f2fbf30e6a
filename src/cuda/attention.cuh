// Causal flash attention for prefill (FlashAttention-2 style) on sm_80+ tensor cores, bf16 in/out,
// f32 scores and softmax statistics, GQA, head_dim 64 or 128. Keys are tiled (64 at a time) with an
// online softmax, so memory is O(tile) whatever the context: no T x T scores anywhere.
// CPU twin: numerics/reference_ops.h causal_attention_ref.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

struct AttentionShape {
  int64_t n_q = 0;        // queries in this chunk, at positions pos0 .. pos0 + n_q - 1
  int64_t pos0 = 0;       // keys are positions 0 .. pos0 + n_q - 1 (causal)
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  int64_t kv_capacity = 0;  // rows per head in the K/V cache
  float scale = 0;          // softmax scale (1/sqrt(head_dim) for llama and qwen3)
  int v_head_dim = 0;       // value (and output) width when it differs from head_dim: MLA's 192-wide keys, 128-wide values
  // Rows the q and out buffers hold (0: n_q). Where it is more, cuDNN's plan may pad the queries to a bucket of rows
  // (attention_cudnn.h): the padding rows read q's rows past n_q and the cache's past pos0 + n_q (the caller keeps
  // those finite: the engine's cache is zeroed when allocated) and their output rows are written, never meant to be read.
  int64_t q_rows = 0;
  int v_dim() const { return v_head_dim ? v_head_dim : head_dim; }
};

// Which kernel runs: cuDNN's fused attention (attention_cudnn.h) by default where libcudnn.so.9 loads and has an
// engine for the shape (same run on the H200: 1.37-1.49x our wgmma kernel, docs/RESULTS.md); PDBRIDGE_ATTN=ours selects
// ours. Our kernel variants for same-run A/B measurements: warps per block (4: one head per block; 8: a GQA
// group's heads packed per block) and keys per shared-memory tile (64 or 128). The default comes
// from PDBRIDGE_ATTN_WARPS / PDBRIDGE_ATTN_KTILE (8 x 64 when unset; either selects the mma.sync kernel). Head_dim 128 on sm_90 runs the
// wgmma kernel unless PDBRIDGE_ATTN_WGMMA=0 (measured on the H200: 22,118 vs 18,364 tok/s at 32K), in its
// ping-pong form unless PDBRIDGE_ATTN_WGMMA=1 (same run, Llama-3.1-8B shape: 22,877 vs 22,437 tok/s at 32K,
// 9,539 vs 9,237 at 128K).
enum class WgmmaSchedule {
  kLockstep,  // both warpgroups: QK, wait, softmax, PV, wait
  kPingPong,  // the warpgroups half a tile apart, one's softmax under the other's products
};
struct AttentionTuning {
  int warps = 8, key_tile = 64;
  bool wgmma = true;  // head_dim 128 on sm_90: attention_wgmma.cu; elsewhere (and when false) the mma.sync kernel
  WgmmaSchedule schedule = WgmmaSchedule::kPingPong;
  bool cudnn = false;  // cuDNN's fused attention (attention_cudnn.h) where it loads and has an engine for the shape
  static AttentionTuning from_env();
};

// q: [n_q x n_heads x head_dim]; k: [n_kv_heads x kv_capacity x head_dim], v: [n_kv_heads x kv_capacity x
// v_dim] (cache, rows 0..pos0+n_q-1 valid); out: [n_q x n_heads x v_dim]. head_dim 64 or 128 (v_dim equal),
// or 192 with v_dim 128 (MLA, decompressed); throws otherwise.
void causal_attention(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                      const AttentionShape& s, cudaStream_t stream);
void causal_attention(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                      const AttentionShape& s, cudaStream_t stream, const AttentionTuning& tuning);

// The Hopper kernel (attention_wgmma.cu): head_dim 128, sm_90 only; same arguments and results.
bool wgmma_attention_supported(const AttentionShape& s);
void causal_attention_wgmma(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                            const AttentionShape& s, cudaStream_t stream,
                            WgmmaSchedule schedule = WgmmaSchedule::kPingPong);
// The same over the engine's fp8 K/V option (rope.cuh QkvRopeArgs::k_fp8): e4m3 rows
// [n_kv_heads x kv_capacity x 128] and one f32 scale per (head, row) [n_kv_heads x kv_capacity];
// each row is used as bf16(code x scale). head_dim 128 on sm_90 only (throws otherwise).
void causal_attention_fp8kv(const __nv_bfloat16* q, const uint8_t* k, const uint8_t* v, const float* k_scale, const float* v_scale,
                            __nv_bfloat16* out, const AttentionShape& s, cudaStream_t stream);

}  // namespace pdb::cuda
