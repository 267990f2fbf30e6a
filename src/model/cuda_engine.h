// The prefill engine's CUDA backend: a chunked causal forward on the GPU, a driver over an architecture's blocks
// (definitions/definition.h, model/cuda_blocks.h) for HF checkpoints. bf16 weights and activations through cuBLASLt
// (f32 accumulation; block-FP8 checkpoints through block-scaled FP8 products, activations quantized per 1x128
// block), an f32 residual stream (every block's last product accumulates into it, beta = 1), our flash attention
// over the engine's own bf16 (or fp8) K/V cache, and fused RMSNorm / RoPE / SwiGLU kernels. The driver owns what
// every architecture shares: chunks, embedding, norms, the hook, the memory check, tensor parallel's residual
// all-reduce, resuming and keeping the K/V. Like the CPU backend it exposes only the per-layer hook: the residual
// stream entering each layer, here on the device, for the GPU recipe to read on the same stream.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/gemm.cuh"
#include "definitions/definition.h"
#include "formats/hf_config.h"
#include "model/cuda_blocks.h"
#include "model/engine_state.h"
#include "model/product_numerics.h"
#include "model/tensor_parallel.h"

namespace pdb {

class SafetensorsCheckpoint;
namespace cuda { class TpComm; }

class CudaEngine {
 public:
  // (layer, d_h: [rows x hidden] f32 on the device, rows, first position, stream). Work the hook
  // enqueues on `stream` sees d_h as it enters the layer; d_h changes after the hook returns.
  using DeviceHook = std::function<void(int layer, const float* d_h, int64_t rows, int64_t pos0, cudaStream_t stream)>;
  // (layer, d_k, d_v: rows of kv_heads * head_dim f32 on the device, ld floats apart, before RoPE, rows, first position,
  // stream): the layer's K/V rows as the engine's own products (CudaAttention::kv_rows), valid for work enqueued on
  // `stream` during the call. Every layer's, the last included.
  using KvTap =
      std::function<void(int layer, const float* d_k, const float* d_v, int64_t ld, int64_t rows, int64_t pos0, cudaStream_t stream)>;

  // kv_fp8: the engine keeps its own K/V as e4m3 rows with one scale per head row (about half of bf16's
  // memory, for very long prompts); needs head_dim 128 on an sm_90 GPU (the wgmma attention kernel).
  // tp: this engine is one rank of a tensor-parallel group (model/tensor_parallel.h: its heads and FFN
  // columns; the residual stream all-reduced after o_proj and down_proj), on the current device. Null: whole.
  // model: an HF checkpoint directory, or the decoder's GGUF (its quantized weights stay quantized in device memory and
  // are expanded to bf16 one layer at a time: model/cuda_weights.h). numerics: how the products of a GGUF's weights
  // round their operands (model/product_numerics.h; anything but bf16 needs a GGUF).
  CudaEngine(const std::string& model, int threads, bool kv_fp8 = false, cuda::TpComm* tp = nullptr,
             ProductNumerics numerics = ProductNumerics::bf16);
  ~CudaEngine();
  const HfConfig& config() const { return cfg_; }
  cuda::Gemm& gemm() { return *gemm_; }
  cudaStream_t stream() const { return stream_; }
  std::string weights_note() const { return weights_note_ + (kv_fp8_ ? (fp8kv_fused_ ? "; fp8 K/V (fused attention)" : "; fp8 K/V") : ""); }
  bool kv_fp8() const { return kv_fp8_; }
  // Set when the checkpoint is block-FP8 and its products run in FP8 (else its weights were dequantized).
  const std::optional<cuda::Fp8ScaleLayout>& fp8() const { return fp8_; }

  // Caps the device memory in use (everything allocated on the device, the weights included; 0: the device's
  // own size): a prompt whose buffers would pass it is refused by check_fits as one that does not fit. Throws when
  // what is allocated already passes it.
  void set_memory_cap(size_t bytes);
  size_t weight_bytes() const { return weight_bytes_; }
  // Device bytes a prompt of `tokens` needs beyond the weights (engine K/V + chunk buffers).
  size_t bytes_for_prompt(int64_t tokens, int64_t chunk) const;
  // Throws std::runtime_error with a clear message when the prompt cannot fit on this GPU now.
  void check_fits(int64_t tokens, int64_t chunk, size_t extra_bytes = 0) const;
  // The chunk where none is asked for: 4,096 tokens, or more where a block's products need more rows to reach their
  // rate (CudaFfn::full_products_chunk: a MoE block's routed experts).
  int64_t default_chunk() const;

