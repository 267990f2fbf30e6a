// The CPU engine's DeepSeek-V4 forward (llama.cpp's src/models/deepseek4.cpp, read for this): four
// hyper-connection streams per token; per layer the attention over the sliding window of raw rows plus the
// visible compressed rows (HCA: every finished 128-block; CSA: the lightning indexer's top-k of the finished
// 4-blocks), per-head sinks, scale 1/sqrt(D), the output de-roped and through the grouped output LoRA; then
// the MoE (hash-routed early layers by tid2eid, sqrt-softplus scores with the selection bias, normalized
// weights, clamped SwiGLU, the shared expert). K/V rows are the recipe's (recipes/deepseek4.h), rounded
// through the decoder's cache type as the decoder attends over them. Weights: the decoder GGUF's (F32) for
// (Deepseek4Weights) or an HF checkpoint's. Plain f32 sums: tolerance class.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "formats/ggml_types.h"
#include "recipes/deepseek4.h"

namespace pdb {

class GgufFile;
class Deepseek4Checkpoint;

// The engine's weights by GGUF tensor name (f32 values; the hash layers' expert ids): a GGUF's, or an HF
// checkpoint's in DeepSeek's layout (FP8 and FP4 dequantized with their scales, formats/hf_deepseek4.h).
struct Deepseek4Weights {
  std::function<std::vector<float>(const std::string&)> f32;
  std::function<std::vector<int32_t>(const std::string&)> i32;
  // The GGUF MXFP4 blocks of a routed-expert tensor where the weights hold it so (an official checkpoint's FP4,
  // losslessly repacked; a GGUF's MXFP4): the GPU engine keeps them FP4 in memory. False: use f32.
  std::function<bool(const std::string&, std::vector<uint8_t>&)> mxfp4;
  std::string describe;
  static Deepseek4Weights from_gguf(std::shared_ptr<const GgufFile> g);
  static Deepseek4Weights from_checkpoint(std::shared_ptr<const Deepseek4Checkpoint> ck);
};

class Deepseek4CpuEngine {
 public:
  // (layer, x: [T x 4 x E] the streams entering it, T)
  using Hook = std::function<void(int layer, const float* x, int64_t T)>;
  // Without `weights`: the recipe's GGUF (the decoder's own weights).
  explicit Deepseek4CpuEngine(const Deepseek4Recipe& recipe, const Deepseek4Weights* weights = nullptr);
  ~Deepseek4CpuEngine();
  // (layer, x: [rows x 4 x E] the streams entering it for positions pos0.., pos0, rows, the recipe's sections
  // of this chunk with every position's window row, as the engine attends over them); false stops the prefill
  using ChunkHook = std::function<bool(int layer, const float* x, int64_t pos0, int64_t rows, const Deepseek4LayerSections& s)>;
  // One-shot forward over the prompt; the hook sees every layer's input, the last layer's included.
  void forward(const std::vector<int32_t>& tokens, GgmlType k_type, const Hook& hook) const;
  // Chunk after chunk (each chunk through every layer before the next: what the prefill server streams):
  // the layers keep the last W raw rows, every compressed and indexer row and the compressors' carries
  // between chunks. Returns the tokens whose every layer was seen by the hook.
  // `k_type`: the decoder's cache type (the rows are attended over as it stores them).
  int64_t prefill(const std::vector<int32_t>& tokens, int64_t chunk, GgmlType k_type, const ChunkHook& hook,
                  const std::function<bool()>& stop = {}) const;
  const Deepseek4Recipe& recipe() const { return recipe_; }
  // The GPU engine's default FP8 indexer as a twin: the queries and the indexer rows (bf16 first, as the GPU
  // holds them) rounded to their e4m3 values (dsv4_indexer_fp8_rows) before the scores. Off: the decoder's own
  // f32 indexer.
  void set_fp8_indexer(bool on) { fp8_indexer_ = on; }

 private:
  struct Layer;
  const Deepseek4Recipe& recipe_;
  std::vector<std::unique_ptr<Layer>> layers_;
  bool fp8_indexer_ = false;
};

}  // namespace pdb
