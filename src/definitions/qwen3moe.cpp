// qwen3moe: qwen3's attention, and routed experts in every layer (no shared expert). llama.cpp's qwen3moe graph
// renormalizes the chosen experts' weights whatever norm_topk_prob says.
#include "definitions/definition.h"

namespace pdb {

const ModelDefinition& qwen3moe_definition() {
  static const ModelDefinition d = [] {
    ModelDefinition m;
    m.name = "qwen3moe";
    m.attention = AttentionKind::gqa;
    m.qk_norm = true;
    m.decoder_rope = RopeMode::Neox;
    m.renormalize_topk_always = true;
    m.ffn = [](const HfConfig&, int64_t) { return FfnPlan{FfnKind::routed, 0, ""}; };
    return m;
  }();
  return d;
}

}  // namespace pdb
