// The CPU engine's shared blocks: what an architecture's layer is made of (definitions/definition.h). Each block
// computes its part of a layer for the rows of one chunk; the engine (cpu_engine.cpp) drives them: the chunks,
// the residual stream and its norms, the hook, resuming and keeping the K/V. Implementations:
//   cpu_attention_gqa.cpp — grouped-query attention (llama, qwen3, qwen3moe)
//   cpu_attention_mla.cpp — multi-head latent attention in llama.cpp's absorbed form (deepseek2)
//   cpu_ffn.cpp           — SwiGLU, routed experts (model/moe_ffn.h), shared + routed experts
#pragma once
#include "numerics/decoder_numerics.h"
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "definitions/definition.h"
#include "formats/hf_config.h"
#include "formats/weight_source.h"

namespace pdb {

using KvRounding = std::function<void(float* rows, int64_t n_rows, int64_t kv_dim, bool is_v)>;

// The decoder's cache, for the decoder-faithful attention over a quantized (Q8_0) cache.
struct DecoderCacheSpec {
  bool q8_0 = false;  // K and V caches are Q8_0
  bool rot_k = false, rot_v = false;
  int64_t k_rot_n = 64, v_rot_n = 64;
};

// Buffers one forward's blocks share (every layer's block uses them in turn).
struct CpuScratch {
  std::vector<float> q, k, v, att, g, u, y, rounded;
};

// How one forward multiplies and attends.
struct CpuPass {
  int lanes = 0;           // 4/8/16: every product summed in tinyBLAS order (batch-independent); 0: OpenBLAS
  bool faithful = false;   // lanes, and a RoPE the decoder shares: ggml's RoPE, flash attention and SwiGLU
  int act_precision = 32;  // 16 / 17: product inputs rounded to f16 / bf16 first
  bool quantize_activations = true;  // products with quantized weights take the activations as ggml-cpu quantizes them
  int threads = 1;
  KvRounding kv_round;     // the engine's own K/V rounded as the decoder's cache holds them
  DecoderCacheSpec cache;
  CpuScratch* scratch = nullptr;
};

// y[rows x out] = x[rows x in] W^T (W in HF's [out x in] layout), summed as the pass says. q8_1_mins: a Q4_1/Q5_1
// weight's block mins [out x in/32] (cpu_q8_1_mins): with quantized activations, their term as ggml-cpu's Q8_1 block
// sums make it is added (ggmlnum::q8_1_sum_corrections).
void cpu_matmul(const CpuPass& p, const float* x, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, float* y,
                ggmlnum::ActQuant aq = ggmlnum::ActQuant::none, const std::vector<float>* q8_1_mins = nullptr);
// A Q4_1/Q5_1 weight's block mins in HF's row order ([rows x cols/32]); empty for every other type.
std::vector<float> cpu_q8_1_mins(const WeightSource& ws, const std::string& name, int64_t rows, int64_t cols);

// One layer's cache for the whole prompt, as its attention reads it.
struct CpuLayerCache {
  std::vector<float> k, v;   // [T x k width], [T x v width] (no v: K-only rows)
  std::vector<uint8_t> kq8;  // Q8_0 K rows on the quantized-cache path, else empty
};
struct CpuCacheRows {
  int64_t k = 0, v = 0;  // floats per token
  size_t q8 = 0;         // Q8_0 bytes per token of K (0: none)
};


using WeightRounding = std::function<void(std::vector<float>&)>;

class CpuAttention {
 public:
  virtual ~CpuAttention() = default;
  virtual CpuCacheRows cache_rows(const CpuPass& p) const = 0;
  // out[n x hidden] = the attention's output projection for the normed rows x at positions [p0, p0 + n); their
  // K/V rows are written into `cache` first (positions before p0 are there already).
  virtual void forward(const float* x, int64_t n, int64_t p0, const CpuPass& p, CpuLayerCache& cache, float* out) = 0;
  virtual bool accepts_lanes(int lanes) const = 0;
  virtual bool rope_mirrored() const = 0;  // the decoder's RoPE can be followed (else the faithful path is off)
  virtual int weight_bits() const = 0;     // 16 / 17 / 32: the checkpoint's float type (the products' inputs follow it)
  virtual void round_weights(const WeightRounding& round) = 0;
};

class CpuFfn {
 public:
  virtual ~CpuFfn() = default;
  virtual void forward(const float* x, int64_t n, const CpuPass& p, float* out) = 0;  // out[n x hidden]
  virtual bool accepts_lanes(int lanes) const = 0;
  virtual void round_weights(const WeightRounding& round) = 0;
};

// The blocks a definition names, loaded for layer `layer` ("model.layers.{layer}." in the checkpoint).
std::unique_ptr<CpuAttention> load_cpu_attention(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, int64_t layer);
std::unique_ptr<CpuFfn> load_cpu_ffn(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, int64_t layer);

}  // namespace pdb
