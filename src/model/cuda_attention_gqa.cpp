// Grouped-query attention on the GPU (llama, qwen3, qwen3moe): one fused q|k|v product (a rank's heads), qwen3's
// q/k norms and RoPE fused into the write of the K/V cache (bf16, or e4m3 rows with a scale each), our flash
// attention over it, and o_proj added into the residual. FP8 checkpoints multiply through block-scaled FP8 products.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "cuda/attention.cuh"
#include "cuda/device.h"
#include "cuda/elementwise.cuh"
#include "cuda/fp8.cuh"
#include "cuda/rope.cuh"
#include "formats/safetensors.h"
#include "model/cuda_blocks.h"
#include "model/cuda_engine_load.h"

namespace pdb {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;
using cuda_load::RowSlice;

class GqaAttentionCuda final : public CudaAttention {
 public:
  GqaAttentionCuda(const CudaLoad& ld, const CudaAttentionOptions& o, CudaMatmul& mm);
  void load_layer(const CudaLoad& ld, int64_t layer) override;
  size_t prompt_bytes(int64_t T, int64_t chunk, int64_t cache_layers) const override;
  void reserve(int64_t T, int64_t chunk, int64_t cache_layers) override;
  void begin_chunk(const CudaChunk& c) override {
    ra_.rows = as_.n_q = c.n;
    ra_.pos0 = as_.pos0 = c.p0;
    rows_of_layer_ = -1;  // the last layer's rows (made without its forward) are not this chunk's
  }
  void forward(int64_t layer, const bf16* x, float* h, const CudaChunk& c) override;
  bool takes_half_rows(int64_t layer) const override {
    const WeightProducts& p = layers_[size_t(layer)].wqkv.products();
    return p.half && !p.act_block;
  }
  CudaKvCache& kv() override { return kv_; }
  std::string enable_kv_rows() override;
  void kv_rows(int64_t layer, const bf16* x, const CudaChunk& c, const float** k, const float** v, int64_t* ld) override;
  size_t kv_rows_weights_end(int64_t layer) const override { return layers_[size_t(layer)].wqkv.scratch_end(); }
  size_t buffer_bytes() const override {
    return kv_.bytes() + kx_.bytes() + vx_.bytes() + qkv_.bytes() + q_.bytes() + att_.bytes() + kf_.bytes() + vf_.bytes();
  }
  size_t weight_bytes() const override { return weight_bytes_; }

