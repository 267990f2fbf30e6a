// The GPU engine's chunk for DeepSeek-V4 where neither the request nor the server names one. Its routed products
// read every expert's FP4 codes once per chunk: at V4-Flash's shapes 4,096-token chunks leave ~96 rows per expert
// and ran 8,335-8,487 tok/s over a 32K prompt against 11,780-12,087 in one 32K chunk (docs/RESULTS.md, session 39).
// So the largest chunk whose scratch fits: the engine's buffers grow with the chunk's rows (model/cuda_engine_dsv4.cpp
// size_scratch, size_prompt_state), and this is their bytes per row, host arithmetic on the config.
#pragma once
#include <algorithm>
#include <cstdint>

#include "formats/deepseek4_config.h"

namespace pdb {

inline int64_t dsv4_cuda_bytes_per_chunk_row(const Deepseek4Config& c) {
  const int64_t E = c.hidden, D = c.head_dim, H = c.heads, Id = c.index_dim, Hi = c.index_heads, K = c.experts_used, F = c.expert_ff;
  const int64_t FS = c.expert_ff * c.shared_experts, mix = 24;  // cuda::kDsv4MixFloats
  int64_t b = 2 * 4 * E * 4                     // the residual streams and their copy (x, xa)
              + 6 * E * 4 + 2 * E * 2 + E + E / 8  // the f32 rows, their bf16 copies, Q8_0 codes and scales
              + 4 * mix * 4 + 2 * c.rope_dims * 4 + 2 * std::max(D, Id) * 4
              + c.q_lora * 6 + H * D * (4 + 2 + 2) + c.out_groups * c.out_lora * 2  // the q path, attention, output LoRA
              + Hi * Id * 5 + Hi * 8 + c.index_top_k * 4                          // the indexer's queries, weights, choices
              + c.experts * 4 + K * 16                                            // the router and the grouping
              + K * (E * 2 + 2 * F * 2 + F * 2 + E * 2)                           // the routed rows (unfused: gathered, gate|up)
              + 3 * FS * 2;                                                       // the shared expert
  for (int32_t ratio : c.compress_ratios) {                                        // per layer: the window, the compressors' rings
    b += D * 2;
    if (ratio) b += 2 * (ratio == 4 ? 2 : 1) * D * 4;
    if (ratio == 4) b += 2 * 2 * Id * 4;
  }
  return b;
}

// The largest of cap, cap / 2, ... down to `floor` whose rows take at most `share` of `free_bytes`; `floor` where
// none does (the server's own default: the engine's allocation then says whether it fits).
inline int64_t dsv4_cuda_largest_chunk(int64_t bytes_per_row, int64_t free_bytes, int64_t cap = 32768, int64_t floor = 4096, double share = 0.6) {
  for (int64_t chunk = cap; chunk > floor; chunk /= 2)
    if (double(chunk) * double(bytes_per_row) <= share * double(free_bytes)) return chunk;
  return floor;
}

}  // namespace pdb
