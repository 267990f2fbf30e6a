// Tensor parallelism (Megatron-style) for the dense and MoE blocks: which slice of each weight a rank of
// `world` holds. Column-parallel (a slice of the output features): q/k/v by heads, gate|up by FFN columns
// (each expert's too); row-parallel (the matching slice of the input features): o_proj and down_proj. Every
// rank holds the whole residual stream; each computes its heads' attention and its FFN columns and adds its
// part of o_proj's / down_proj's product; one all-reduce (sum) after each of the two then gives every rank the
// unsharded layer's output. The router, the norms and the embedding are replicated: the routing is the same on
// every rank because the residual is. q head h reads kv head h / (heads / kv_heads), so contiguous head
// ranges keep each rank's q heads with their own kv heads.
// One plan for the CUDA engine's loader (model/cuda_engine.cpp) and the CPU test of its math
// (model/tensor_parallel_test.cpp): the test checks the slices the GPUs are given.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace pdb {

struct HfConfig;

struct TpShard {
  int rank = 0, world = 1;
  int64_t q_head0 = 0, q_heads = 0;    // attention heads [q_head0, q_head0 + q_heads)
  int64_t kv_head0 = 0, kv_heads = 0;  // their kv heads
  int64_t ff0 = 0, ff = 0;             // dense FFN columns: gate/up rows, down columns
  int64_t expert_ff0 = 0, expert_ff = 0;  // the same within each routed expert
};

// The plan for `rank` of `world`. Throws std::invalid_argument naming the dimension when the model cannot be
// split `world` ways (heads, kv heads, FFN widths: each slice a multiple of `align` elements, the kernels'
// and the FP8 blocks' granularity). Not for MLA (deepseek2) or DeepSeek-V4: their single latent head
// is not split by heads.
TpShard tp_shard(const HfConfig& c, int rank, int world, int64_t align = 8);
TpShard tp_shard(int64_t heads, int64_t kv_heads, int64_t ff, int64_t expert_ff, int rank, int world, int64_t align = 8);

// Rows [r0, r0 + n) of a row-major [rows x cols] matrix: a column-parallel slice (output features).
template <class T>
std::vector<T> rows_of(const std::vector<T>& w, int64_t cols, int64_t r0, int64_t n) {
  if (r0 < 0 || n < 0 || size_t((r0 + n) * cols) > w.size()) throw std::out_of_range("rows_of: slice outside the matrix");
  return std::vector<T>(w.begin() + r0 * cols, w.begin() + (r0 + n) * cols);
}
// Columns [c0, c0 + n) of a row-major [rows x cols] matrix: a row-parallel slice (input features).
template <class T>
std::vector<T> cols_of(const std::vector<T>& w, int64_t rows, int64_t cols, int64_t c0, int64_t n) {
  if (c0 < 0 || n < 0 || c0 + n > cols || size_t(rows * cols) > w.size()) throw std::out_of_range("cols_of: slice outside the matrix");
  std::vector<T> out(size_t(rows * n));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) out[size_t(r * n + j)] = w[size_t(r * cols + c0 + j)];
  return out;
}

}  // namespace pdb
