// deepseek2's cached row on the GPU (the CPU's, and the formula, are recipes/deepseek2.cpp): the projection
// attn_kv_a_mqa (GpuRecipe::kv_from_normed) gives [latent | k_pe] in one row of head_dim; here the latent's RMSNorm
// times attn_kv_a_norm, in place, and the decoder's RoPE (NORM pairs, YaRN) on k_pe. No V, no head norm, and never
// a Hadamard rotation (Recipe::rotates_k).
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "recipes/recipe_gpu.h"

namespace pdb {

void GpuRecipe::deepseek2_row(int layer, float* d_k, int64_t rows, cudaStream_t s) {
  const auto& in = cpu_.info();
  const int64_t C = in.head_dim, kvl = in.kv_lora_rank;
  cuda::rmsnorm_rows_strided(d_k, C, latent_norm_[size_t(layer)].as<float>(), d_k, C, rows, kvl, in.norm_eps, s);
  cuda::rope_ggml_rows(d_k + kvl, cs_.as<float>(), rows, 1, int(C - kvl), in.rope.n_dims, in.rope.mode == RopeMode::Neox, nullptr, in.norm_eps, s,
                       C);
}

}  // namespace pdb
