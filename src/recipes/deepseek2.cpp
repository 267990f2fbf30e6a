// Recipe for llama.cpp's `deepseek2` architecture with MLA (DeepSeek-V2/V2-Lite; src/models/deepseek2.cpp
// in the decoder). Per token and layer the decoder caches ONE row of kv_lora_rank + n_rot elements and
// no V section (V is a view of the row's first kv_lora_rank elements):
//   x = rms_norm(h) * attn_norm;  a = W_kv_a_mqa x  (kv_lora + n_rot outputs)
//   row = [ rms_norm(a[0:kv_lora]) * attn_kv_a_norm  |  RoPE_NORM_YaRN(a[kv_lora:], pos) ]
// Only the trailing n_rot elements depend on the position. No Hadamard rotation on this path, even for
// a quantized cache (llama.cpp builds attn_rot_k for the K+V input only).
#include <fmt/format.h>

#include "common/parallel.h"
#include "formats/gguf.h"
#include "numerics/rmsnorm.h"
#include "recipes/recipe.h"

namespace pdb {
namespace {

class Deepseek2Recipe final : public Recipe {
 public:
  Deepseek2Recipe(const GgufFile& g, int threads, int max_layers) {
    threads_ = threads;
    load_common(g, "deepseek2", max_layers, /*kv_projections=*/false);
    const int64_t kvl = info_.kv_lora_rank, rot = info_.rope.n_dims;
    if (rot <= 0 || rot % 2 || kvl + rot != info_.head_dim)
      throw std::runtime_error(fmt::format("deepseek2 GGUF: key_length {} is not kv_lora_rank {} + rope dims {}", info_.head_dim, kvl, rot));
    for (int64_t l = 0; l < loaded_layers_; ++l) {
      const std::string p = fmt::format("blk.{}.", l);
      wk_.push_back(load_weight(g, p + "attn_kv_a_mqa.weight", p + "attn_kv_a_mqa.bias"));
      if (wk_.back().rows != info_.head_dim || wk_.back().cols != info_.n_embd) throw std::runtime_error(p + "attn_kv_a_mqa has an unexpected shape");
      auto n = g.to_f32(g.tensor(p + "attn_kv_a_norm.weight"));
      if (int64_t(n.size()) != kvl) throw std::runtime_error(p + "attn_kv_a_norm has the wrong size");
      kv_a_norm_.push_back(std::move(n));
    }
  }

  void kv_rows(int layer, const float* h, int64_t rows, int64_t pos0, const CacheSpec& spec, std::vector<uint8_t>& k_out,
               std::vector<uint8_t>& v_out) const override {
    if (layer < 0 || layer >= loaded_layers_) throw std::out_of_range(fmt::format("recipe layer {} not loaded", layer));
    const int64_t E = info_.n_embd, C = info_.head_dim, kvl = info_.kv_lora_rank, rot = info_.rope.n_dims;
    std::vector<float> x(static_cast<size_t>(rows * E)), a(static_cast<size_t>(rows * C));
    attn_input(layer, h, rows, x.data());
    project(wk_[size_t(layer)], x.data(), rows, spec.simd_width, a.data());
    const float* norm_w = kv_a_norm_[size_t(layer)].data();
    parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
      std::vector<float> cache(static_cast<size_t>(rot));
      for (int64_t r = b; r < e; ++r) {
        float* row = a.data() + r * C;
        rmsnorm_rows(row, norm_w, row, 1, kvl, info_.norm_eps);  // the latent only, never k_pe
        ggml_rope_cache(info_.rope, pos0 + r, cache.data());
        ggml_rope_apply(info_.rope, cache.data(), row + kvl);
      }
    });
    k_out.resize(ggml_row_bytes(spec.k_type, C) * size_t(rows));
    rows_to_cache_type(spec.k_type, a.data(), rows, C, k_out.data());
    v_out.clear();
  }

  const float* k_latent_norm(int layer) const override { return kv_a_norm_.at(size_t(layer)).data(); }
  bool rotates_k() const override { return false; }  // llama.cpp builds attn_rot_k for the K+V input only

 private:
  // wk_ holds attn_kv_a_mqa (the whole row's projection); no wv_.
  std::vector<std::vector<float>> kv_a_norm_;
};

}  // namespace

std::unique_ptr<Recipe> make_deepseek2_recipe(const GgufFile& g, int threads, int max_layers) {
  return std::make_unique<Deepseek2Recipe>(g, threads, max_layers);
}

}  // namespace pdb
