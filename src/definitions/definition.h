// An architecture as the prefill engines build it: which shared blocks each layer is made of (model/cpu_blocks.h,
// model/cuda_blocks.h), the tensors they read, and the few rules in which it differs from its family. The engines
// (model/cpu_engine.cpp, model/cuda_engine.cpp) are drivers over these blocks and never ask which architecture
// runs; each architecture is one file here (llama.cpp, qwen3.cpp, qwen3moe.cpp, deepseek2.cpp), registered in
// definitions.cpp. DeepSeek-V4 (hyper-connections, a pooled cache) has its own engines (model/*_dsv4.*).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/hf_config.h"
#include "numerics/rope_ggml.h"

namespace pdb {

enum class AttentionKind {
  gqa,  // grouped-query attention: q/k/v/o_proj, optional per-head q_norm/k_norm, RoPE on the whole head
  mla,  // multi-head latent attention (DeepSeek-V2): a latent K row per token, queries absorbed (CPU) or decompressed (GPU)
};

enum class FfnKind {
  swiglu,             // mlp.{gate,up,down}_proj
  routed,             // mlp.gate + mlp.experts.{e}.{gate,up,down}_proj, every expert's output weighted and summed
  shared_and_routed,  // a SwiGLU of the shared experts (mlp.shared_experts.*) plus the routed experts
};

// One layer's FFN: its kind and, for the SwiGLU part, its width and where its tensors are.
struct FfnPlan {
  FfnKind kind = FfnKind::swiglu;
  int64_t swiglu_width = 0;            // dense: intermediate_size; shared experts: their summed width
  std::string swiglu_prefix = "mlp.";  // after "model.layers.{l}."
};

struct ModelDefinition {
  std::string name;  // llama.cpp's architecture name, as HfConfig::arch
  AttentionKind attention = AttentionKind::gqa;
  bool qk_norm = false;                  // per-head RMSNorm of Q and K before RoPE
  RopeMode decoder_rope = RopeMode::Norm;  // the pairs the decoder's RoPE rotates (the faithful forward follows it)
  bool gguf_permutes_qk = false;         // convert_hf_to_gguf permutes Q/K rows: the faithful forward sums in that order
  bool renormalize_topk_always = false;  // the decoder renormalizes the chosen experts' weights whatever config.json says
  bool resumable = true;                 // a forward may resume after a kept prefix state
  bool mirrors_half_precision = true;    // weights/activations follow the decoder GGUF's f16/bf16 (deepseek2: not mirrored yet)
  FfnPlan (*ffn)(const HfConfig& c, int64_t layer) = nullptr;
  // The renormalization of the routed experts' weights the decoder applies.
  bool renormalize_topk(const HfConfig& c) const { return renormalize_topk_always || c.norm_topk_prob; }
};

// The definition of `arch` (HfConfig::arch); throws std::invalid_argument naming the known ones.
const ModelDefinition& model_definition(const std::string& arch);
std::vector<std::string> defined_architectures();

// The definitions (one file each).
const ModelDefinition& llama_definition();
const ModelDefinition& qwen3_definition();
const ModelDefinition& qwen3moe_definition();
const ModelDefinition& deepseek2_definition();

}  // namespace pdb
