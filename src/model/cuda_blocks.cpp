#include "model/cuda_blocks.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "common/tuning.h"
#include "cuda/elementwise.cuh"
#include "cuda/fp8.cuh"
#include "formats/safetensors.h"

namespace pdb {

std::unique_ptr<CudaAttention> make_gqa_attention_cuda(const CudaLoad& ld, const CudaAttentionOptions& o, CudaMatmul& mm);
std::unique_ptr<CudaAttention> make_mla_attention_cuda(const CudaLoad& ld, CudaMatmul& mm);

std::unique_ptr<CudaAttention> load_cuda_attention(const CudaLoad& ld, const CudaAttentionOptions& o, CudaMatmul& mm) {
  switch (ld.def.attention) {
    case AttentionKind::gqa: return make_gqa_attention_cuda(ld, o, mm);
    case AttentionKind::mla: return make_mla_attention_cuda(ld, mm);
  }
  throw std::logic_error("load_cuda_attention: unknown attention kind");
}

std::string cuda_blocks_unsupported(const ModelDefinition& d, const HfConfig& c, bool kv_fp8, int world) {
  if (d.attention == AttentionKind::mla) {
    if (world > 1) return "tensor parallel is not implemented for MLA attention yet";
    if (kv_fp8) return "fp8 K/V is not implemented for MLA attention";
    if (c.qk_nope_head_dim != 128 || c.qk_rope_head_dim != 64 || c.v_head_dim != 128)
      return fmt::format("MLA head widths nope {} / rope {} / v {} not supported (128 / 64 / 128, DeepSeek-V2's)", c.qk_nope_head_dim,
                         c.qk_rope_head_dim, c.v_head_dim);
  } else if (c.head_dim != 64 && c.head_dim != 128) {
    return fmt::format("head_dim {} not supported (64, 128)", c.head_dim);
  }
  if (c.hidden_size % 8 || c.intermediate_size % 8) return "hidden and intermediate sizes must be multiples of 8";
  if (c.attention_bias) return "attention biases are not supported";
  return "";
}

std::string cuda_fp8_unsupported(const ModelDefinition& d, const HfConfig& c, const SafetensorsCheckpoint& ck) {
  if (!c.fp8) return "not an FP8 checkpoint";
  if (d.attention != AttentionKind::gqa || d.ffn(c, 0).kind != FfnKind::swiglu) return "the MoE/MLA engine runs bf16 products";
  if (c.fp8_block_rows != 128 || c.fp8_block_cols != 128)
    return fmt::format("weight_block_size [{}, {}] (the products take [128, 128])", c.fp8_block_rows, c.fp8_block_cols);
  for (int64_t dim : {c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim})
    if (dim % 128) return fmt::format("a dimension of {} is not a multiple of 128", dim);
  for (const char* n : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    if (ck.get(fmt::format("model.layers.0.{}.weight", n)).dtype != StDtype::F8_E4M3) return fmt::format("{} is not F8_E4M3", n);
  if (Tuning::from_env().fp8 == "0") return "PDBRIDGE_FP8=0";
  return "";
}

size_t CudaMatmul::scratch_bytes_for(int64_t chunk, int64_t max_in, int64_t hidden, int64_t max_out) const {
  size_t b = 0;
  if (numerics_ != ProductNumerics::bf16) b += size_t(chunk * max_in) * 2 + size_t(chunk * max_out) * 4;
  if (!fp8_) return b;
  const int64_t rows = fp8_->padded_rows(chunk);
  return b + size_t(rows * max_in) + cuda::fp8_scale_bytes(rows, max_in, *fp8_) + size_t(rows * hidden) * 2;
}

void CudaMatmul::reserve(int64_t chunk, int64_t max_in, int64_t hidden, int64_t max_out) {
  if (numerics_ != ProductNumerics::bf16) {
    xh_.resize(size_t(chunk * max_in) * 2);
    yf_.resize(size_t(chunk * max_out) * 4);
  }
  if (!fp8_) return;
  const int64_t rows = fp8_->padded_rows(chunk);
  xq_.resize(size_t(rows * max_in));
  xs_.resize(cuda::fp8_scale_bytes(rows, max_in, *fp8_));
  if (!fp8_->f32_accumulate) ybf_.resize(size_t(rows * hidden) * 2);
}

const void* CudaMatmul::half_input(const void* x, cuda::DType xt, const CudaWeight& w, int64_t n, int64_t in, cudaStream_t s) {
  const int block = w.products().act_block;
  if (xt == cuda::DType::F16) {
    if (block) throw std::logic_error("CudaMatmul: half rows for a product that quantizes its activations first");
    return x;
  }
  if (block && in % block) throw std::logic_error(fmt::format("CudaMatmul: rows of {} values are not whole q8 blocks of {}", in, block));
  if (xh_.bytes() < size_t(n * in) * 2) throw std::logic_error("CudaMatmul: reserve before a product under the decoder's numerics");
  cuda::product_input_half(x, xt == cuda::DType::F32, n * in, block, xh_.as<__half>(), s);
  return xh_.get();
}

const float* CudaMatmul::half_product_f32(const void* x, cuda::DType xt, const CudaWeight& w, int64_t n, int64_t in, int64_t out, cudaStream_t s) {
  if (!w.products().half) throw std::logic_error("CudaMatmul: half_product_f32 of a weight that is not half");
  if (yf_.bytes() < size_t(n * out) * 4) throw std::logic_error("CudaMatmul: a half product's f32 result without its scratch");
  gemm_.xwt(cuda::DType::F16, half_input(x, xt, w, n, in, s), w.get(), cuda::DType::F32, yf_.get(), n, in, out, 0.0f, s);
  return yf_.as<float>();
}

void CudaMatmul::operator()(const void* x, cuda::DType xt, const CudaWeight& w, const cuda::DeviceBuffer& ws, int64_t n, int64_t in,
                            int64_t out, cuda::DType yt, void* y, float beta, cudaStream_t s) {
  using bf16 = __nv_bfloat16;
  if (w.products().half) {
    if (yt == cuda::DType::F32) return gemm_.xwt(cuda::DType::F16, half_input(x, xt, w, n, in, s), w.get(), yt, y, n, in, out, beta, s);
    // cuBLASLt has no half x half -> bf16 product: made in f32, then rounded
    if (beta != 0.0f) throw std::logic_error("CudaMatmul: a half product's bf16 result added into another");
    return cuda::f32_to_bf16(half_product_f32(x, xt, w, n, in, out, s), static_cast<bf16*>(y), n * out, s);
  }
  if (xt == cuda::DType::F16) throw std::logic_error("CudaMatmul: half rows for a product that is not half");
  if (xt == cuda::DType::F32) {  // bf16 weights among the decoder's (a BF16 GGUF tensor): the rows as bf16
    if (fp8_ || xh_.bytes() < size_t(n * in) * 2) throw std::logic_error("CudaMatmul: f32 rows into a bf16 product without its scratch");
    cuda::f32_to_bf16(static_cast<const float*>(x), xh_.as<bf16>(), n * in, s);
    x = xh_.get();
  }
  if (!fp8_) return gemm_.xwt(cuda::DType::BF16, x, w.get(), yt, y, n, in, out, beta, s);
  n = fp8_->padded_rows(n);
  cuda::quantize_rows_fp8(static_cast<const bf16*>(x), n, in, xq_.as<uint8_t>(), xs_.as<float>(), *fp8_, s);
  if (beta != 0.0f && !fp8_->f32_accumulate) {
    gemm_.xwt_fp8(*fp8_, xq_.as<uint8_t>(), xs_.as<float>(), w.as<uint8_t>(), ws.as<float>(), cuda::DType::BF16, ybf_.get(), n, in, out, 0.0f, s);
    return cuda::add_bf16_into_f32(ybf_.as<bf16>(), static_cast<float*>(y), n * out, s);
  }
  gemm_.xwt_fp8(*fp8_, xq_.as<uint8_t>(), xs_.as<float>(), w.as<uint8_t>(), ws.as<float>(), yt, y, n, in, out, beta, s);
}

}  // namespace pdb
