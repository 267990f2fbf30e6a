// The CUDA engine's shared blocks: what an architecture's layer is made of on the GPU (definitions/definition.h).
// The engine (cuda_engine.cpp) drives them: the chunks, the f32 residual stream and its norms, the hook, the
// memory check, tensor parallel's partial residuals and all-reduces, resuming and keeping the K/V. Every block
// adds its output into the residual (the last product's beta = 1). Implementations:
//   cuda_attention_gqa.cpp — grouped-query attention (llama, qwen3, qwen3moe): fused q/k/v product, RoPE into the
//                            bf16 or fp8 K/V cache, our flash attention, o_proj; FP8 products; a rank's heads
//   cuda_attention_mla.cpp — multi-head latent attention, decompressed per head (deepseek2)
//   cuda_ffn.cpp           — SwiGLU (FP8 products; a rank's columns), routed experts (cuda_moe_ffn.h), both
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cuda/common.cuh"
#include "cuda/gemm.cuh"
#include "definitions/definition.h"
#include "formats/hf_config.h"
#include "model/cuda_moe_ffn.h"
#include "model/cuda_weights.h"
#include "model/product_numerics.h"
#include "model/tensor_parallel.h"

namespace pdb {

class SafetensorsCheckpoint;
class WeightSource;

// One chunk of a forward: its rows, first position and stream.
struct CudaChunk {
  int64_t n = 0, p0 = 0;
  cudaStream_t s = nullptr;
  bool skip_attention = false;  // bench prefill's engine-no-attention (the layers' outputs are then not the model's)
  // Under the decoder's numerics (model/product_numerics.h): the block's normed rows in f32 [n x hidden], what the
  // decoder quantizes its activations from (the bf16 rows beside them serve the blocks that keep bf16 products).
  const float* xf = nullptr;
  // Where every product of the block takes its rows rounded to half, and nothing else reads them
  // (CudaAttention/CudaFfn::takes_half_rows): the normed rows as half, written by the norm itself, in place of xf and the
  // bf16 rows (one pass instead of the f32 rows, their bf16 copy and each product's half copy). xf is then null.
  const __half* xh = nullptr;
  // What a block's decoder-numerics products read: the half rows or the f32 ones (null without the decoder's numerics).
  const void* decoder_rows() const { return xh ? static_cast<const void*>(xh) : static_cast<const void*>(xf); }
  cuda::DType decoder_rows_type() const { return xh ? cuda::DType::F16 : cuda::DType::F32; }
};

// Y = X W^T for an activation X [n x in]: a bf16 product; on the FP8 path X quantized per 1x128 block and a
// block-scaled FP8 product; for a weight that follows the decoder's numerics (CudaWeight::products, half values) X
// rounded as the decoder rounds it (f32 or bf16 rows in, model/product_numerics.h) and a half product. beta = 1 adds
// into the f32 residual.
class CudaMatmul {
 public:
  CudaMatmul(cuda::Gemm& gemm, std::optional<cuda::Fp8ScaleLayout> fp8, ProductNumerics numerics = ProductNumerics::bf16)
      : gemm_(gemm), fp8_(std::move(fp8)), numerics_(numerics) {}
  const std::optional<cuda::Fp8ScaleLayout>& fp8() const { return fp8_; }
  ProductNumerics numerics() const { return numerics_; }
  cuda::Gemm& gemm() { return gemm_; }
  // FP8 products may need their rows padded: the buffers they read and write hold the padded rows (the extra rows
  // carry stale values whose results are never read).
  int64_t padded_rows(int64_t rows) const { return fp8_ ? fp8_->padded_rows(rows) : rows; }
  // max_out: the widest product with a bf16 result (under the decoder's numerics it is made in f32 first).
  size_t scratch_bytes_for(int64_t chunk, int64_t max_in, int64_t hidden, int64_t max_out) const;
  void reserve(int64_t chunk, int64_t max_in, int64_t hidden, int64_t max_out);
  void operator()(const void* x, cuda::DType xt, const CudaWeight& w, const cuda::DeviceBuffer& ws, int64_t n, int64_t in, int64_t out,
                  cuda::DType yt, void* y, float beta, cudaStream_t s);
  void operator()(const void* x, const CudaWeight& w, const cuda::DeviceBuffer& ws, int64_t n, int64_t in, int64_t out, cuda::DType yt,
                  void* y, float beta, cudaStream_t s) {
    (*this)(x, cuda::DType::BF16, w, ws, n, in, out, yt, y, beta, s);
  }
  // X [n x in] (f32 or bf16) rounded for a half product with weights of w's kind, in this matmul's scratch (valid
  // until its next product); half rows (xt F16, already rounded) are read in place where w's products quantize nothing.
  const void* half_input(const void* x, cuda::DType xt, const CudaWeight& w, int64_t n, int64_t in, cudaStream_t s);
  // A half weight's product (w.products().half) in f32, in this matmul's scratch (valid until its next product): the
  // f32 the bf16 result of operator() is rounded from.
  const float* half_product_f32(const void* x, cuda::DType xt, const CudaWeight& w, int64_t n, int64_t in, int64_t out, cudaStream_t s);
  size_t scratch_bytes() const { return xq_.bytes() + xs_.bytes() + ybf_.bytes() + xh_.bytes() + yf_.bytes(); }

