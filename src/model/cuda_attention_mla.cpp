// Multi-head latent attention on the GPU (deepseek2: DeepSeek-V2 / V2-Lite), decompressed per head (cuda/mla.cuh
// says why). Per layer and chunk, all products bf16 with f32 accumulation:
//   [q | c_kv | k_pe] = x [W_q ; W_kv_a]^T            (one product; with a q LoRA: [q_a | c_kv | k_pe], then q = rms_norm(q_a) W_q_b^T)
//   c_kv = rms_norm(c_kv) * kv_a_norm;  [k_nope | v] per head = c_kv W_kv_b^T
//   keys [k_nope_h | RoPE(k_pe)] (192), values v_h (128), queries [q_nope_h | RoPE(q_pe_h)]; scores x mscale^2/sqrt(192)
//   h += attention W_o^T
// RoPE: ggml's NORM pairs with llama.cpp's YaRN angles (numerics/mla_rope.h), the same as the CPU block.
#include <cuda_bf16.h>

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "cuda/attention.cuh"
#include "cuda/mla.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope_table.h"
#include "formats/safetensors.h"
#include "formats/weight_source.h"
#include "model/cuda_blocks.h"
#include "model/cuda_engine_load.h"
#include "numerics/mla_rope.h"

namespace pdb {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;

class MlaAttentionCuda final : public CudaAttention {
 public:
  MlaAttentionCuda(const CudaLoad& ld, CudaMatmul& mm);
  void load_layer(const CudaLoad& ld, int64_t layer) override;
  size_t prompt_bytes(int64_t T, int64_t chunk, int64_t cache_layers) const override;
  void reserve(int64_t T, int64_t chunk, int64_t cache_layers) override;
  void begin_chunk(const CudaChunk& c) override;
  void forward(int64_t layer, const bf16* x, float* h, const CudaChunk& c) override;
  CudaKvCache& kv() override { return kv_; }
  std::string enable_kv_rows() override;
  void kv_rows(int64_t layer, const bf16* x, const CudaChunk& c, const float** k, const float** v, int64_t* ld) override;
  size_t kv_rows_weights_end(int64_t layer) const override {
    const Layer& L = layers_[size_t(layer)];
    return std::max(L.wfront.scratch_end(), L.wkv_a_rows.scratch_end());
  }
  size_t buffer_bytes() const override {
    return kv_.bytes() + front_.bytes() + qa_.bytes() + qfull_.bytes() + q_.bytes() + ckv_.bytes() + kvb_.bytes() + att_.bytes() + cs_.bytes() +
           kvf_.bytes();
  }
  size_t weight_bytes() const override { return weight_bytes_; }

