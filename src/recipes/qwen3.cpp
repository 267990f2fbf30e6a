// Recipe for llama.cpp's `qwen3` architecture (src/models/qwen3.cpp in the decoder):
//   x = rms_norm(h) * attn_norm;  K = RoPE_NEOX(rms_norm_per_head(Wk x) * attn_k_norm);  V = Wv x
// No row permutation: qwen3 GGUFs keep HF's rotate-half layout, which is ggml's NEOX mode.
#include <fmt/format.h>

#include "common/parallel.h"
#include "formats/gguf.h"
#include "model/rmsnorm.h"
#include "recipes/recipe.h"

namespace pdb {
namespace {

class Qwen3Recipe final : public Recipe {
 public:
  Qwen3Recipe(const GgufFile& g, int threads, int max_layers) {
    threads_ = threads;
    load_common(g, "qwen3", max_layers);
    for (int64_t l = 0; l < loaded_layers_; ++l) {
      auto n = g.to_f32(g.tensor(fmt::format("blk.{}.attn_k_norm.weight", l)));
      if (int64_t(n.size()) != info_.head_dim) throw std::runtime_error("attn_k_norm has the wrong size");
      k_norm_.push_back(std::move(n));
    }
  }

  void kv_f32(int layer, const float* h, int64_t rows, int64_t pos0, int simd, float* k, float* v) const override {
    const int64_t E = info_.n_embd, C = info_.n_embd_kv(), hd = info_.head_dim;
    std::vector<float> x(static_cast<size_t>(rows * E));
    attn_input(layer, h, rows, x.data());
    project(wk_[size_t(layer)], x.data(), rows, simd, k);
    project(wv_[size_t(layer)], x.data(), rows, simd, v);
    const float* kn = k_norm_[size_t(layer)].data();
    parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
      std::vector<float> cache(static_cast<size_t>(hd));
      for (int64_t r = b; r < e; ++r) {
        ggml_rope_cache(info_.rope, pos0 + r, cache.data());
        for (int64_t head = 0; head < info_.n_head_kv; ++head) {
          float* kh = k + r * C + head * hd;
          rmsnorm_rows(kh, kn, kh, 1, hd, info_.norm_eps);
          ggml_rope_apply(info_.rope, cache.data(), kh);
        }
      }
    });
  }

 private:
  std::vector<std::vector<float>> k_norm_;
};

}  // namespace

std::unique_ptr<Recipe> make_qwen3_recipe(const GgufFile& g, int threads, int max_layers) { return std::make_unique<Qwen3Recipe>(g, threads, max_layers); }

}  // namespace pdb
