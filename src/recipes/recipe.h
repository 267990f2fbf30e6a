// A recipe computes, from a layer's input residual stream, exactly the K/V cache rows the decoder
// (llama.cpp) would store — with the decoder's own weights (from its GGUF), norms, RoPE, cache type
// and Hadamard rotation. One file per decoder architecture (llama.cpp, qwen3.cpp, qwen3moe.cpp,
// deepseek2.cpp); the shared math
// (weight numerics, rotation, row conversion, fingerprint) lives here.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/ggml_types.h"
#include "numerics/q8_dot.h"
#include "numerics/rope_ggml.h"

namespace pdb {

class GgufFile;

// The decoder's cache format for one bridge: types and rotation (learned from the running decoder).
struct CacheSpec {
  GgmlType k_type = GgmlType::F16, v_type = GgmlType::F16;
  bool rot_k = false, rot_v = false;  // llama.cpp's Hadamard rotation of quantized caches
  // SIMD width (floats) of the decoder CPU's batched matmul (llamafile tinyBLAS): 8 AVX2, 16 AVX-512,
  // 4 NEON. Fixes the order in which the decoder sums each dot product; 0 = plain GEMM (no mimicry).
  int simd_width = 8;
  // llama.cpp's default: rotate a quantized cache when head_dim % 64 == 0 (unless LLAMA_ATTN_ROT_DISABLE).
  static CacheSpec decoder_default(GgmlType k, GgmlType v, int64_t head_dim);
};

// A projection weight kept in the form the decoder multiplies it in.
struct RecipeWeight {
  GgmlType type = GgmlType::F32;  // the GGUF type
  int64_t rows = 0, cols = 0;     // out, in
  std::vector<float> w;           // dequantized [rows x cols] (exact for F32/F16/BF16); empty for Q8_0/Q4_0, which keep q8
  std::vector<float> bias;        // empty if none
  Q8Matrix q8;                    // Q8_0/Q4_0: the GGUF's codes and scales (the integer path), else empty
  std::vector<float> block_min;   // Q4_1/Q5_1: each 32-block's min [rows x cols/32] (the Q8_1 sums' term), else empty
};

// How the decoder caches a prompt (src/cache/decoder_cache.h): a row per token and layer, or pooled sections.
enum class CacheKind { token_rows, pooled_sections };

struct RecipeInfo {
  std::string arch;
  CacheKind cache_kind = CacheKind::token_rows;
  int64_t n_layer = 0, n_embd = 0, n_head_kv = 0, head_dim = 0;
  float norm_eps = 1e-5f;
  GgmlRopeParams rope;
  std::string weights_hash;  // xxh3 over the recipe tensors' bytes
  // MLA (deepseek2): one cache row per token of kv_lora_rank latent + rope dims (head_dim here is that
  // row's width, n_head_kv 1) and no V section.
  int64_t kv_lora_rank = 0;
  bool mla() const { return kv_lora_rank > 0; }
  // DeepSeek-V4 (deepseek4): the pooled cache's geometry, in the fingerprint (empty ratios for the others)
  std::vector<int32_t> compress_ratios;
  int64_t window = 0, index_dim = 0, index_heads = 0, hc_count = 0, hc_iterations = 0;
  float hc_eps = 0, compress_rope_base = 0;
  int64_t n_embd_kv() const { return n_head_kv * head_dim; }
  int64_t n_embd_v() const { return mla() ? 0 : n_embd_kv(); }  // V row width; 0: no V section
};

// Hyperparameters and the recipe-weights hash, straight from the decoder GGUF (no weights loaded).
RecipeInfo read_recipe_info(const GgufFile& g);
// Geometry fingerprint: architecture, shapes, every RoPE parameter, norm eps and the recipe weights
// hash. Front door and prefill server compute it independently; a bridge needs them equal.
nlohmann::json recipe_geometry(const RecipeInfo& info);
std::string recipe_fingerprint(const RecipeInfo& info);

class Recipe {
 public:
  virtual ~Recipe() = default;
  // Loads the recipe for the GGUF's architecture (llama, qwen3); throws for others.
  // `max_layers` > 0 loads only the first layers' weights (calibration needs layer 0 only).
  static std::unique_ptr<Recipe> load(const std::string& gguf_path, int threads, int max_layers = 0);

  const RecipeInfo& info() const { return info_; }