 private:
  struct Layer {
    DeviceBuffer q_norm, k_norm;  // f32 (qwen3), else empty
    CudaWeight wqkv, wo;          // bf16 [out x in], or e4m3 on the FP8 path; q|k|v fused along out
    DeviceBuffer wqkv_s, wo_s;    // FP8 path: f32 scale per 128x128 block, in the product's order
  };
  // qkv32: the q|k|v product in f32 (half weights: read without a bf16 copy), else null (qkv_'s bf16 rows)
  void attend(int64_t layer, const CudaChunk& c, const float* qkv32);
  CudaMatmul& mm_;
  int64_t H_, hd_, nh_, nkv_;
  bool kv_fp8_, fp8kv_fused_;
  std::vector<Layer> layers_;
  DeviceBuffer inv_freq_;  // f32 [head_dim/2]
  CudaKvCache kv_;
  DeviceBuffer kx_, vx_;  // kv_fp8, expanded: one layer's rows as bf16 [kv_heads x capacity x head_dim]
  DeviceBuffer qkv_, q_, att_;
  bool kv_rows_ = false;
  int64_t rows_of_layer_ = -1;  // the layer whose k and v columns kv_rows made for the chunk in flight
  bool qkv_made_ = false;       // and whether it made the whole q|k|v product too (half weights: one product)
  const float* qkv_f32_ = nullptr;  // that product in f32 (the matmul's scratch: nothing multiplies before attend reads it)
  int world_ = 1;
  DeviceBuffer kf_, vf_;  // --kv-rows engine: the chunk's K and V rows as f32 products [rows x kv_heads * head_dim]
  cuda::QkvRopeArgs ra_;  // kernel arguments that change only per chunk (rows, positions) or per layer (qwen3's norms)
  cuda::AttentionShape as_;
  size_t weight_bytes_ = 0;
};

GqaAttentionCuda::GqaAttentionCuda(const CudaLoad& ld, const CudaAttentionOptions& o, CudaMatmul& mm)
    : mm_(mm), H_(ld.c.hidden_size), hd_(ld.c.head_dim), nh_(ld.shard.q_heads), nkv_(ld.shard.kv_heads), kv_fp8_(o.kv_fp8),
      fp8kv_fused_(o.fp8kv_fused), world_(ld.world) {
  const auto& c = ld.c;
  if (kv_fp8_) {
    cuda::AttentionShape probe;
    probe.head_dim = int(hd_);
    if (!cuda::wgmma_attention_supported(probe))
      throw std::runtime_error(fmt::format("CUDA engine: fp8 K/V needs head_dim 128 on an sm_90 GPU (this model: head_dim {}; {})", hd_,
                                           cuda::device_summary()));
  }
  std::vector<float> inv;
  for (double f : c.inv_freq()) inv.push_back(float(f));
  inv_freq_ = cuda_load::upload_f32(inv);
  ra_.n_heads = as_.n_heads = int(nh_);
  ra_.n_kv_heads = as_.n_kv_heads = int(nkv_);
  ra_.head_dim = as_.head_dim = int(hd_);
  ra_.inv_freq = inv_freq_.as<float>();
  ra_.attn_scale = float(c.attention_scaling());
  ra_.eps = float(c.rms_norm_eps);
  as_.scale = 1.0f / std::sqrt(float(hd_));
}

void GqaAttentionCuda::load_layer(const CudaLoad& ld, int64_t l) {
  if (l != int64_t(layers_.size())) throw std::logic_error("attention layers are loaded in order");
  const auto& c = ld.c;
  const TpShard& sh = ld.shard;
  const int64_t H = H_, hd = hd_, nh = c.num_heads, nkv = c.num_kv_heads;
  size_t& total = weight_bytes_;
  const std::string p = fmt::format("model.layers.{}.self_attn.", l);
  Layer L;
  if (ld.def.qk_norm) {
    L.q_norm = cuda_load::upload_f32(cuda_load::vector(ld, p + "q_norm.weight", hd));
    L.k_norm = cuda_load::upload_f32(cuda_load::vector(ld, p + "k_norm.weight", hd));
  }
  // this rank's heads (q, then k, then v): all of them without TP
  const std::vector<RowSlice> qkv = {{p + "q_proj.weight", nh * hd, sh.q_head0 * hd, sh.q_heads * hd},
                                     {p + "k_proj.weight", nkv * hd, sh.kv_head0 * hd, sh.kv_heads * hd},
                                     {p + "v_proj.weight", nkv * hd, sh.kv_head0 * hd, sh.kv_heads * hd}};
  const std::vector<RowSlice> out = {{p + "o_proj.weight", H, 0, H}};
  if (ld.fp8) {
    cuda_load::upload_sliced_fp8(*ld.ck, qkv, H, 0, H, *ld.fp8, L.wqkv.resident(), L.wqkv_s, total);
    cuda_load::upload_sliced_fp8(*ld.ck, out, nh * hd, sh.q_head0 * hd, sh.q_heads * hd, *ld.fp8, L.wo.resident(), L.wo_s, total);
  } else {
    L.wqkv = cuda_load::weight(ld, l, qkv, H, 0, H, total, true);
    L.wo = cuda_load::weight(ld, l, out, nh * hd, sh.q_head0 * hd, sh.q_heads * hd, total, true);
  }
  layers_.push_back(std::move(L));
}

namespace {
// The cache's rows per head: the prompt's, rounded up so that cuDNN's plans may pad a last chunk's queries
// (attention_cudnn.cpp's bucket) and prompts of nearby lengths share one capacity (and so their plans).
int64_t cache_capacity(int64_t T) { return (T + 255) / 256 * 256; }
}  // namespace

size_t GqaAttentionCuda::prompt_bytes(int64_t T, int64_t chunk, int64_t cache_layers) const {
  T = cache_capacity(T);
  const int64_t hd = hd_, nh = nh_, nkv = nkv_;
  const size_t per_row = kv_fp8_ ? size_t(hd) + 4 : size_t(hd) * 2;  // fp8: codes + one scale per head row
  size_t kv = size_t(2) * size_t(cache_layers) * size_t(nkv * T) * per_row;
  if (kv_fp8_ && !fp8kv_fused_) kv += size_t(2) * size_t(nkv * T * hd) * 2;  // one layer's rows expanded to bf16
  const int64_t rows = mm_.padded_rows(chunk);
  if (kv_rows_) kv += size_t(2) * size_t(chunk * nkv * hd) * 4;
  return kv + size_t(chunk) * size_t((nh + 2 * nkv) * hd * 2 + 2 * nh * hd * 2) + size_t(rows - chunk) * size_t((nh + 2 * nkv) * hd * 2 + nh * hd * 2);
}

void GqaAttentionCuda::reserve(int64_t T, int64_t chunk, int64_t cache_layers) {
  const int64_t nkv = nkv_, hd = hd_, elem = kv_fp8_ ? 1 : 2;
  T = cache_capacity(T);
  if (kv_.capacity < T || kv_.k.bytes() < size_t(cache_layers * nkv * T * hd * elem)) {
    for (auto* b : {&kv_.k, &kv_.v, &kv_.ks, &kv_.vs, &kx_, &vx_}) b->release();
    kv_.k.resize(size_t(cache_layers * nkv * T * hd * elem));
    kv_.v.resize(size_t(cache_layers * nkv * T * hd * elem));
    if (kv_fp8_) {
      kv_.ks.resize(size_t(cache_layers * nkv * T) * 4);
      kv_.vs.resize(size_t(cache_layers * nkv * T) * 4);
      if (!fp8kv_fused_) {
        kx_.resize(size_t(nkv * T * hd) * 2);
        vx_.resize(size_t(nkv * T * hd) * 2);
      }
    }
    // rows no prompt has written yet are read by the attention's padding queries: finite from the start
    for (auto* b : {&kv_.k, &kv_.v, &kx_, &vx_})
      if (b->bytes()) PDB_CUDA_CHECK(cudaMemset(b->get(), 0, b->bytes()));
    kv_.capacity = T;
  }
  kv_.heads = nkv;
  kv_.layers = cache_layers;
  kv_.k_row_bytes = kv_.v_row_bytes = hd * elem;
  kv_.scales = kv_fp8_;
  ra_.kv_capacity = as_.kv_capacity = kv_.capacity;
  as_.q_rows = chunk;  // q_ holds a chunk's rows, att_ at least as many
  const int64_t rows_cap = mm_.padded_rows(chunk);
  qkv_.resize(size_t(rows_cap * (nh_ + 2 * nkv) * hd) * 2);
  q_.resize(size_t(chunk * nh_ * hd) * 2);
  att_.resize(size_t(rows_cap * nh_ * hd) * 2);
  if (kv_rows_) {
    kf_.resize(size_t(chunk * nkv * hd) * 4);
    vf_.resize(size_t(chunk * nkv * hd) * 4);
  }
}

std::string GqaAttentionCuda::enable_kv_rows() {
  if (mm_.fp8()) return "the engine multiplies in FP8 (a checkpoint's weights, not the decoder's)";
  if (world_ > 1) return "tensor parallel: a rank holds only its heads' rows";
  kv_rows_ = true;
  return "";
}

// Half weights (the decoder's numerics): the fused q|k|v product is made here, in f32, once: its k and v columns are
// the rows (read where they lie, *ld the product's width), and the attention's RoPE reads it as it is (forward then
// multiplies nothing). Otherwise two products beside the fused one, whose bf16 output would round the rows 4x coarser
// than an f16 cache: the k and v slices of the same weight (rows nh*hd.. of [out x in]) with f32 output.
void GqaAttentionCuda::kv_rows(int64_t l, const bf16* x, const CudaChunk& c, const float** k, const float** v, int64_t* ld) {
  if (!kv_rows_) throw std::logic_error("kv_rows: enable_kv_rows was not called");
  const CudaWeight& wqkv = layers_[size_t(l)].wqkv;
  const int64_t C = nkv_ * hd_, out = (nh_ + 2 * nkv_) * hd_;
  const void* xin = c.decoder_rows() ? c.decoder_rows() : x;
  const cuda::DType xt = c.decoder_rows() ? c.decoder_rows_type() : cuda::DType::BF16;
  *k = kf_.as<float>();
  *v = vf_.as<float>();
  *ld = C;
  rows_of_layer_ = l;
  qkv_made_ = wqkv.products().half;
  if (qkv_made_) {
    const float* y = qkv_f32_ = mm_.half_product_f32(xin, xt, wqkv, c.n, H_, out, c.s);
    *k = y + nh_ * hd_;
    *v = y + nh_ * hd_ + C;
    *ld = out;
    return;
  }
  const auto* w = wqkv.as<uint16_t>();  // bf16
  cuda::Gemm& g = mm_.gemm();
  g.xwt(cuda::DType::BF16, x, w + nh_ * hd_ * H_, cuda::DType::F32, kf_.get(), c.n, H_, C, 0.0f, c.s);
  g.xwt(cuda::DType::BF16, x, w + (nh_ * hd_ + C) * H_, cuda::DType::F32, vf_.get(), c.n, H_, C, 0.0f, c.s);
}

void GqaAttentionCuda::forward(int64_t l, const bf16* x, float* h, const CudaChunk& c) {
  const Layer& Lw = layers_[size_t(l)];
  // Where kv_rows made this layer's k and v columns (in f32, from the same rounded inputs), they are not multiplied
  // twice: kv_rows made the whole q|k|v product (half weights), or only q's columns are multiplied here (into q_, free
  // until the RoPE below writes it) and the fused rows assembled (a third of that product's work on Llama-8B's shape).
  const bool kv_made = rows_of_layer_ == l, qkv_made = kv_made && qkv_made_;
  rows_of_layer_ = -1;
  const int64_t out = kv_made ? nh_ * hd_ : (nh_ + 2 * nkv_) * hd_;
  void* y = kv_made ? q_.get() : qkv_.get();
  // half weights: the product in f32, read by the RoPE as it is (rounded once, to the cache's and q's bf16)
  const float* qkv32 = qkv_made ? qkv_f32_ : nullptr;
  if (!qkv_made && c.decoder_rows() && Lw.wqkv.products().half)
    qkv32 = mm_.half_product_f32(c.decoder_rows(), c.decoder_rows_type(), Lw.wqkv, c.n, H_, out, c.s);
  else if (!qkv_made && c.decoder_rows())
    mm_(c.decoder_rows(), c.decoder_rows_type(), Lw.wqkv, Lw.wqkv_s, c.n, H_, out, cuda::DType::BF16, y, 0.0f, c.s);
  else if (!qkv_made)
    mm_(x, Lw.wqkv, Lw.wqkv_s, c.n, H_, out, cuda::DType::BF16, y, 0.0f, c.s);
  if (kv_made && !qkv_made) cuda::assemble_qkv_rows(q_.as<bf16>(), kf_.as<float>(), vf_.as<float>(), c.n, nh_ * hd_, nkv_ * hd_, qkv_.as<bf16>(), c.s);
  ra_.q_norm = Lw.q_norm.bytes() ? Lw.q_norm.as<float>() : nullptr;
  ra_.k_norm = Lw.k_norm.bytes() ? Lw.k_norm.as<float>() : nullptr;
  attend(l, c, qkv32);
  mm_(att_.get(), Lw.wo, Lw.wo_s, c.n, nh_ * hd_, H_, cuda::DType::F32, h, 1.0f, c.s);
}

// RoPE into this layer's cache rows, then the attention of the chunk's queries over every key so far.
void GqaAttentionCuda::attend(int64_t l, const CudaChunk& c, const float* qkv32) {
  const int64_t nkv = nkv_, hd = hd_, cap = kv_.capacity;
  cudaStream_t s = c.s;
  auto rope = [&](bf16* kc, bf16* vc) {
    if (qkv32) cuda::qkv_rope_to_cache(qkv32, q_.as<bf16>(), kc, vc, ra_, s);
    else cuda::qkv_rope_to_cache(qkv_.as<bf16>(), q_.as<bf16>(), kc, vc, ra_, s);
  };
  if (!kv_fp8_) {
    bf16* kc = kv_.k.as<bf16>() + l * nkv * cap * hd;
    bf16* vc = kv_.v.as<bf16>() + l * nkv * cap * hd;
    rope(kc, vc);
    if (!c.skip_attention) cuda::causal_attention(q_.as<bf16>(), kc, vc, att_.as<bf16>(), as_, s);
    return;
  }
  ra_.k_fp8 = kv_.k.as<uint8_t>() + l * nkv * cap * hd;
  ra_.v_fp8 = kv_.v.as<uint8_t>() + l * nkv * cap * hd;
  ra_.k_scale = kv_.ks.as<float>() + l * nkv * cap;
  ra_.v_scale = kv_.vs.as<float>() + l * nkv * cap;
  rope(nullptr, nullptr);
  if (c.skip_attention) return;  // bench prefill's engine-no-attention: the expansion and the attention both left out
  if (fp8kv_fused_) {
    cuda::causal_attention_fp8kv(q_.as<bf16>(), ra_.k_fp8, ra_.v_fp8, ra_.k_scale, ra_.v_scale, att_.as<bf16>(), as_, s);
    return;
  }
  // This layer's keys so far back to bf16, then the bf16 kernels unchanged. Converting inside the attention's tile
  // loop instead (the fused kernel) adds a phase behind a block barrier per tile: measured 26% slower than bf16 K/V
  // at 32K. Expanding moves ~7 bytes per fp8 element per layer and chunk (read 1 + scale, write 2 per K and V), small
  // beside the attention over the same keys.
  const int64_t keys = c.p0 + c.n;
  cuda::expand_fp8_rows(ra_.k_fp8, ra_.k_scale, int(nkv), cap, keys, int(hd), kx_.as<bf16>(), s);
  cuda::expand_fp8_rows(ra_.v_fp8, ra_.v_scale, int(nkv), cap, keys, int(hd), vx_.as<bf16>(), s);
  cuda::causal_attention(q_.as<bf16>(), kx_.as<bf16>(), vx_.as<bf16>(), att_.as<bf16>(), as_, s);
}

}  // namespace

std::unique_ptr<CudaAttention> make_gqa_attention_cuda(const CudaLoad& ld, const CudaAttentionOptions& o, CudaMatmul& mm) {
  return std::make_unique<GqaAttentionCuda>(ld, o, mm);
}

}  // namespace pdb
