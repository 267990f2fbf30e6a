// deepseek2 (DeepSeek-V2 / V2-Lite): multi-head latent attention, first_k_dense_replace dense SwiGLU layers, then
// shared experts plus routed experts (norm_topk_prob and routed_scaling_factor from config.json). Its forward is
// not resumed from a kept prefix, and its products are not rounded to the decoder GGUF's half type yet.
#include "definitions/definition.h"

namespace pdb {

const ModelDefinition& deepseek2_definition() {
  static const ModelDefinition d = [] {
    ModelDefinition m;
    m.name = "deepseek2";
    m.attention = AttentionKind::mla;
    m.decoder_rope = RopeMode::Norm;
    m.resumable = false;
    m.mirrors_half_precision = false;
    m.ffn = [](const HfConfig& c, int64_t l) {
      if (l < c.first_k_dense_replace) return FfnPlan{FfnKind::swiglu, c.intermediate_size, "mlp."};
      return FfnPlan{FfnKind::shared_and_routed, c.moe_intermediate_size * c.n_shared_experts, "mlp.shared_experts."};
    };
    return m;
  }();
  return d;
}

}  // namespace pdb
