// DeepSeek-V4's lightning indexer on the GPU (the CPU twin: numerics/deepseek4_blocks.h, dsv4_indexer_select): for
// each query t of a ratio-4 layer, the score of every finished 4-block b visible to it (b < (t+1)/4) is
//   sum_h w[t][h] * max(0, q[t][h] . k[b])
// and the top_k blocks by score are the compressed rows its attention reads. The scores in one fused kernel
// (indexer_scores: the q . k products on tensor cores, the ReLU and the weighted sum over heads in registers,
// only the causal blocks computed), or, for head counts it does not take, one GEMM per query chunk (gemm.cuh:
// S [n_q*H x n_blocks] f32) and the weighted ReLU sum; the selection one block per query row (radix select of
// the k-th score, then the indices in ascending order).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

struct IndexerShape {
  int64_t n_q = 0;       // queries of this chunk
  int64_t pos0 = 0;      // position of the first query
  int heads = 0;         // H (64 in V4-Flash)
  int64_t n_blocks = 0;  // columns of S and of the scores: the blocks finished before the chunk's last query
  int ratio = 4;
  int top_k = 0;
};

// scores [n_q x n_blocks] from s [n_q*heads x n_blocks] and w [n_q x heads]; -inf where b is not visible to t.
void indexer_weighted_relu(const float* s, const float* w, float* scores, const IndexerShape& sh, cudaStream_t stream);
// The same scores straight from the bf16 queries q [n_q x heads x dim] (rotated, as the LID rows) and rows
// [n_blocks x dim]: S never exists (at 32K tokens it was 64 GB of f32 written and read per ratio-4 layer).
bool indexer_scores_supported(int heads, int dim);  // dim 128, heads 16, 32, 64 or 128
void indexer_scores(const __nv_bfloat16* q, const __nv_bfloat16* rows, const float* w, float* scores, const IndexerShape& sh, int dim,
                    cudaStream_t stream);
// The FP8 indexer (DeepSeek's own precision for it; docs/RESULTS.md measures how much of the bf16 top-k it keeps):
// q and the rows as e4m3 codes with one power-of-two scale per 128-wide row (indexer_fp8_rows, the CPU twin
// dsv4_indexer_fp8_rows), the scores from them in one fused kernel on Hopper's FP8 wgmma (dsv4_indexer_wgmma.cu),
// which adds inside the tensor core with fewer bits than f32 (the kernel test's bound says how many). Any head count to 128 (a query's rows padded to 32, 64 or 128). q [n_q x heads x 128]
// with q_scale [n_q x heads], rows [n_blocks x 128] with row_scale [n_blocks]; the scores are those of the values
// code x scale.
bool indexer_scores_fp8_supported(int heads, int dim);
void indexer_fp8_rows(const float* x, int64_t rows, int dim, uint8_t* codes, float* scales, cudaStream_t stream);
void indexer_fp8_rows(const __nv_bfloat16* x, int64_t rows, int dim, uint8_t* codes, float* scales, cudaStream_t stream);
void indexer_scores_fp8(const uint8_t* q, const float* q_scale, const uint8_t* rows, const float* row_scale, const float* w, float* scores,
                        const IndexerShape& sh, int dim, cudaStream_t stream);
// idx [n_q x top_k]: per query the top_k visible blocks by score, ascending block index (ties of the k-th score:
// lower indices first); -1 past the visible count when fewer than top_k are visible. By warps (indexer_topk_warps,
// the default); PDBRIDGE_DSV4_TOPK=global: one radix pass per byte over the scores in global memory by block scans;
// =smem: a query's scores held in shared memory (dsv4_indexer_topk.cu) where n_blocks <= indexer_topk_smem_blocks().
void indexer_topk(const float* scores, int32_t* idx, const IndexerShape& sh, cudaStream_t stream);
// The default top-k: the scores read from global memory as by the block scans' kernel, with warp-aggregated
// counts, a scan for each digit and the selection by ballots over each warp's run of indices (dsv4_indexer_topk.cu).
void indexer_topk_warps(const float* scores, int32_t* idx, const IndexerShape& sh, cudaStream_t stream);
int64_t indexer_topk_smem_blocks();  // on the current device
bool indexer_topk_smem(const float* scores, int32_t* idx, const IndexerShape& sh, cudaStream_t stream);  // false: too long

}  // namespace pdb::cuda
