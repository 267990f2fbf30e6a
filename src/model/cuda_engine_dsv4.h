// The GPU engine's DeepSeek-V4 forward (the CPU twin: model/cpu_engine_dsv4.h, which it follows step for step):
// per chunk and layer, first the recipe's sections on the device from the decoder's own weights (the window row,
// the compressors' pools and rings, the indexer's rows: recipes/deepseek4.h's arithmetic, Q8_0 projections in
// integers as ggml-cpu multiplies them, q8_gemm.cuh), then the layer over them: the q path, the lightning
// indexer's top-k on ratio-4 layers (dsv4_indexer.cuh), the sparse attention over each query's window and
// visible compressed rows (one fused kernel reading the rows in place, dsv4_attention.cuh), the de-RoPE, the
// grouped output LoRA, the MoE (routing by tid2eid or biased sqrt-softplus scores,
// routed experts as one cuBLAS product per expert, FP4 experts kept FP4 in memory and expanded to bf16 per layer on a
// side stream just before them) and the hyper-connection mixes. bf16 products with f32 accumulation, f32 streams: tolerance class.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "formats/ggml_types.h"
#include "model/cpu_engine_dsv4.h"
#include "formats/deepseek4_config.h"

namespace pdb {

class Deepseek4CudaEngine {
 public:
  // As the CPU engine's hook, with x = nullptr (the streams stay on the device), called while the GPU goes on with
  // the layer's attention; the sections are downloaded (through pinned memory), the
  // window rows only for the chunk's last min(rows, W) positions (window_first says which): all that the wire (the
  // prompt's last W) and a seal at the chunk's end need, where copying every position's row cost a third of the
  // sections' time at 16K-token chunks.
  using ChunkHook = Deepseek4CpuEngine::ChunkHook;
  // kExpand (the FP4 experts' expansion to bf16) and kRouted (the routed experts' grouped products and their
  // SwiGLU) are parts of the MoE's time, reported apart; the four kSections* parts are the sections' time (the
  // hyper-connection mixes, norm and Q8_0 codes of the layer's input; the window row; the pool's compressor; the
  // indexer's compressor); kIndexerTopk is the indexer's top-k selection, part of kIndexer; kHook is the hook's host
  // time, beside the layer's device work (it runs while the GPU runs the attention; where it outlasts that, the MoE's
  // time holds the wait). Profile::part_of_another says which of them not to add twice.
  enum Phase { kSections, kQuery, kIndexer, kAttention, kOutput, kMoe, kHook, kExpand, kRouted, kSectionsMix, kSectionsWindow, kSectionsPool, kSectionsLid, kIndexerTopk, kMoeRoute, kMoeExpandWait, kMoeShared, kPhases };
  // Device milliseconds per layer and phase, summed over the chunks of the prompts run with it set.
  struct Profile {
    std::vector<std::array<double, kPhases>> ms;
    std::vector<int32_t> ratio;
    static const char* phase_name(int p);
    static bool part_of_another(int p) { return p == kExpand || p == kRouted || p == kHook || p >= kSectionsMix; }
  };

  // The decoder's weights (for the sections) from the recipe's GGUF; the engine's from `weights`.
  Deepseek4CudaEngine(const Deepseek4Recipe& recipe, const Deepseek4Weights& weights);
  // Random weights at c's shapes, made on the device (the real-shape benchmarks: c.layers layers with their
  // compress ratios): FP4 routed experts, bf16 dense matrices, Q8_0 section projections (the converter's types).
  // PDBRIDGE_DSV4_EXPERTS=bf16 keeps the routed experts in bf16 instead (the A/B of the FP4 expansion's cost).
  static std::unique_ptr<Deepseek4CudaEngine> random(const Deepseek4Config& c, uint64_t seed);
  ~Deepseek4CudaEngine();

  const Deepseek4Config& config() const { return c_; }
  std::string weights_note() const { return note_; }
  size_t weight_bytes() const { return weight_bytes_; }
  // The routed experts' products as the last prefill ran them: FP8 (and how many FP4 layers fit their e4m3 tiles)
  // or bf16, and why.
  std::string experts_note() const;
  // Chunk after chunk, as Deepseek4CpuEngine::prefill. `compute_last`: the last layer is computed too (the
  // benchmarks time every layer); `profile`: per-phase device times added into it.
  int64_t prefill(const std::vector<int32_t>& tokens, int64_t chunk, GgmlType k_type, const ChunkHook& hook,
                  const std::function<bool()>& stop = {}, bool compute_last = false, Profile* profile = nullptr);

  // The chunk to run where none is asked for: the largest up to 32,768 whose buffers fit the device's free memory
  // (model/dsv4_chunk.h).
  int64_t default_chunk() const;

  struct Impl;

 private:
  struct PromptRun;  // one prompt's run, per phase (cuda_engine_dsv4.cpp)
  explicit Deepseek4CudaEngine(const Deepseek4Config& c);
  Deepseek4Config c_;
  std::unique_ptr<Impl> impl_;
  std::string note_;
  size_t weight_bytes_ = 0;
};

}  // namespace pdb
