#include "recipes/recipe_gpu.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "cuda/elementwise.cuh"
#include "cuda/gemm.cuh"
#include "cuda/q8_gemm.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "formats/numeric.h"
#include "numerics/decoder_numerics.h"
#include "numerics/q8_dot.h"

namespace pdb {

GpuRecipe::GpuRecipe(const Recipe& cpu, cuda::Gemm& gemm, int64_t max_rows, bool with_weights)
    : cpu_(cpu), gemm_(gemm), max_rows_(max_rows), with_weights_(with_weights), rope_table_(cpu.info().rope, cpu.threads()) {
  const auto& in = cpu.info();
  const int64_t E = in.n_embd;
  auto upload = [&](const RecipeWeight& rw) {
    Weight w;
    w.type = rw.type;
    w.rows = rw.rows;
    w.cols = rw.cols;
    const size_t n = rw.w.size();
    if (rw.type == GgmlType::F16 || rw.type == GgmlType::BF16) {
      std::vector<uint16_t> half(n);
      const bool f16 = rw.type == GgmlType::F16;
      parallel_for(int64_t(n), cpu.threads(), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) half[size_t(i)] = f16 ? f32_to_fp16(rw.w[size_t(i)]) : f32_to_bf16(rw.w[size_t(i)]);
      });
      w.w.resize(n * 2);
      w.w.upload(half.data(), n * 2);
    } else if (!rw.q8.q.empty() && rw.cols % 128 == 0) {
      const Q8Matrix& m = rw.q8;
      w.q.resize(m.q.size());
      w.q.upload(m.q.data(), m.q.size());
      w.d.resize(m.d.size() * 4);
      w.d.upload(m.d.data(), m.d.size() * 4);
    } else if (!rw.q8.q.empty()) {  // Q8_0/Q4_0 rows the integer kernel does not tile: their exact f32 values
      const Q8Matrix& m = rw.q8;
      std::vector<float> f(m.q.size());
      for (size_t i = 0; i < f.size(); ++i) f[i] = m.d[i / 32] * float(m.q[i]);
      w.w.resize(f.size() * 4);
      w.w.upload(f.data(), f.size() * 4);
    } else {  // F32, and other block-quantized weights dequantized exactly to f32 at load
      w.w.resize(n * 4);
      w.w.upload(rw.w.data(), n * 4);
    }
    if (!rw.bias.empty()) {
      w.bias.resize(rw.bias.size() * 4);
      w.bias.upload(rw.bias.data(), rw.bias.size() * 4);
    }
    if (!rw.block_min.empty()) {
      w.block_min.resize(rw.block_min.size() * 4);
      w.block_min.upload(rw.block_min.data(), rw.block_min.size() * 4);
    }
    bytes_ += w.w.bytes() + w.bias.bytes() + w.q.bytes() + w.d.bytes() + w.block_min.bytes();
    return w;
  };
  for (int64_t l = 0; l < cpu.loaded_layers(); ++l) {
    if (with_weights) wk_.push_back(upload(cpu.k_weight(int(l))));
    if (in.mla()) {
      cuda::DeviceBuffer lb(size_t(in.kv_lora_rank) * 4);
      lb.upload(cpu.k_latent_norm(int(l)), size_t(in.kv_lora_rank) * 4);
      latent_norm_.push_back(std::move(lb));
    } else if (with_weights) {
      wv_.push_back(upload(cpu.v_weight(int(l))));
    }
    cuda::DeviceBuffer nb(size_t(E) * 4);
    nb.upload(cpu.attn_norm(int(l)), size_t(E) * 4);
    norm_.push_back(std::move(nb));
    if (const float* kn = cpu.k_head_norm(int(l))) {
      cuda::DeviceBuffer kb(size_t(in.head_dim) * 4);
      kb.upload(kn, size_t(in.head_dim) * 4);
      k_norm_.push_back(std::move(kb));
    }
  }
  if (with_weights) {  // the products' activations
    x_.resize(size_t(max_rows * E) * 4);
    xa_.resize(size_t(max_rows * E) * 4);
    xq_.resize(size_t(max_rows * E));
    xd_.resize(size_t(max_rows * E / 32 + 1) * 4);
    q81c_.resize(size_t(max_rows * E / 32 + 1) * 4);
  }
  cs_.resize(size_t(max_rows * in.rope.n_dims) * 4);
  bytes_ += x_.bytes() + xa_.bytes() + cs_.bytes() + xq_.bytes() + xd_.bytes() + q81c_.bytes();
}

GpuRecipe::~GpuRecipe() = default;

void GpuRecipe::set_positions(int64_t pos0, int64_t rows, cudaStream_t s) {
  if (rows > max_rows_) throw std::invalid_argument(fmt::format("GPU recipe: {} rows, sized for {}", rows, max_rows_));
  rope_table_.upload(pos0, rows, cs_.as<float>(), s);
}

