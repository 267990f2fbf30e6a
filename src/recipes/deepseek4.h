// Recipe for llama.cpp's `deepseek4` (DeepSeek-V4): every section of the decoder's state for one layer,
// from that layer's 4-stream residual (../shared/reference/llama-cpp-deepseek4.md §2-3, the state layout
// formats/state_file_dsv4.h). Per token: the decoder's hyper-connection pre-mix and attn_norm give `cur`;
// from it the window row (RMSNorm(W_kv cur) * norm, RoPE on the last r dims), and on compressed layers the
// compressors' projections a_t, g_t (+ ape) whose per-channel softmax pools over 8 overlapping tokens
// (ratio 4: CSA, and the lightning indexer's LID, always Hadamard-rotated) or 128 (HCA) give one row per
// block, normed and roped at the block's first position; the f32 rings are the last tokens' (a, g).
// Arithmetic: plain f32 (the tolerance class: the decoder's SIMD expf in the pool softmax and its matmul
// order are not mirrored yet). Whole prompts or chunks (sections_chunk, with the compressors' carries).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/ggml_types.h"
#include "formats/state_file_dsv4.h"
#include "formats/deepseek4_config.h"

namespace pdb {

class GgufFile;

struct Deepseek4LayerSections {
  int64_t ratio = 0;
  int64_t window_first = 0, pool_first = 0, lid_first = 0;  // the position / block index of the first row of each
  std::vector<float> window;              // [min(T, W) x D]: rows of positions T-min(T,W) .. T-1
  std::vector<float> pool;                // ratio 4: CSA [T/4 x D]; ratio 128: HCA [T/128 x D]
  std::vector<float> lid;                 // ratio 4: [T/4 x I]
  std::vector<float> ring_kv, ring_score; // ratio 4: [8 x 2D]; 128: [128 x D]
  std::vector<float> lid_kv, lid_score;   // ratio 4: [8 x 2I]
};

// What a chunked recipe carries from one chunk to the next, per layer: the compressors' last tokens'
// (a_t, g_t + ape) - what the blocks still open at the chunk's end, and the rings, will need.
struct Deepseek4Carry {
  struct History {
    int64_t first = 0;         // position of the first carried token
    std::vector<float> a, g;   // [tokens x c*width]
  };
  std::vector<History> pool, lid;  // per layer: the attention's compressor, the indexer's
};

// The model's shapes and constants as the decoder GGUF's keys give them.
Deepseek4Config deepseek4_config_from_gguf(const GgufFile& g);

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
  // The same for positions [pos0, pos0 + rows) of a T-token prompt, chunk after chunk (each layer's chunks in
  // order, `carry` kept between them): the window rows of this chunk among the last W, the blocks that finish
  // in it, and the rings after its last token (those of the prompt's last chunk are the state's). Equals
  // `sections` over the whole prompt, row for row.
  Deepseek4LayerSections sections_chunk(int layer, const float* x, int64_t pos0, int64_t rows, int64_t T, GgmlType k_type,
                                        Deepseek4Carry& carry, bool all_raw_rows = false, std::vector<float>* cur_out = nullptr) const;
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