 private:
  cuda::Gemm& gemm_;
  std::optional<cuda::Fp8ScaleLayout> fp8_;
  ProductNumerics numerics_;
  cuda::DeviceBuffer xq_, xs_, ybf_;  // quantized activations, their scales, bf16 product for the residual add
  cuda::DeviceBuffer xh_, yf_;        // the decoder's numerics: rounded activations (2 bytes each), an f32 product
};

// The engine's own K/V for a prompt: [layer][head][capacity rows] of K and of V (fp8: e4m3 codes with one f32
// scale per row). What a forward resumes from and keeps.
struct CudaKvCache {
  cuda::DeviceBuffer k, v, ks, vs;
  int64_t capacity = 0, heads = 0, layers = 0;
  int64_t k_row_bytes = 0, v_row_bytes = 0;
  bool scales = false;
  size_t bytes() const { return k.bytes() + v.bytes() + ks.bytes() + vs.bytes(); }
};

// What the blocks' loaders share. The weights come from an HF checkpoint (ck) or the decoder's GGUF (gguf), whose
// quantized weights stay quantized in `quant` and are expanded per layer (model/cuda_weights.h).
struct CudaLoad {
  const SafetensorsCheckpoint* ck;
  const WeightSource* gguf;
  CudaQuantStore* quant;
  const HfConfig& c;
  const ModelDefinition& def;
  const TpShard& shard;
  int world = 1;
  int threads = 1;
  const std::optional<cuda::Fp8ScaleLayout>& fp8;
  ProductNumerics numerics = ProductNumerics::bf16;  // the products' rounding for the blocks that follow the decoder's
};
// A model's attention, every layer's weights (loaded layer by layer, beside the layer's FFN: the weights lie in device
// memory in the order the forward reads them).
class CudaAttention {
 public:
  virtual ~CudaAttention() = default;
  virtual void load_layer(const CudaLoad& ld, int64_t layer) = 0;  // layers in order, from 0
  // Device bytes a prompt needs beyond the weights: the K/V of `cache_layers` layers and this block's scratch.
  virtual size_t prompt_bytes(int64_t tokens, int64_t chunk, int64_t cache_layers) const = 0;
  virtual void reserve(int64_t tokens, int64_t chunk, int64_t cache_layers) = 0;
  virtual void begin_chunk(const CudaChunk& c) = 0;
  // h[n x hidden] += attention(x) W_o^T, layer `layer` (this rank's heads); x the normed rows (bf16).
  virtual void forward(int64_t layer, const __nv_bfloat16* x, float* h, const CudaChunk& c) = 0;
  // Whether layer `layer`'s products all take the normed rows as half without quantizing them (CudaChunk::xh).
  virtual bool takes_half_rows(int64_t /*layer*/) const { return false; }
  virtual CudaKvCache& kv() = 0;
  // The decoder's cache rows from the engine's own products (--kv-rows engine): K and V of the normed rows x as f32
  // products with this layer's weights, before RoPE and qwen3's k norm. They are the decoder's rows up to the
  // products' rounding only when the engine runs the decoder's GGUF. enable_kv_rows before reserve: "" when this
  // attention has such rows, else why not (FP8 products; a rank's heads). MLA's are its latent's product, before the norm.
  // *ld: floats from one row of k (and v) to the next: the rows may lie inside a wider product.
  virtual std::string enable_kv_rows() { return "this attention has no separate K/V rows"; }
  virtual void kv_rows(int64_t /*layer*/, const __nv_bfloat16* /*x*/, const CudaChunk& /*c*/, const float** /*k*/, const float** /*v*/,
                       int64_t* /*ld*/) {}
  // Where the weights kv_rows reads end in the layer's expanded scratch (CudaWeight::scratch_end): a layer run only for
  // its rows (the last) expands no more than that.
  virtual size_t kv_rows_weights_end(int64_t /*layer*/) const { return SIZE_MAX; }
  virtual size_t buffer_bytes() const = 0;
  virtual size_t weight_bytes() const = 0;
};

// Scratch every layer's FFN shares.
struct CudaFfnScratch {
  cuda::DeviceBuffer gu, act;
  CudaMoeFfn moe;
  size_t bytes() const { return gu.bytes() + act.bytes() + moe.scratch_bytes(); }
};

// One layer's FFN: h[n x hidden] += FFN(x). The scratch is shared: the widest SwiGLU's, and the experts' when any
// layer routes.
class CudaFfn {
 public:
  virtual ~CudaFfn() = default;
  virtual int64_t swiglu_width() const = 0;  // this rank's SwiGLU columns (0: none)
  virtual bool routed() const = 0;
  virtual void forward(const __nv_bfloat16* x, float* h, CudaFfnScratch& scratch, CudaMatmul& mm, const CudaChunk& c) = 0;
  virtual bool takes_half_rows() const { return false; }  // as CudaAttention::takes_half_rows
  virtual size_t weight_bytes() const = 0;
  // The chunk (tokens) from which this block's products run at their rate; 0: any the engine runs.
  virtual int64_t full_products_chunk() const { return 0; }
};

struct CudaAttentionOptions {
  bool kv_fp8 = false;
  bool fp8kv_fused = false;
};

std::unique_ptr<CudaAttention> load_cuda_attention(const CudaLoad& ld, const CudaAttentionOptions& o, CudaMatmul& mm);
std::unique_ptr<CudaFfn> load_cuda_ffn(const CudaLoad& ld, int64_t layer);
// Why the engine cannot run this model's blocks ("" when it can): head widths, sizes, biases, fp8 K/V, ranks.
std::string cuda_blocks_unsupported(const ModelDefinition& d, const HfConfig& c, bool kv_fp8, int world);
// Why FP8 products cannot run for this checkpoint ("" when they can).
std::string cuda_fp8_unsupported(const ModelDefinition& d, const HfConfig& c, const SafetensorsCheckpoint& ck);

}  // namespace pdb
