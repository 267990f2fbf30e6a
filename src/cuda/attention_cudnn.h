// cuDNN's fused flash attention for prefill, through its graph API (cudnn_graph.h), as an A/B peer of our kernels
// (attention.cuh): same arguments, same results up to summation order. One execution plan per shape (queries, keys,
// heads, widths, cache capacity), built on first use and kept per device; cudnn_attention_stats() reports the builds.
// CPU twin: numerics/reference_ops.h causal_attention_ref (the same as our kernels').
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/attention.cuh"
#include "cuda/cudnn_graph.h"

namespace pdb::cuda {

// Whether cuDNN can be loaded here (its version, or why not, in *why).
bool cudnn_attention_available(std::string* why = nullptr);

// The causal attention of attention.cuh through cuDNN: bf16 Q/K/V/out in the engine's layouts (q and out
// [n_q x n_heads x width], k and v [n_kv_heads x kv_capacity x width]), queries at pos0.. over keys 0..pos0+n_q-1
// (the mask's diagonal at the bottom right), f32 softmax. Throws std::runtime_error with cuDNN's message where it
// has no engine for the shape.
void causal_attention_cudnn(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                            const AttentionShape& s, cudaStream_t stream);

using CudnnAttentionStats = CudnnPlanStats;
CudnnAttentionStats cudnn_attention_stats();

}  // namespace pdb::cuda
