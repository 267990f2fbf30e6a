// Recipe for llama.cpp's `deepseek4` (DeepSeek-V4): every section of the decoder's state for one layer,
// from that layer's 4-stream residual (../shared/reference/llama-cpp-deepseek4.md §2-3, the state layout
// formats/state_file_dsv4.h). Per token: the decoder's hyper-connection pre-mix and attn_norm give `cur`;
// from it the window row (RMSNorm(W_kv cur) * norm, RoPE on the last r dims), and on compressed layers the
// compressors' projections a_t, g_t (+ ape) whose per-channel softmax pools over 8 overlapping tokens
// (ratio 4: CSA, and the lightning indexer's LID, always Hadamard-rotated) or 128 (HCA) give one row per
// block, normed and roped at the block's first position; the f32 rings are the last tokens' (a, g).
// Arithmetic: plain f32 (the tolerance class: the decoder's SIMD expf in the pool softmax and its matmul
// order are not mirrored yet). Whole prompts only; the chunk carries (the rings) are the next step.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/ggml_types.h"
#include "formats/state_file_dsv4.h"
#include "model/deepseek4_config.h"

namespace pdb {

class GgufFile;

struct Deepseek4LayerSections {
  int64_t ratio = 0;
  std::vector<float> window;              // [min(T, W) x D]: rows of positions T-min(T,W) .. T-1
  std::vector<float> pool;                // ratio 4: CSA [T/4 x D]; ratio 128: HCA [T/128 x D]
  std::vector<float> lid;                 // ratio 4: [T/4 x I]
  std::vector<float> ring_kv, ring_score; // ratio 4: [8 x 2D]; 128: [128 x D]
  std::vector<float> lid_kv, lid_score;   // ratio 4: [8 x 2I]
};

class Deepseek4Recipe {
 public:
  explicit Deepseek4Recipe(const std::string& gguf_path);
  ~Deepseek4Recipe();
  const Deepseek4Config& config() const { return c_; }
  // The decoder's layer-0 input: each token's embedding in all four streams, [T x 4 x E].
  std::vector<float> layer0_input(const std::vector<int32_t>& tokens) const;
  // x: [T x 4 x E], the residual streams entering `layer` for positions 0..T-1. `k_type` decides the
  // Hadamard rotation of the window / CSA / HCA rows (quantized types only); LID rows are always rotated.
  // `all_raw_rows`: `window` holds every position's row (what the engine attends over); `cur_out`: the
  // layer's attention input (the engine's q path starts from it).
  Deepseek4LayerSections sections(int layer, const float* x, int64_t T, GgmlType k_type, bool all_raw_rows = false,
                                  std::vector<float>* cur_out = nullptr) const;
  const GgufFile& gguf() const { return *g_; }
  // The sections as the decoder's file holds them: rows in `k_type` (already rotated where it rotates), rings f32.
  Dsv4LayerBytes to_bytes(const Deepseek4LayerSections& s, GgmlType k_type) const;

 private:
  struct Layer;
  Deepseek4Config c_;
  std::shared_ptr<const GgufFile> g_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<float> embed_;
};

}  // namespace pdb
