// The mixture-of-experts FFN block on the GPU, shared by the architectures that route tokens to
// experts (qwen3moe's every layer, deepseek2's layers after the dense lead): the router product, the
// routing (cuda/moe.cuh), the (token, choice) pairs grouped by expert, gate|up as batched or grouped products
// over all experts (cuBLAS's, grouped_gemm.cuh, or cuDNN's, grouped_gemm_cudnn.h), SwiGLU, down the same way, and the
// weighted sum added into the f32 residual stream.
// The CPU twin is model/moe_ffn.h (its fast path groups tokens the same way).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/gemm.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/readback.cuh"
#include "model/cuda_weights.h"
#include "model/moe_padding.h"

namespace pdb {

struct CudaLoad;
struct HfConfig;

struct CudaMoeWeights {
  int64_t n_expert = 0, n_used = 0, hidden = 0, ff = 0;
  bool renormalize = true;
  float scale = 1.0f;
  CudaWeight router;  // [n_expert x hidden] bf16
  CudaWeight gu;      // per expert [2 ff x hidden] bf16: gate rows, then up rows
  CudaWeight down;    // per expert [hidden x ff] bf16
  size_t bytes() const { return router.bytes() + gu.bytes() + down.bytes(); }
};

// Loads `prefix`mlp.gate and `prefix`mlp.experts.{e}.{gate,up,down}_proj (HF names, qwen3moe and deepseek2 alike);
// of each expert only the columns [ff0, ff0 + ff) (a tensor-parallel rank's; ff < 0: all). `renormalize`: the chosen
// experts' weights are renormalized (the architecture's rule, definitions/).
CudaMoeWeights load_cuda_moe(const CudaLoad& ld, int64_t layer, const std::string& prefix, bool renormalize, int64_t ff0 = 0, int64_t ff = -1);

// The padded layout's chunk sizes as the batched products take them (views into pad).
inline std::vector<cuda::ChunkSpan> chunk_spans(const PaddedExperts& pad) {
  std::vector<cuda::ChunkSpan> spans;
  for (const auto& c : pad.classes) spans.push_back({c.cap, c.expert.data(), c.first_row.data(), int64_t(c.expert.size())});
  return spans;
}

// Y = X W_e^T for every chunk of the padded layout (x, y: pad.rows rows; w: [experts x out x in] bf16): a strided
// batch where every expert fills one chunk (on the H200 3-14% faster than the same chunks through pointers), else
// one pointer-array batch per chunk size. The engine's MoE block and the products' benchmark run this one function.
inline void padded_products(cuda::GroupedGemm& g, const PaddedExperts& pad, int64_t experts, const void* x, const void* w, void* y, int64_t in,
                            int64_t out, cudaStream_t s) {
  if (pad.one_chunk_per_expert(experts)) return g.xwt_padded(x, w, y, pad.cap(), experts, in, out, cuda::DType::BF16, s);
  g.xwt_chunks(x, w, y, chunk_spans(pad), in, out, cuda::DType::BF16, s);
}

class CudaMoeFfn {
 public:
  // Device bytes the block's scratch needs for `rows` tokens (beyond the weights).
  static size_t bytes_for(const HfConfig& c, int64_t rows);
  // h[rows x hidden] += MoE(x[rows x hidden] bf16). The expert products (PDBRIDGE_MOE_GEMM): by default batched
  // cuBLAS products over the experts' rows padded into chunks (model/moe_padding.h: one per chunk size, a strided
  // batch where every expert fills one chunk), or cuBLAS's grouped call where that would pad the rows by more than half; =padded always pads, =grouped and =loop never (one grouped call,
  // one product per expert); all download the expert counts (one small synchronizing copy: cuBLAS takes its sizes on
  // the host). =cudnn (=cudnn-gather: x read through the grouping's index) runs cuDNN's MoE grouped matmul, which
  // keeps the counts on the device; where cuDNN refuses (cuDNN 9.19 on the H200 has no such descriptor), said once,
  // cuBLAS's products run.
  void forward(const CudaMoeWeights& w, const __nv_bfloat16* x, int64_t rows, float* h, cuda::Gemm& gemm, cudaStream_t s);
  size_t scratch_bytes() const;
  static int64_t padded_rows(int64_t grouped_rows);
  // The chunk whose routed rows (chunk x used / experts) average 512 an expert, where the grouped products reach the
  // dense products' rate (docs/RESULTS.md, sessions 27 and 45): 4,096 tokens doubled until then, at most 16,384.
  static int64_t full_products_chunk(int64_t n_expert, int64_t n_used);
  const std::string& cudnn_refused() const { return cudnn_refused_; }  // empty while cuDNN's products run
  const std::string& last_way() const { return last_way_; }            // how the last forward ran its products

 private:
  bool use_cudnn(const std::string& choice, bool& gather);
  void experts_cudnn(const CudaMoeWeights& w, const __nv_bfloat16* x, int64_t rows, bool gather, cudaStream_t s);
  void experts_cublas(const CudaMoeWeights& w, const __nv_bfloat16* x, int64_t rows, cudaStream_t s);
  void experts_padded(const CudaMoeWeights& w, const __nv_bfloat16* x, int64_t rows, const PaddedExperts& pad, cudaStream_t s);

  cuda::GroupedGemm grouped_;
  std::string cudnn_refused_;  // why cuDNN's products are not used (empty: they are, where chosen)
  std::string last_way_;
  cuda::DeviceBuffer logits_, experts_, weights_, counts_, offsets_, pad_offsets_, slot_of_, token_of_, xg_, gu_, act_, y_;
  cuda::Readback counts_back_;
  const int32_t* counts_host_ = nullptr;  // the last forward's expert counts, read back
  cuda::PinnedBuffer pad_offsets_host_;
};

}  // namespace pdb
