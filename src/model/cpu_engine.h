// The prefill engine's CPU backend: a chunked causal forward for llama, qwen3, qwen3moe and deepseek2 (MLA,
// model/cpu_engine_mla.cpp) HF checkpoints
// (f32/f16/bf16, block-FP8 dequantized on load) with its own numerics (OpenBLAS GEMMs, f32
// attention). A forward may resume after a prefix whose K/V it kept (CpuEngineState: the prefill server's prefix cache). The only output the bridge
// needs is the per-layer hook: the residual stream entering each layer, per chunk.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "formats/hf_config.h"
#include "model/engine_state.h"
#include "numerics/rope_ggml.h"

namespace pdb {

// (layer, residual stream [rows x hidden] before the layer's attention norm, rows, first position)
using LayerHook = std::function<void(int layer, const float* h, int64_t rows, int64_t pos0)>;
// Optional: rounds the engine's own K or V rows [rows x kv_dim] in place before attention reads
// them, so the engine attends over the values the decoder's cache holds (e.g. f16).
using KvRounding = std::function<void(float* rows, int64_t n_rows, int64_t kv_dim, bool is_v)>;

// The decoder's cache, for the decoder-faithful attention over a quantized (Q8_0) cache.
struct DecoderCacheSpec {
  bool q8_0 = false;               // K and V caches are Q8_0
  bool rot_k = false, rot_v = false;
  int64_t k_rot_n = 64, v_rot_n = 64;
};

// The CPU engine's own K/V for positions [0, tokens), per layer, as its attention read them (rounded through the
// decoder's cache type; Q8_0 K as codes on the Q8_0 path): what a forward resumes from.
struct CpuEngineState final : EngineState {
  int64_t kv_dim = 0;
  std::vector<std::vector<float>> k, v;
  std::vector<std::vector<uint8_t>> kq8;  // the Q8_0 path's K rows (else empty)
  size_t bytes() const override {
    size_t b = 0;
    for (const auto& x : k) b += x.size() * sizeof(float);
    for (const auto& x : v) b += x.size() * sizeof(float);
    for (const auto& x : kq8) b += x.size();
    return b;
  }
};

class CpuEngine {
 public:
  CpuEngine(const std::string& hf_dir, int threads);
  ~CpuEngine();
  const HfConfig& config() const { return cfg_; }
  // Rounds every matmul input to f16 (16), bf16 (17) or not at all (32) before the product: what
  // the decoder does for its weight type. Defaults to the checkpoint's own dtype.
  void set_activation_precision(int bits) { act_precision_ = bits; }
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
  // state of every position processed. Neither for deepseek2 (MLA), which always computes every token.
  int64_t prefill(const std::vector<int32_t>& tokens, int64_t chunk, int lanes, const LayerHook& hook,
                  const std::function<bool()>& cancelled = {}, const KvRounding& kv_round = {},
                  const DecoderCacheSpec& cache = {}, ResumePoint resume = {}, std::shared_ptr<EngineState>* keep = nullptr);
  bool resumable() const { return !cfg_.mla(); }

 private:
  struct Layer;
  struct MlaLayer;  // deepseek2 (cpu_engine_mla.cpp)
  // Shared by every forward: token ids checked against the vocabulary; a chunk's embedding rows.
  void check_tokens(const std::vector<int32_t>& tokens) const;
  void embed_chunk(const std::vector<int32_t>& tokens, int64_t p0, int64_t n, std::vector<float>& h) const;
  void load_mla(const std::string& hf_dir);
  int64_t prefill_mla(const std::vector<int32_t>& tokens, int64_t chunk, int lanes, const LayerHook& hook,
                      const std::function<bool()>& cancelled, const KvRounding& kv_round);
  std::vector<std::unique_ptr<MlaLayer>> mla_layers_;
  HfConfig cfg_;
  int threads_;
  std::vector<float> embed_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<float> inv_freq_;
  float rope_scale_ = 1.0f;
  int act_precision_ = 32;
  // Decoder-faithful mode (lanes != 0): llama.cpp's RoPE recurrence on Q/K in the GGUF's row order
  // (llama's Q/K rows permuted as the converter does), its tiled flash attention and its SwiGLU.
  GgmlRopeParams ggml_rope_;
  bool faithful_ok_ = false;
  std::vector<std::vector<float>> wq_perm_, wk_perm_;  // 16: f16 weights, 17: bf16 weights: matmul inputs rounded as a half-precision engine does
};

}  // namespace pdb
