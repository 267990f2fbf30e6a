// The recipe's math on the GPU, on the engine's device hidden states: the decoder's attention norm,
// its K/V projections with its activation numerics per weight type (F16: activation rounded to f16,
// f16 x f16 products, f32 sums; BF16 likewise; F32: true f32; block-quantized weights: dequantized
// once at load, activation through Q8_0 like ggml-cpu's vec_dot; Q8_0 and Q4_0 as ggml-cpu computes
// them: integer block sums on int8 tensor cores, cuda/q8_gemm.cu), qwen3's K norm, and the decoder's
// RoPE with cos/sin from numerics/rope_ggml.cpp. Weights come from the CPU recipe (one loader).
// Float sums run in cuBLASLt's order, not the decoder's: rows can differ from the CPU recipe's in the
// last bit; tests/kernels report how many elements are identical.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/rope_table.h"
#include "recipes/recipe.h"

namespace pdb {

namespace cuda { class Gemm; }

class GpuRecipe {
 public:
  // with_weights false: the rows come from the engine's own products (rows_from_engine); the K/V weights stay on the
  // host and kv_f32/kv_from_normed are not available.
  GpuRecipe(const Recipe& cpu, cuda::Gemm& gemm, int64_t max_rows, bool with_weights = true);
  ~GpuRecipe();
  const Recipe& cpu() const { return cpu_; }
  const RecipeInfo& info() const { return cpu_.info(); }
  size_t device_bytes() const { return bytes_; }

  // Once per chunk, before kv_f32: the decoder's cos/sin for positions [pos0, pos0 + rows), from a host table of
  // every position so far (computed once per process, as the decoder's ggml_rope_cache computes them) in pinned
  // memory, copied without the host waiting: the MoE engines wait on the host at every layer, and computing the
  // chunk's table there cost the GPU ~2-4 ms per chunk.
  void set_positions(int64_t pos0, int64_t rows, cudaStream_t s);
  // d_k, d_v: [rows x n_embd_kv] f32 on the device: K after RoPE, V; before rotation and type. MLA
  // (deepseek2): d_k gets the cache row [rms_norm(latent) * w | RoPE(k_pe)], d_v is left untouched.
  void kv_f32(int layer, const float* d_h, int64_t rows, cudaStream_t s, float* d_k, float* d_v);
  // kv_f32 in two steps, so that a caller can run the second on another stream: the decoder's
  // attention norm of d_h into d_x (room for [rows x n_embd] f32), then K/V from d_x. Where K and V both multiply F16
  // weights (normed_as_f16) the norm writes its rows rounded to f16, as the products read them (one pass, the same
  // bits); else f32. kv_from_normed uses this object's scratch: calls of it must be ordered (one stream).
  void normalize(int layer, const float* d_h, int64_t rows, cudaStream_t s, float* d_x);
  void kv_from_normed(int layer, const float* d_x, int64_t rows, cudaStream_t s, float* d_k, float* d_v);
  // The same rows as an f16 cache's bytes without rotation (k_f16, v_f16: rows x n_embd_kv halves): the products into
  // d_k/d_v (f32 scratch), then qwen3's K norm, the RoPE and both roundings in one pass (cuda::kv_rows_to_f16: the
  // same bytes as kv_from_normed and two encodes). False where it does not apply (MLA), nothing done.
  bool kv_f16_from_normed(int layer, const float* d_x, int64_t rows, cudaStream_t s, float* d_k, float* d_v, void* k_f16, void* v_f16);
  bool normed_as_f16(int layer) const;
  // The engine's K/V rows (CudaEngine::KvTap: products before RoPE) into d_k/d_v as kv_f32 leaves them: K in the
  // GGUF's row order where the converter permuted it (hf_k_order: the engine's K is in HF's), qwen3's K norm and the
  // decoder's RoPE on K. MLA: k is the kv_a product [latent | k_pe] (v unused), normed and roped as kv_f32 does.
  // k and v: rows ld floats apart (CudaAttention::kv_rows).
  void rows_from_engine(int layer, const float* k, const float* v, int64_t ld, int64_t rows, bool hf_k_order, cudaStream_t s, float* d_k,
                        float* d_v);
  // The same rows of an f16 cache without rotation as its bytes (k_f16, v_f16: rows x n_embd_kv halves) in one pass
  // (cuda::kv_rows_to_f16); false where it does not apply (MLA), nothing done.
  bool rows_f16_from_engine(int layer, const float* k, const float* v, int64_t ld, int64_t rows, bool hf_k_order, cudaStream_t s, void* k_f16,
                            void* v_f16);

 private:
  struct Weight {
    GgmlType type = GgmlType::F32;
    int64_t rows = 0, cols = 0;
    cuda::DeviceBuffer w, bias;
    cuda::DeviceBuffer q, d;  // Q8_0/Q4_0 with cols % 128 == 0: codes and scales for the integer path (w unused)
    cuda::DeviceBuffer block_min;  // Q4_1/Q5_1: the blocks' mins [rows x cols/32] (their Q8_1 sums' term)
  };
  // converted: d_x's activations for w's type are already in xa_/xq_ (V after K with the same type:
  // the decoder converts its norm output once per weight type, and so can we).
  // half_x: the activations already rounded to f16 (an F16 weight's), read in place of d_x.
  void project(const Weight& w, const float* d_x, int64_t rows, cudaStream_t s, float* d_y, bool converted = false,
               const void* half_x = nullptr);
  static bool same_activations(const Weight& a, const Weight& b);
  void kv_products(int layer, const float* d_x, int64_t rows, cudaStream_t s, float* d_k, float* d_v);
  void check(int layer, int64_t rows) const;  // a loaded layer, rows within the buffers
  void rope_k(int layer, float* d_k, int64_t rows, cudaStream_t s);  // qwen3's K norm, then the decoder's RoPE
  // deepseek2's row from its projection in d_k (recipes/deepseek2_gpu.cpp)
  void deepseek2_row(int layer, float* d_k, int64_t rows, cudaStream_t s);

  const Recipe& cpu_;
  cuda::Gemm& gemm_;
  int64_t max_rows_ = 0;
  bool with_weights_ = true;
  size_t bytes_ = 0;
  std::vector<Weight> wk_, wv_;
  std::vector<cuda::DeviceBuffer> norm_, k_norm_, latent_norm_;  // latent_norm_: MLA's kv_a_norm
  cuda::DeviceBuffer x_, xa_, cs_, xq_, xd_;  // xq_/xd_: the activation's Q8_0 codes and scales
  cuda::DeviceBuffer q81c_;                   // Q4_1/Q5_1: the activation's Q8_1 block-sum corrections [rows x cols/32]
  cuda::RopeTable rope_table_;  // the decoder's cos/sin of every position so far, in pinned memory
};

}  // namespace pdb
