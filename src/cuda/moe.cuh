// The mixture-of-experts block's own kernels on the GPU: routing (softmax over the router's logits,
// top-k, renormalization and scale), grouping the (token, choice) pairs by expert so that each
// expert's rows are contiguous for one grouped product, the gather of the rows into that order, and the
// weighted combination back into the residual stream. The products themselves are grouped_gemm.cuh's.
// CPU twins: model/moe_ffn.h (moe_route for the routing; the grouping is checked by construction in
// kernels_test.cpp: every pair placed once, expert-contiguous, in token order within an expert).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

struct MoeRouteArgs {
  int64_t rows = 0;
  int n_expert = 0, n_used = 0;  // n_expert <= 256, n_used <= n_expert
  bool renormalize = true;       // divide the selected probabilities by their sum (clamped at 2^-14)
  float scale = 1.0f;            // then multiply by this (routed_scaling_factor)
};
// logits [rows x n_expert] f32 -> experts [rows x n_used] (descending probability; ties: lower index first)
// and their weights [rows x n_used].
void moe_route(const float* logits, int32_t* experts, float* weights, const MoeRouteArgs& a, cudaStream_t s);

// Places the rows*n_used pairs in expert order. counts/offsets [n_expert] (offsets exclusive); slot_of
// [rows x n_used]: the pair's row in the grouped order; token_of [rows*n_used]: the token a grouped row
// came from. Within an expert, pairs keep token order (deterministic, whatever the launch).
void moe_group(const int32_t* experts, int64_t rows, int n_used, int n_expert, int32_t* counts, int32_t* offsets, int32_t* slot_of,
               int32_t* token_of, cudaStream_t s);
// The counting alone (counts and their exclusive scan), and the placement alone, at the given offsets (the padded layout of model/moe_padding.h: each expert's first row).
void moe_count(const int32_t* experts, int64_t rows, int n_used, int n_expert, int32_t* counts, int32_t* offsets, cudaStream_t s);
void moe_place(const int32_t* experts, int64_t rows, int n_used, int n_expert, const int32_t* offsets, int32_t* slot_of, int32_t* token_of,
               cudaStream_t s);
// xg[g] = x[token_of[g]]  (bf16 rows of `dim`, dim a multiple of 8)
void gather_rows(const __nv_bfloat16* x, const int32_t* token_of, int64_t grouped_rows, int64_t dim, __nv_bfloat16* xg, cudaStream_t s);
// h[r] += sum_j weights[r][j] * y[slot_of[r][j]]  (f32 sums in selection order)
void moe_combine(const __nv_bfloat16* y, const int32_t* slot_of, const float* weights, int64_t rows, int n_used, int64_t dim, float* h,
                 cudaStream_t s);

}  // namespace pdb::cuda
