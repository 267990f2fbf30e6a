// llama: GQA attention with RoPE on the whole head and a SwiGLU FFN. Its GGUF holds Q and K with their rows
// permuted (convert_hf_to_gguf's permute), so ggml's adjacent-pair RoPE (NORM) rotates HF's half pairs.
#include "definitions/definition.h"

namespace pdb {

const ModelDefinition& llama_definition() {
  static const ModelDefinition d = [] {
    ModelDefinition m;
    m.name = "llama";
    m.attention = AttentionKind::gqa;
    m.decoder_rope = RopeMode::Norm;
    m.gguf_permutes_qk = true;
    m.ffn = [](const HfConfig& c, int64_t) { return FfnPlan{FfnKind::swiglu, c.intermediate_size, "mlp."}; };
    return m;
  }();
  return d;
}

}  // namespace pdb