bool GpuRecipe::same_activations(const Weight& a, const Weight& b) {
  return a.type == b.type && a.cols == b.cols && bool(a.q.bytes()) == bool(b.q.bytes());
}

void GpuRecipe::project(const Weight& w, const float* x, int64_t rows, cudaStream_t s, float* y, bool converted, const void* half_x) {
  const int64_t n = rows * w.cols;
  if (half_x && w.type != GgmlType::F16) throw std::logic_error("GPU recipe: f16 activations for a weight that is not F16");
  switch (w.type) {
    case GgmlType::F16:
      if (!converted && !half_x) cuda::f32_to_f16(x, xa_.as<__half>(), n, s);
      gemm_.xwt(cuda::DType::F16, half_x ? half_x : xa_.get(), w.w.get(), cuda::DType::F32, y, rows, w.cols, w.rows, 0.0f, s);
      break;
    case GgmlType::BF16:
      if (!converted) cuda::f32_to_bf16(x, xa_.as<__nv_bfloat16>(), n, s);
      gemm_.xwt(cuda::DType::BF16, xa_.get(), w.w.get(), cuda::DType::F32, y, rows, w.cols, w.rows, 0.0f, s);
      break;
    case GgmlType::F32: gemm_.xwt(cuda::DType::F32, x, w.w.get(), cuda::DType::F32, y, rows, w.cols, w.rows, 0.0f, s); break;
    default:
      if (w.q.bytes()) {  // Q8_0/Q4_0: integer block sums, as ggml-cpu
        if (!converted) cuda::quantize_rows_q8(x, rows, w.cols, xq_.as<int8_t>(), xd_.as<float>(), s);
        cuda::q8_block_gemm(xq_.as<int8_t>(), xd_.as<float>(), w.q.as<int8_t>(), w.d.as<float>(), y, rows, w.cols, w.rows, s);
        break;
      }
      if (w.cols % 32) throw std::runtime_error("quantized weight with a row not a multiple of 32");
      if (!converted) {
        if (w.block_min.bytes()) cuda::q8_1_sum_corrections(x, n, q81c_.as<float>(), s);
        PDB_CUDA_CHECK(cudaMemcpyAsync(xa_.get(), x, size_t(n) * 4, cudaMemcpyDeviceToDevice, s));
        // the activation as ggml-cpu quantizes it for the weight's dot type (Q8_K: the K-quants and IQ types)
        if (ggmlnum::act_quant_for(w.type) == ggmlnum::ActQuant::q8_k && w.cols % 256 == 0) cuda::q8_k_round_trip(xa_.as<float>(), n, s);
        else cuda::q8_0_round_trip(xa_.as<float>(), n, s);
      }
      gemm_.xwt(cuda::DType::F32, xa_.get(), w.w.get(), cuda::DType::F32, y, rows, w.cols, w.rows, 0.0f, s);
      // Q4_1/Q5_1: the mins' term as ggml-cpu's Q8_1 block sums make it (recipe.cpp's project)
      if (w.block_min.bytes())
        gemm_.xwt(cuda::DType::F32, q81c_.get(), w.block_min.get(), cuda::DType::F32, y, rows, w.cols / 32, w.rows, 1.0f, s);
  }
  if (w.bias.bytes()) cuda::add_bias_rows(y, w.bias.as<float>(), rows, w.rows, s);
}

void GpuRecipe::kv_f32(int layer, const float* d_h, int64_t rows, cudaStream_t s, float* d_k, float* d_v) {
  normalize(layer, d_h, rows, s, x_.as<float>());
  kv_from_normed(layer, x_.as<float>(), rows, s, d_k, d_v);
}

void GpuRecipe::check(int layer, int64_t rows) const {
  if (layer < 0 || layer >= int64_t(norm_.size())) throw std::out_of_range(fmt::format("GPU recipe layer {} not loaded", layer));
  if (rows > max_rows_) throw std::invalid_argument(fmt::format("GPU recipe: {} rows, sized for {}", rows, max_rows_));
}

bool GpuRecipe::normed_as_f16(int layer) const {
  if (!with_weights_ || cpu_.info().mla() || layer < 0 || size_t(layer) >= wk_.size()) return false;
  const Weight& wk = wk_[size_t(layer)];
  return wk.type == GgmlType::F16 && same_activations(wk, wv_[size_t(layer)]);
}

void GpuRecipe::normalize(int layer, const float* d_h, int64_t rows, cudaStream_t s, float* d_x) {
  const auto& in = cpu_.info();
  check(layer, rows);
  if (normed_as_f16(layer))
    cuda::rmsnorm_rows_f16(d_h, norm_[size_t(layer)].as<float>(), reinterpret_cast<__half*>(d_x), rows, in.n_embd, in.norm_eps, s);
  else
    cuda::rmsnorm_rows(d_h, norm_[size_t(layer)].as<float>(), d_x, rows, in.n_embd, in.norm_eps, s);
}

