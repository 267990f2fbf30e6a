// Recipe for llama.cpp's `qwen3` architecture (src/models/qwen3.cpp in the decoder):
//   x = rms_norm(h) * attn_norm;  K = RoPE_NEOX(rms_norm_per_head(Wk x) * attn_k_norm);  V = Wv x
// No row permutation: qwen3 GGUFs keep HF's rotate-half layout, which is ggml's NEOX mode.
// qwen3moe (recipes/qwen3moe.cpp) caches exactly this: only its FFN differs.
#include <fmt/format.h>

#include "formats/gguf.h"
#include "numerics/rmsnorm.h"
#include "recipes/recipe.h"

namespace pdb {
namespace {

class Qwen3Recipe final : public Recipe {
 public:
  Qwen3Recipe(const GgufFile& g, int threads, int max_layers, const std::string& arch) {
    threads_ = threads;
    load_common(g, arch, max_layers);
    for (int64_t l = 0; l < loaded_layers_; ++l) {
      auto n = g.to_f32(g.tensor(fmt::format("blk.{}.attn_k_norm.weight", l)));
      if (int64_t(n.size()) != info_.head_dim) throw std::runtime_error("attn_k_norm has the wrong size");
      k_norm_.push_back(std::move(n));
    }
  }

  const float* k_head_norm(int layer) const override { return k_norm_.at(size_t(layer)).data(); }

  // qwen3 normalizes each K head (over head_dim, weight attn_k_norm) before RoPE.
  void k_head_before_rope(int layer, float* kh) const override {
    rmsnorm_rows(kh, k_norm_[size_t(layer)].data(), kh, 1, info_.head_dim, info_.norm_eps);
  }

 private:
  std::vector<std::vector<float>> k_norm_;
};

}  // namespace

std::unique_ptr<Recipe> make_qwen3_recipe(const GgufFile& g, int threads, int max_layers) {
  return std::make_unique<Qwen3Recipe>(g, threads, max_layers, "qwen3");
}
// The cache math shared with qwen3moe, whose attention is qwen3's.
std::unique_ptr<Recipe> make_qwen3_family_recipe(const GgufFile& g, int threads, int max_layers, const std::string& arch) {
  return std::make_unique<Qwen3Recipe>(g, threads, max_layers, arch);
}

}  // namespace pdb
