// The CUDA engine's FFN blocks: a SwiGLU (dense layers, or deepseek2's shared experts; FP8 products and a rank's
// columns where the engine has them), the routed experts (model/cuda_moe_ffn.h), and both, added into the residual
// one after the other as llama.cpp sums the shared experts' output and the routed one.
#include <cuda_bf16.h>

#include <memory>
#include <stdexcept>

#include <fmt/format.h>

#include "cuda/elementwise.cuh"
#include "formats/safetensors.h"
#include "model/cuda_blocks.h"
#include "model/cuda_engine_load.h"

namespace pdb {
namespace {

using bf16 = __nv_bfloat16;
using cuda::DeviceBuffer;
using cuda_load::RowSlice;

class SwigluFfnCuda final : public CudaFfn {
 public:
  // Columns [ff0, ff0 + ff) of a SwiGLU `width` wide whose tensors are `prefix`{gate,up,down}_proj.
  SwigluFfnCuda(const CudaLoad& ld, int64_t layer, const std::string& prefix, int64_t width, int64_t ff0, int64_t ff)
      : H_(ld.c.hidden_size), ff_(ff) {
    const std::vector<RowSlice> gu = {{prefix + "gate_proj.weight", width, ff0, ff}, {prefix + "up_proj.weight", width, ff0, ff}};
    const std::vector<RowSlice> d = {{prefix + "down_proj.weight", H_, 0, H_}};
    if (ld.fp8) {
      cuda_load::upload_sliced_fp8(*ld.ck, gu, H_, 0, H_, *ld.fp8, wgu_.resident(), wgu_s_, bytes_);
      cuda_load::upload_sliced_fp8(*ld.ck, d, width, ff0, ff, *ld.fp8, wd_.resident(), wd_s_, bytes_);
    } else {
      wgu_ = cuda_load::weight(ld, layer, gu, H_, 0, H_, bytes_, true);
      wd_ = cuda_load::weight(ld, layer, d, width, ff0, ff, bytes_, true);
    }
  }
  int64_t swiglu_width() const override { return ff_; }
  bool routed() const override { return false; }
  bool takes_half_rows() const override { return wgu_.products().half && !wgu_.products().act_block; }
  void forward(const bf16* x, float* h, CudaFfnScratch& sc, CudaMatmul& mm, const CudaChunk& c) override {
    if (c.decoder_rows()) {  // the decoder's numerics: gate, up and their SwiGLU in f32, the products' inputs rounded as it rounds them
      mm(c.decoder_rows(), c.decoder_rows_type(), wgu_, wgu_s_, c.n, H_, 2 * ff_, cuda::DType::F32, sc.gu.get(), 0.0f, c.s);
      const WeightProducts& down = wd_.products();
      if (down.half && !down.act_block) {  // rounded to half as the SwiGLU writes them: the down product reads them in place
        cuda::swiglu_rows_f32_half(sc.gu.as<float>(), sc.act.as<__half>(), c.n, ff_, c.s);
        mm(sc.act.get(), cuda::DType::F16, wd_, wd_s_, c.n, ff_, H_, cuda::DType::F32, h, 1.0f, c.s);
        return;
      }
      cuda::swiglu_rows_f32(sc.gu.as<float>(), sc.act.as<float>(), c.n, ff_, c.s);
      mm(sc.act.get(), cuda::DType::F32, wd_, wd_s_, c.n, ff_, H_, cuda::DType::F32, h, 1.0f, c.s);
      return;
    }
    mm(x, wgu_, wgu_s_, c.n, H_, 2 * ff_, cuda::DType::BF16, sc.gu.get(), 0.0f, c.s);
    cuda::swiglu_rows(sc.gu.as<bf16>(), sc.act.as<bf16>(), c.n, ff_, c.s);
    mm(sc.act.get(), wd_, wd_s_, c.n, ff_, H_, cuda::DType::F32, h, 1.0f, c.s);
  }
  size_t weight_bytes() const override { return bytes_; }

 private:
  int64_t H_, ff_;
  CudaWeight wgu_, wd_;        // bf16 [out x in] (gate rows, then up rows), or e4m3 on the FP8 path
  DeviceBuffer wgu_s_, wd_s_;  // FP8 path: f32 scale per 128x128 block
  size_t bytes_ = 0;
};

class RoutedFfnCuda final : public CudaFfn {
 public:
  RoutedFfnCuda(const CudaLoad& ld, int64_t layer, const std::string& layer_prefix)
      : w_(load_cuda_moe(ld, layer, layer_prefix, ld.def.renormalize_topk(ld.c), ld.shard.expert_ff0, ld.world > 1 ? ld.shard.expert_ff : -1)) {}
  int64_t swiglu_width() const override { return 0; }
  bool routed() const override { return true; }
  void forward(const bf16* x, float* h, CudaFfnScratch& sc, CudaMatmul& mm, const CudaChunk& c) override {
    sc.moe.forward(w_, x, c.n, h, mm.gemm(), c.s);
  }
  size_t weight_bytes() const override { return w_.bytes(); }
  int64_t full_products_chunk() const override { return CudaMoeFfn::full_products_chunk(w_.n_expert, w_.n_used); }

 private:
  CudaMoeWeights w_;
};

class SharedAndRoutedFfnCuda final : public CudaFfn {
 public:
  SharedAndRoutedFfnCuda(const CudaLoad& ld, int64_t layer, const std::string& layer_prefix, const FfnPlan& plan)
      : shared_(ld, layer, layer_prefix + plan.swiglu_prefix, plan.swiglu_width, 0, plan.swiglu_width), routed_(ld, layer, layer_prefix) {
    if (plan.swiglu_width <= 0) throw std::runtime_error("CUDA engine: a layer of shared and routed experts without shared experts");
  }
  int64_t swiglu_width() const override { return shared_.swiglu_width(); }
  bool routed() const override { return true; }
  void forward(const bf16* x, float* h, CudaFfnScratch& sc, CudaMatmul& mm, const CudaChunk& c) override {
    shared_.forward(x, h, sc, mm, c);
    routed_.forward(x, h, sc, mm, c);
  }
  size_t weight_bytes() const override { return shared_.weight_bytes() + routed_.weight_bytes(); }
  int64_t full_products_chunk() const override { return routed_.full_products_chunk(); }

 private:
  SwigluFfnCuda shared_;
  RoutedFfnCuda routed_;
};

}  // namespace

std::unique_ptr<CudaFfn> load_cuda_ffn(const CudaLoad& ld, int64_t layer) {
  const FfnPlan plan = ld.def.ffn(ld.c, layer);
  const std::string p = fmt::format("model.layers.{}.", layer);
  switch (plan.kind) {
    case FfnKind::swiglu: {
      // a rank's columns under tensor parallel (the shard's), else all of them
      const int64_t ff0 = ld.world > 1 ? ld.shard.ff0 : 0, ff = ld.world > 1 ? ld.shard.ff : plan.swiglu_width;
      return std::make_unique<SwigluFfnCuda>(ld, layer, p + plan.swiglu_prefix, plan.swiglu_width, ff0, ff);
    }
    case FfnKind::routed: return std::make_unique<RoutedFfnCuda>(ld, layer, p);
    case FfnKind::shared_and_routed:
      if (ld.world > 1) throw std::runtime_error("CUDA engine: shared experts are not split across tensor-parallel ranks yet");
      return std::make_unique<SharedAndRoutedFfnCuda>(ld, layer, p, plan);
  }
  throw std::logic_error("load_cuda_ffn: unknown FFN kind");
}

}  // namespace pdb
