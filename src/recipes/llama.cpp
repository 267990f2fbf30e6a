// Recipe for llama.cpp's `llama` architecture (src/models/llama.cpp in the decoder):
//   x = rms_norm(h) * attn_norm;  K = RoPE_NORM(Wk x + bk);  V = Wv x + bv
// The GGUF's attn_k rows are already permuted by the converter, so NORM (adjacent pairs) RoPE on
// them yields llama.cpp's cached K. Llama-3 frequency scaling comes from rope_freqs.weight.
#include <fmt/format.h>

#include "common/parallel.h"
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

  void kv_f32(int layer, const float* h, int64_t rows, int64_t pos0, int simd, float* k, float* v) const override {
    const int64_t E = info_.n_embd, C = info_.n_embd_kv(), hd = info_.head_dim;
    std::vector<float> x(static_cast<size_t>(rows * E));
    attn_input(layer, h, rows, x.data());
    project(wk_[size_t(layer)], x.data(), rows, simd, k);
    project(wv_[size_t(layer)], x.data(), rows, simd, v);
    parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
      std::vector<float> cache(static_cast<size_t>(hd));
      for (int64_t r = b; r < e; ++r) {
        ggml_rope_cache(info_.rope, pos0 + r, cache.data());
        for (int64_t head = 0; head < info_.n_head_kv; ++head) ggml_rope_apply(info_.rope, cache.data(), k + r * C + head * hd);
      }
    });
  }
};

}  // namespace

std::unique_ptr<Recipe> make_llama_recipe(const GgufFile& g, int threads, int max_layers) { return std::make_unique<LlamaRecipe>(g, threads, max_layers); }

}  // namespace pdb
