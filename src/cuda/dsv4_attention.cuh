// DeepSeek-V4's sparse attention on the tensor cores (the CPU twin: numerics/deepseek4_blocks.h, dsv4_attend): each
// query's 64 heads against its own keys, read in place: the window rows of the positions t - W + 1 .. t, then the
// compressed rows it sees (ratio 128: every finished block; ratio 4: the indexer's top-k, -1 for none). The rows
// are the keys and the values (one latent head of D), the softmax has a per-head sink logit whose weight is
// dropped, and the output is left roped (dsv4_derope turns it back). Before it the keys were gathered per query
// into a batch (655 KB each at V4-Flash's shapes) for two batched cuBLAS products: dsv4_gather_keys, kept as the
// A/B (PDBRIDGE_DSV4_ATTN=gather).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

struct Dsv4SparseAttention {
  const __nv_bfloat16* q = nullptr;  // [nq x H x D], roped
  const __nv_bfloat16* win = nullptr;  // [rows x D], row 0 = position win_first
  int64_t win_first = 0;
  const __nv_bfloat16* pool = nullptr;  // the compressed rows [n_pool x D]
  int64_t n_pool = 0;
  const int32_t* idx = nullptr;  // ratio 4: [nq x top_k]
  const float* sinks = nullptr;  // [H]
  int top_k = 0, ratio = 0, W = 0, H = 0, D = 0;
  int64_t t0 = 0, nq = 0;  // positions of the queries
  float scale = 1.0f;
};

bool dsv4_sparse_attention_supported(int heads, int dim);  // heads <= 64; dim 64 or 512
// out [nq x H x D] bf16
void dsv4_sparse_attention(const Dsv4SparseAttention& a, __nv_bfloat16* out, cudaStream_t s);
// The same on Hopper's wgmma (dsv4_attention_wgmma.cu): V4-Flash's width only (dim 512, <= 64 heads), sm_90.
bool dsv4_sparse_attention_wgmma_supported(int heads, int dim);
void dsv4_sparse_attention_wgmma(const Dsv4SparseAttention& a, __nv_bfloat16* out, cudaStream_t s);

}  // namespace pdb::cuda