  // h: [rows x n_embd] residual stream entering `layer`, positions pos0.. ; writes the layer's K and
  // V rows as f32, before rotation and type conversion: K post-RoPE, head-major. Shared by every dense
  // architecture: x = rms_norm(h)*attn_norm; K = RoPE(k_head(Wk x)); V = Wv x.
  void kv_f32(int layer, const float* h, int64_t rows, int64_t pos0, int simd_width, float* k, float* v) const;

  // Rows in the decoder's cache format: k_out/v_out get rows * row_bytes(type) bytes each (v_out
  // stays empty where the decoder has no V section: MLA).
  virtual void kv_rows(int layer, const float* h, int64_t rows, int64_t pos0, const CacheSpec& spec,
                       std::vector<uint8_t>& k_out, std::vector<uint8_t>& v_out) const;

  int threads() const { return threads_; }
  int64_t loaded_layers() const { return loaded_layers_; }

  // What a GPU implementation of the same math needs (recipes/recipe_gpu.h).
  const RecipeWeight& k_weight(int layer) const { return wk_.at(size_t(layer)); }
  const RecipeWeight& v_weight(int layer) const { return wv_.at(size_t(layer)); }
  const float* attn_norm(int layer) const { return attn_norm_all_.data() + int64_t(layer) * info_.n_embd; }
  // Per-head RMSNorm weights applied to K before RoPE (qwen3), or null.
  virtual const float* k_head_norm(int layer) const { return nullptr; }
  // MLA: k_weight is the whole cache row's projection (kv_a_mqa), v_weight absent, and this is the
  // RMSNorm weight of the row's first kv_lora_rank elements (the latent; the rest is RoPE'd k_pe).
  virtual const float* k_latent_norm(int layer) const { return nullptr; }
  // Whether the decoder Hadamard-rotates this architecture's K rows in a quantized cache (where the spec says so).
  virtual bool rotates_k() const { return true; }

  // The decoder's own layer-0 input for `rows` tokens: its token_embd rows, dequantized as ggml does
  // (llama and qwen3 do not scale embeddings). With it layer 0 is the decoder's exactly, whatever its
  // quantization (a Q4_0 decoder's embedding differs from the checkpoint's by quantization noise).
  void decoder_embedding(const int32_t* tokens, int64_t rows, float* out) const;

 protected:
  RecipeInfo info_;
  int threads_ = 1;
  std::vector<float> attn_norm_all_;  // [n_layer x n_embd]
  std::vector<RecipeWeight> wk_, wv_;

  // `kv_projections`: load attn_k/attn_v (every architecture but MLA, whose recipe loads its own).
  void load_common(const GgufFile& g, const std::string& arch, int max_layers, bool kv_projections = true);
  // What an architecture does to one K head between the projection and RoPE (qwen3: its K norm).
  virtual void k_head_before_rope(int layer, float* k_head) const {}
  int64_t loaded_layers_ = 0;
  std::shared_ptr<const GgufFile> gguf_;  // kept open (mmap) for the embedding rows
  // x = rms_norm(h) * attn_norm[layer]  (ggml-cpu order of operations)
  void attn_input(int layer, const float* h, int64_t rows, float* x) const;
  // y[rows x w.rows] = W x with the decoder's activation numerics for the weight's type.
  void project(const RecipeWeight& w, const float* x, int64_t rows, int simd_width, float* y) const;
  RecipeWeight load_weight(const GgufFile& g, const std::string& name, const std::string& bias_name) const;
};

// In-place normalized Walsh-Hadamard transform of consecutive n-element chunks, in ggml-cpu's order
// (scale by 1/sqrt(n) first, then butterflies of growing span): llama.cpp's cache rotation.
void hadamard_rows(float* x, int64_t n_total, int64_t n);
int64_t k_rotation_size(int64_t head_dim);
// The SIMD width of this machine's llamafile tinyBLAS (what a decoder on this host uses).
int host_simd_width();
// One dot product summed the way tinyBLAS does: `kn` lane accumulators fed by FMA in k order,
// then folded in halves (its hsum). Bit-identical to the decoder for k % kn == 0.
float dot_lanes(const float* a, const float* b, int64_t k, int kn);  // largest power of two >= 64 dividing head_dim
constexpr int64_t kVRotationSize = 64;

// Converts f32 rows to a cache type with the decoder's conversion (F16/BF16 round-to-nearest-even,
// Q8_0 ggml-cpu's x86 quantizer, Q4_0 the reference quantizer).
void rows_to_cache_type(GgmlType t, const float* x, int64_t rows, int64_t cols, uint8_t* out);

}  // namespace pdb
