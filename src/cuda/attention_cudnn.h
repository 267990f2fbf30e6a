// cuDNN's fused flash attention for prefill, through its graph API, as an A/B peer of our kernels
// (attention.cuh): same arguments, same results up to summation order. libcudnn.so.9 is loaded at first use
// (PDBRIDGE_CUDNN_LIB names another file), so a build needs only cuDNN's headers and a box without cuDNN runs
// our kernels. One execution plan per shape (queries, keys, heads, widths, cache capacity), built on first
// use and kept per device; the build's time is reported by cudnn_attention_stats().
// CPU twin: numerics/reference_ops.h causal_attention_ref (the same as our kernels').
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/attention.cuh"

namespace pdb::cuda {

// Whether cuDNN can be loaded here (its version, or why not, in *why).
bool cudnn_attention_available(std::string* why = nullptr);

// The causal attention of attention.cuh through cuDNN: bf16 Q/K/V/out in the engine's layouts (q and out
// [n_q x n_heads x width], k and v [n_kv_heads x kv_capacity x width]), queries at pos0.. over keys 0..pos0+n_q-1
// (the mask's diagonal at the bottom right), f32 softmax. Throws std::runtime_error with cuDNN's message where it
// has no engine for the shape.
void causal_attention_cudnn(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                            const AttentionShape& s, cudaStream_t stream);

struct CudnnAttentionStats {
  int64_t plans = 0;          // execution plans built
  double plan_build_ms = 0;   // host time spent building them
  std::string last_engine;    // the engine cuDNN's heuristics gave the last plan
};
CudnnAttentionStats cudnn_attention_stats();

}  // namespace pdb::cuda
