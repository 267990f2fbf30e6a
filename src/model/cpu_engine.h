// The prefill engine's CPU backend: a driver over an architecture's blocks (definitions/definition.h,
// model/cpu_blocks.h) for HF checkpoints (f32/f16/bf16, block-FP8 dequantized on load) with its own numerics
// (OpenBLAS products, or tinyBLAS-ordered ones; f32 attention). It owns what every architecture shares: the token
// check, the chunks, the embedding, the pre-norm residual stream, the hook, cancellation, and resuming after a
// prefix whose K/V it kept (CpuEngineState: the prefill server's prefix cache). The only output the bridge needs
// is the per-layer hook: the residual stream entering each layer, per chunk.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/tuning.h"
#include "definitions/definition.h"
#include "formats/hf_config.h"
#include "model/cpu_blocks.h"
#include "model/engine_state.h"

namespace pdb {

// (layer, residual stream [rows x hidden] before the layer's attention norm, rows, first position)
using LayerHook = std::function<void(int layer, const float* h, int64_t rows, int64_t pos0)>;
// KvRounding (model/cpu_blocks.h), optional: rounds the engine's own K or V rows [rows x kv_dim] in place before
// attention reads them, so the engine attends over the values the decoder's cache holds (e.g. f16).

// The CPU engine's own K/V for positions [0, tokens), per layer, as its attention read them (rounded through the
// decoder's cache type; Q8_0 K as codes on the Q8_0 path): what a forward resumes from.
struct CpuEngineState final : EngineState {
  CpuCacheRows rows;
  std::vector<CpuLayerCache> layers;
  size_t bytes() const override {
    size_t b = 0;
    for (const auto& l : layers) b += (l.k.size() + l.v.size()) * sizeof(float) + l.kq8.size();
    return b;
  }
};

// A model as the engines load it: its config and where its weights come from.
struct OpenedModel {
  HfConfig config;
  std::unique_ptr<WeightSource> weights;
};
// An HF checkpoint directory, or the decoder's GGUF (a path ending in .gguf: formats/gguf_weights.h).
OpenedModel open_model(const std::string& model);

class CpuEngine {
 public:
  // `model`: an HF checkpoint directory or a GGUF file (open_model).
  CpuEngine(const std::string& model, int threads);
  CpuEngine(OpenedModel model, int threads);
  const std::string& weights_note() const { return weights_note_; }
  ~CpuEngine();
  const HfConfig& config() const { return cfg_; }
  // Rounds every matmul input to f16 (16), bf16 (17) or not at all (32) before the product: what
  // the decoder does for its weight type. Defaults to the checkpoint's own dtype.
  void set_activation_precision(int bits);
  // Rounds the embedding and every matmul weight through f16 (16) or bf16 (17): the values a decoder
  // GGUF of that type holds when converted from this checkpoint (e.g. bf16 -> F16 loses bits below
  // f16's normal range), so the forward multiplies what the decoder multiplies.
  void round_weights_to(int bits);
  // Runs the forward over `tokens` in chunks of `chunk`; calls hook for every layer of every chunk.
  // `cancelled` is polled between layers; returns the number of tokens fully processed.
  // `lanes` (4, 8, 16): matmuls summed in tinyBLAS order (batch-independent, decoder-like bits);
  // 0: OpenBLAS (faster, but bits may depend on the chunking).
  // `resume`: start after its first tokens positions (a CpuEngineState of this engine, computed with the same
  // lanes, rounding and cache spec): the hook then sees positions from there on. `keep`: receives the engine's
  // state of every position processed. Neither for an architecture its definition says is not resumable.
  int64_t prefill(const std::vector<int32_t>& tokens, int64_t chunk, int lanes, const LayerHook& hook,
                  const std::function<bool()>& cancelled = {}, const KvRounding& kv_round = {},
                  const DecoderCacheSpec& cache = {}, ResumePoint resume = {}, std::shared_ptr<EngineState>* keep = nullptr);
  bool resumable() const { return def_.resumable; }

 private:
  struct Layer {
    std::vector<float> in_norm, post_norm;
    std::unique_ptr<CpuAttention> attention;
    std::unique_ptr<CpuFfn> ffn;
  };
  void check_tokens(const std::vector<int32_t>& tokens) const;
  void embed_chunk(const std::vector<int32_t>& tokens, int64_t p0, int64_t n, std::vector<float>& h) const;
  CpuPass pass(int lanes, const KvRounding& kv_round, const DecoderCacheSpec& cache, CpuScratch& scratch) const;
  std::vector<CpuLayerCache> prompt_caches(int64_t T, const CpuPass& p, ResumePoint resume) const;
  HfConfig cfg_;
  const ModelDefinition& def_;
  int threads_;
  std::string weights_note_;
  std::vector<float> embed_;
  std::vector<Layer> layers_;
  int act_precision_ = 32;
  // Products with quantized weights take the activations as ggml-cpu quantizes them (the decoder's own numbers where it
  // is llama.cpp on a CPU; PDBRIDGE_ACT_QUANT=0: f32 activations).
  bool quantize_activations_ = Tuning::from_env().act_quant != "0";
  bool faithful_ok_ = true;  // every layer's RoPE can follow the decoder's
};

}  // namespace pdb
