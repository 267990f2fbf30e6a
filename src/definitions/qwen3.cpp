// qwen3: llama's layer with a per-head RMSNorm of Q and K before RoPE, which the decoder applies in NEOX
// pairs (halves, as HF's rotate_half: no row permutation in its GGUF).
#include "definitions/definition.h"

namespace pdb {

const ModelDefinition& qwen3_definition() {
  static const ModelDefinition d = [] {
    ModelDefinition m;
    m.name = "qwen3";
    m.attention = AttentionKind::gqa;
    m.qk_norm = true;
    m.decoder_rope = RopeMode::Neox;
    m.ffn = [](const HfConfig& c, int64_t) { return FfnPlan{FfnKind::swiglu, c.intermediate_size, "mlp."}; };
    return m;
  }();
  return d;
}

}  // namespace pdb