// K's product into d_k, and V's into d_v (MLA: the latent's alone).
void GpuRecipe::kv_products(int layer, const float* d_x, int64_t rows, cudaStream_t s, float* d_k, float* d_v) {
  check(layer, rows);
  if (!with_weights_) throw std::logic_error("GPU recipe made without its K/V weights: the rows come from the engine");
  const Weight& wk = wk_[size_t(layer)];
  const void* half_x = normed_as_f16(layer) ? static_cast<const void*>(d_x) : nullptr;  // normalize wrote f16 rows
  project(wk, d_x, rows, s, d_k, false, half_x);
  if (cpu_.info().mla()) return;
  const Weight& wv = wv_[size_t(layer)];
  project(wv, d_x, rows, s, d_v, same_activations(wk, wv), half_x);
}

void GpuRecipe::kv_from_normed(int layer, const float* d_x, int64_t rows, cudaStream_t s, float* d_k, float* d_v) {
  kv_products(layer, d_x, rows, s, d_k, d_v);
  if (cpu_.info().mla()) return deepseek2_row(layer, d_k, rows, s);  // recipes/deepseek2_gpu.cpp
  rope_k(layer, d_k, rows, s);
}

bool GpuRecipe::kv_f16_from_normed(int layer, const float* d_x, int64_t rows, cudaStream_t s, float* d_k, float* d_v, void* k_f16,
                                   void* v_f16) {
  const auto& in = cpu_.info();
  if (in.mla()) return false;
  kv_products(layer, d_x, rows, s, d_k, d_v);
  const float* kn = k_norm_.empty() ? nullptr : k_norm_[size_t(layer)].as<float>();
  cuda::kv_rows_to_f16(d_k, d_v, cs_.as<float>(), rows, int(in.n_head_kv), int(in.head_dim), in.rope.n_dims, in.rope.mode == RopeMode::Neox, false,
                       kn, in.norm_eps, k_f16, v_f16, s);
  return true;
}

void GpuRecipe::rope_k(int layer, float* d_k, int64_t rows, cudaStream_t s) {
  const auto& in = cpu_.info();
  const float* kn = k_norm_.empty() ? nullptr : k_norm_[size_t(layer)].as<float>();
  cuda::rope_ggml_rows(d_k, cs_.as<float>(), rows, int(in.n_head_kv), int(in.head_dim), in.rope.n_dims, in.rope.mode == RopeMode::Neox, kn,
                       in.norm_eps, s);
}

void GpuRecipe::rows_from_engine(int layer, const float* k, const float* v, int64_t ld, int64_t rows, bool hf_k_order, cudaStream_t s, float* d_k,
                                 float* d_v) {
  const auto& in = cpu_.info();
  check(layer, rows);
  const int64_t C = in.n_embd_kv();
  auto copy_rows = [&](float* dst, const float* src) {  // rows ld apart into rows C apart
    PDB_CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(C) * 4, src, size_t(ld) * 4, size_t(C) * 4, size_t(rows), cudaMemcpyDeviceToDevice, s));
  };
  if (in.mla()) {  // the engine's kv_a product [latent | k_pe]: the latent's norm and k_pe's RoPE are the decoder's
    copy_rows(d_k, k);
    return deepseek2_row(layer, d_k, rows, s);
  }
  if (hf_k_order && ld != C) {  // the reorder reads packed rows: d_v holds them until V's own copy
    copy_rows(d_v, k);
    cuda::qk_rows_to_gguf_order(d_v, d_k, rows, int(in.n_head_kv), int(in.head_dim), s);
  } else if (hf_k_order) {
    cuda::qk_rows_to_gguf_order(k, d_k, rows, int(in.n_head_kv), int(in.head_dim), s);
  } else {
    copy_rows(d_k, k);
  }
  copy_rows(d_v, v);
  rope_k(layer, d_k, rows, s);
}

bool GpuRecipe::rows_f16_from_engine(int layer, const float* k, const float* v, int64_t ld, int64_t rows, bool hf_k_order, cudaStream_t s,
                                     void* k_f16, void* v_f16) {
  const auto& in = cpu_.info();
  if (in.mla()) return false;
  check(layer, rows);
  const float* kn = k_norm_.empty() ? nullptr : k_norm_[size_t(layer)].as<float>();
  cuda::kv_rows_to_f16(k, v, cs_.as<float>(), rows, int(in.n_head_kv), int(in.head_dim), in.rope.n_dims, in.rope.mode == RopeMode::Neox, hf_k_order,
                       kn, in.norm_eps, k_f16, v_f16, s, ld);
  return true;
}

}  // namespace pdb