 private:
  struct Layer {
    DeviceBuffer q_a_norm, kv_a_norm;  // f32
    CudaWeight wfront;                 // [q_proj (or q_a_proj) ; kv_a_proj_with_mqa] fused along out, bf16
    CudaWeight wq_b, wkv_b, wo;        // bf16
    // kv_a as the decoder holds it, where its products are half (an F16 GGUF under the decoder's numerics): the cache
    // rows' product, the recipe's own (the decoder's weights and its rows rounded to half); else empty
    CudaWeight wkv_a_rows;
  };
  int64_t front_width() const { return (ql_ ? ql_ : nh_ * qk_) + kvl_ + rope_; }  // q (or q_a) | c_kv | k_pe
  CudaMatmul& mm_;
  cuda::Gemm& gemm_;
  int64_t H_, nh_, nope_, rope_, qk_, vd_, kvl_, ql_;
  float eps_;
  MlaRope mr_;
  std::vector<Layer> layers_;
  CudaKvCache kv_;
  DeviceBuffer front_, qa_, qfull_, q_, ckv_, kvb_, att_, cs_;  // cs_: the chunk's RoPE cos/sin
  bool kv_rows_ = false;
  DeviceBuffer kvf_;  // --kv-rows engine: the chunk's [c_kv | k_pe] as f32 products [rows x (kv_lora + rope)]
  cuda::RopeTable rope_table_;
  cuda::MlaShape ms_;
  cuda::AttentionShape as_;
  size_t weight_bytes_ = 0;
};

MlaAttentionCuda::MlaAttentionCuda(const CudaLoad& ld, CudaMatmul& mm)
    : mm_(mm), gemm_(mm.gemm()), H_(ld.c.hidden_size), nh_(ld.c.num_heads), nope_(ld.c.qk_nope_head_dim), rope_(ld.c.qk_rope_head_dim),
      qk_(nope_ + rope_), vd_(ld.c.v_head_dim), kvl_(ld.c.kv_lora_rank), ql_(ld.c.q_lora_rank), eps_(float(ld.c.rms_norm_eps)),
      mr_(mla_rope(ld.c)), rope_table_(mr_.rope, 4) {
  if (mr_.rope.n_dims != rope_) throw std::invalid_argument(fmt::format("MLA: RoPE over {} of the {} rope dims", mr_.rope.n_dims, rope_));
  ms_.n_heads = int(nh_);
  ms_.nope = int(nope_);
  ms_.rope = int(rope_);
  ms_.v_dim = int(vd_);
  as_.n_heads = as_.n_kv_heads = int(nh_);
  as_.head_dim = int(qk_);
  as_.v_head_dim = int(vd_);
  as_.scale = mr_.kq_scale;
}

void MlaAttentionCuda::load_layer(const CudaLoad& ld, int64_t l) {
  if (l != int64_t(layers_.size())) throw std::logic_error("attention layers are loaded in order");
  size_t& total = weight_bytes_;
  const std::string p = fmt::format("model.layers.{}.self_attn.", l);
  Layer L;
  // whole tensors stacked along the output dimension
  auto stacked = [&](const std::vector<std::pair<std::string, int64_t>>& parts, int64_t cols) {
    std::vector<cuda_load::RowSlice> s;
    for (const auto& [name, rows] : parts) s.push_back({name, rows, 0, rows});
    return cuda_load::weight(ld, l, s, cols, 0, cols, total);
  };
  L.kv_a_norm = cuda_load::upload_f32(cuda_load::vector(ld, p + "kv_a_layernorm.weight", kvl_));
  const std::pair<std::string, int64_t> kv_a{p + "kv_a_proj_with_mqa.weight", kvl_ + rope_};
  if (ql_) {
    L.wfront = stacked({{p + "q_a_proj.weight", ql_}, kv_a}, H_);
    L.q_a_norm = cuda_load::upload_f32(cuda_load::vector(ld, p + "q_a_layernorm.weight", ql_));
    L.wq_b = stacked({{p + "q_b_proj.weight", nh_ * qk_}}, ql_);
  } else {
    L.wfront = stacked({{p + "q_proj.weight", nh_ * qk_}, kv_a}, H_);
  }
  if (!ld.ck && ld.numerics != ProductNumerics::bf16 && ld.gguf->storage_type(kv_a.first) == GgmlType::F16) {
    CudaWeight rows_w = cuda_load::weight(ld, l, {{kv_a.first, kv_a.second, 0, kv_a.second}}, H_, 0, H_, total, true);
    if (rows_w.products().half) L.wkv_a_rows = std::move(rows_w);
  }
  L.wkv_b = stacked({{p + "kv_b_proj.weight", nh_ * (nope_ + vd_)}}, kvl_);
  L.wo = stacked({{p + "o_proj.weight", H_}}, nh_ * vd_);
  layers_.push_back(std::move(L));
}

size_t MlaAttentionCuda::prompt_bytes(int64_t T, int64_t chunk, int64_t cache_layers) const {
  const size_t kv = size_t(cache_layers) * size_t(nh_ * T) * size_t(qk_ + vd_) * 2;
  return kv + size_t(chunk) * size_t(front_width() * 2 + ql_ * 2 + 2 * nh_ * qk_ * 2 + kvl_ * 2 + nh_ * (nope_ + vd_) * 2 + nh_ * vd_ * 2 + rope_ * 4 +
                                     (kv_rows_ ? (kvl_ + rope_) * 4 : 0));
}

void MlaAttentionCuda::reserve(int64_t T, int64_t chunk, int64_t cache_layers) {
  const size_t kbytes = size_t(cache_layers * nh_ * T * qk_) * 2, vbytes = size_t(cache_layers * nh_ * T * vd_) * 2;
  if (kv_.capacity < T || kv_.k.bytes() < kbytes || kv_.v.bytes() < vbytes) {
    kv_.k.release();
    kv_.v.release();
    kv_.k.resize(kbytes);
    kv_.v.resize(vbytes);
    kv_.capacity = T;
  }
  kv_.heads = nh_;
  kv_.layers = cache_layers;
  kv_.k_row_bytes = qk_ * 2;
  kv_.v_row_bytes = vd_ * 2;
  ms_.kv_capacity = as_.kv_capacity = kv_.capacity;
  front_.resize(size_t(chunk * front_width()) * 2);
  if (ql_) {
    qa_.resize(size_t(chunk * ql_) * 2);
    qfull_.resize(size_t(chunk * nh_ * qk_) * 2);
  }
  q_.resize(size_t(chunk * nh_ * qk_) * 2);
  ckv_.resize(size_t(chunk * kvl_) * 2);
  kvb_.resize(size_t(chunk * nh_ * (nope_ + vd_)) * 2);
  att_.resize(size_t(chunk * nh_ * vd_) * 2);
  cs_.resize(size_t(chunk * rope_) * 4);
  if (kv_rows_) kvf_.resize(size_t(chunk * (kvl_ + rope_)) * 4);
}

void MlaAttentionCuda::begin_chunk(const CudaChunk& c) {
  ms_.rows = as_.n_q = c.n;
  ms_.pos0 = as_.pos0 = c.p0;
  rope_table_.upload(c.p0, c.n, cs_.as<float>(), c.s);  // pinned, computed once per position: the host does not wait
}

// --kv-rows engine: the rows are the kv_a columns of the front product, [c_kv | k_pe] before the latent's norm and
// k_pe's RoPE (the recipe applies both as the decoder does: GpuRecipe::rows_from_engine), made again in f32 (576 of
// its outputs at V2's widths) so that an f16 cache is not rounded from bf16. Where kv_a's products are half (the
// decoder's F16 weights, its normed rows rounded to half: the recipe's product exactly) that product makes them.
std::string MlaAttentionCuda::enable_kv_rows() {
  kv_rows_ = true;
  return "";
}

void MlaAttentionCuda::kv_rows(int64_t l, const bf16* x, const CudaChunk& c, const float** k, const float** v, int64_t* ld) {
  if (!kv_rows_) throw std::logic_error("kv_rows: enable_kv_rows was not called");
  const int64_t qpart = ql_ ? ql_ : nh_ * qk_;
  const Layer& L = layers_[size_t(l)];
  if (L.wkv_a_rows.products().half && c.decoder_rows()) {
    mm_(c.decoder_rows(), c.decoder_rows_type(), L.wkv_a_rows, {}, c.n, H_, kvl_ + rope_, cuda::DType::F32, kvf_.get(), 0.0f, c.s);
  } else {
    const auto* w = L.wfront.as<uint16_t>();  // bf16 [front_width x H]: q (or q_a) rows, then kv_a's
    gemm_.xwt(cuda::DType::BF16, x, w + qpart * H_, cuda::DType::F32, kvf_.get(), c.n, H_, kvl_ + rope_, 0.0f, c.s);
  }
  *k = kvf_.as<float>();
  *v = nullptr;
  *ld = kvl_ + rope_;
}

void MlaAttentionCuda::forward(int64_t l, const bf16* x, float* h, const CudaChunk& c) {
  const Layer& Lw = layers_[size_t(l)];
  const int64_t n = c.n, A = front_width(), qpart = ql_ ? ql_ : nh_ * qk_, cap = kv_.capacity;
  cudaStream_t s = c.s;
  bf16* kc = kv_.k.as<bf16>() + l * nh_ * cap * qk_;
  bf16* vc = kv_.v.as<bf16>() + l * nh_ * cap * vd_;
  gemm_.xwt(cuda::DType::BF16, x, Lw.wfront.get(), cuda::DType::BF16, front_.get(), n, H_, A, 0.0f, s);
  const bf16* front = front_.as<bf16>();
  const bf16* q_src = front;
  int64_t q_stride = A;
  if (ql_) {
    cuda::rmsnorm_rows_strided_bf16(front, A, Lw.q_a_norm.as<float>(), qa_.as<bf16>(), ql_, n, ql_, eps_, s);
    gemm_.xwt(cuda::DType::BF16, qa_.get(), Lw.wq_b.get(), cuda::DType::BF16, qfull_.get(), n, ql_, nh_ * qk_, 0.0f, s);
    q_src = qfull_.as<bf16>();
    q_stride = nh_ * qk_;
  }
  cuda::rmsnorm_rows_strided_bf16(front + qpart, A, Lw.kv_a_norm.as<float>(), ckv_.as<bf16>(), kvl_, n, kvl_, eps_, s);
  cuda::mla_rope_qk(q_src, q_stride, front + qpart + kvl_, A, cs_.as<float>(), q_.as<bf16>(), kc, ms_, s);
  gemm_.xwt(cuda::DType::BF16, ckv_.get(), Lw.wkv_b.get(), cuda::DType::BF16, kvb_.get(), n, kvl_, nh_ * (nope_ + vd_), 0.0f, s);
  cuda::mla_scatter_kv(kvb_.as<bf16>(), kc, vc, ms_, s);
  if (!c.skip_attention) cuda::causal_attention(q_.as<bf16>(), kc, vc, att_.as<bf16>(), as_, s);
  gemm_.xwt(cuda::DType::BF16, att_.get(), Lw.wo.get(), cuda::DType::F32, h, n, nh_ * vd_, H_, 1.0f, s);
}

}  // namespace

std::unique_ptr<CudaAttention> make_mla_attention_cuda(const CudaLoad& ld, CudaMatmul& mm) { return std::make_unique<MlaAttentionCuda>(ld, mm); }

}  // namespace pdb