  // Forward over `tokens` in chunks; calls hook for every layer of every chunk. After the last
  // layer's hook nothing more is computed (the bridge needs only what enters each layer).
  // `full_last_layer` computes it anyway (benchmarks comparing with engines that do). `skip_attention`
  // leaves the attention (and fp8 K/V's expansion) out: `bench prefill`'s engine-no-attention, whose
  // difference from a normal run is the attention's own time; the layers' outputs are then not the model's.
  // `cancelled` is polled between layers. Returns tokens fully processed; synchronizes the stream.
  // `resume`: start after the first resume.tokens positions of a state this engine kept (same full_last_layer
  // and K/V dtype): their K/V are copied back into the engine's cache, the hook sees positions from there on.
  // `keep`: receives the engine's K/V of every position processed, in device memory of its own (nothing kept
  // when that memory is not available). Neither for an architecture its definition says is not resumable.
  int64_t prefill(const std::vector<int32_t>& tokens, int64_t chunk, const DeviceHook& hook,
                  const std::function<bool()>& cancelled = {}, bool full_last_layer = false, bool skip_attention = false,
                  ResumePoint resume = {}, std::shared_ptr<EngineState>* keep = nullptr, size_t keep_max_bytes = SIZE_MAX);
  bool resumable() const { return def_.resumable; }
  // --kv-rows engine: enable_kv_rows (before the first prompt: it sizes the prompt's buffers) throws
  // std::invalid_argument where the attention has no such rows (CudaAttention::enable_kv_rows says why); then prefill
  // calls the tap set (null: none, and no products for it) at every layer.
  void enable_kv_rows();
  void set_kv_tap(KvTap tap);
  // PDBRIDGE_CAPTURE_STATS=1: the device time of the K/V rows' products (CudaAttention::kv_rows) since the last call,
  // and of the last layer's norm and rows (the layer the engine alone does not run).
  struct KvRowsStats {
    double rows_ms = 0, last_layer_ms = 0;
  };
  KvRowsStats take_kv_rows_stats();
  const TpShard& shard() const { return shard_; }
  // A new group's comm for the same rank (the old group was aborted after a rank failed).
  void set_tp_comm(cuda::TpComm* tp) { tp_ = tp; }

 private:
  void reserve(int64_t tokens, int64_t chunk, int64_t cache_layers);
  size_t load_embedding(const CudaLoad& ld);
  int64_t widest_swiglu() const;
  bool any_routed() const;
  int64_t widest_product_input() const;  // the FP8 path's activation scratch
  int64_t widest_bf16_product() const;   // the decoder's numerics: the widest product with a bf16 result (q|k|v)
  bool decoder_numerics() const { return numerics_ != ProductNumerics::bf16; }
  void norm_rows(const float* h, const cuda::DeviceBuffer& w, CudaChunk& ch, bool half_rows);
  size_t buffer_bytes() const;
  void keep_state(int64_t processed, std::shared_ptr<EngineState>* keep, size_t keep_max_bytes);
  void resume_from(ResumePoint resume, int64_t tokens);

  HfConfig cfg_;
  const ModelDefinition& def_;
  std::unique_ptr<cuda::Gemm> gemm_;
  cudaStream_t stream_ = nullptr;
  std::string weights_note_;
  size_t weight_bytes_ = 0, memory_cap_ = 0;
  std::optional<cuda::Fp8ScaleLayout> fp8_;
  std::unique_ptr<CudaMatmul> matmul_;
  cuda::DeviceBuffer embed_;                          // [vocab x hidden] f32 (exact for every checkpoint dtype), or
  GgmlType embed_type_ = GgmlType::F32;               // a GGUF's table as it stores it, rows decoded per chunk
  int64_t embed_row_bytes_ = 0;
  std::unique_ptr<CudaQuantStore> quant_;             // a GGUF's quantized weights (expanded per layer); null otherwise
  std::vector<cuda::DeviceBuffer> in_norm_, post_norm_;  // f32, per layer
  std::unique_ptr<CudaAttention> attention_;
  bool kv_rows_ = false;
  KvTap kv_tap_;
  bool kv_rows_stats_ = false;
  cuda::EventSpans kv_rows_spans_, last_layer_spans_;
  std::vector<std::unique_ptr<CudaFfn>> ffns_;
  CudaFfnScratch ffn_scratch_;
  cuda::DeviceBuffer tokens_, h_, x_;  // per prompt, grown on demand and kept for the next one
  ProductNumerics numerics_ = ProductNumerics::bf16;
  cuda::DeviceBuffer xf_;  // the decoder's numerics: the normed rows in f32 (CudaChunk::xf)
  cuda::DeviceBuffer xh_;  // or as half, for a block whose products all take them so (CudaChunk::xh)
  bool kv_fp8_ = false;
  // kv_fp8: the attention converts each fp8 tile itself (PDBRIDGE_FP8KV_FUSED=1) instead of reading one
  // layer's rows expanded to bf16 beforehand (a buffer of one layer's bf16 K/V).
  bool fp8kv_fused_ = false;
  cuda::TpComm* tp_ = nullptr;
  TpShard shard_;  // the heads and FFN columns this engine holds (all of them without tp)
};

}  // namespace pdb
