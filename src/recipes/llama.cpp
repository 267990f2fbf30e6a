// Recipe for llama.cpp's `llama` architecture (src/models/llama.cpp in the decoder):
//   x = rms_norm(h) * attn_norm;  K = RoPE_NORM(Wk x + bk);  V = Wv x + bv
// The GGUF's attn_k rows are already permuted by the converter, so NORM (adjacent pairs) RoPE on
// them yields llama.cpp's cached K. Llama-3 frequency scaling comes from rope_freqs.weight. Nothing
// happens to K between projection and RoPE, so the shared Recipe::kv_f32 is the whole recipe.
#include "formats/gguf.h"
#include "recipes/recipe.h"

namespace pdb {
namespace {

class LlamaRecipe final : public Recipe {
 public:
  LlamaRecipe(const GgufFile& g, int threads, int max_layers) {
    threads_ = threads;
    load_common(g, "llama", max_layers);
  }
};

}  // namespace

std::unique_ptr<Recipe> make_llama_recipe(const GgufFile& g, int threads, int max_layers) { return std::make_unique<LlamaRecipe>(g, threads, max_layers); }

}  // namespace pdb
