// A prefill backend: an engine and a recipe that together turn a prompt into the decoder's K/V rows,
// layer by layer, chunk by chunk. CPU (model/cpu_engine + the CPU recipe) and CUDA
// (model/cuda_engine + recipes/recipe_gpu) implement it; capture.cpp turns its rows into wire frames.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "formats/hf_config.h"
#include "model/engine_state.h"
#include "recipes/recipe.h"
#include "wire/protocol.h"

namespace pdb {

class CpuEngine;

// Rows of one section of a pooled cache (DeepSeek-V4's window, pools, rings) in the decoder's bytes: `first`
// is the section's first row (a position, a block index, 0 for a ring).
struct SectionRows {
  wire::FrameKind kind = wire::FrameKind::Window;
  GgmlType type = GgmlType::F16;
  int64_t first = 0, rows = 0;
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

// One layer of one chunk (positions pos0 .. pos0+rows) in the decoder's cache format (pointers valid during
// the sink call): K/V rows for a per-token cache, `sections` for a pooled one (k and v then null).
struct KvBlock {
  int layer = 0;
  int64_t pos0 = 0, rows = 0;
  const uint8_t* k = nullptr;
  size_t k_bytes = 0;
  const uint8_t* v = nullptr;
  size_t v_bytes = 0;
  std::vector<SectionRows> sections;
  // A pooled cache's seal (after the sink refused a block): > 0, the prefix P of complete chunks these
  // sections (window rows before P, rings at P) make a valid state of with the pool rows already sent.
  int64_t seal_tokens = 0;
};
// Called in (chunk, layer) order; returns false to stop the capture (a pooled backend then offers its seal
// blocks, which the sink takes only when it stopped for a seal).
using KvSink = std::function<bool(const KvBlock&)>;

// A capture of a prompt whose first `send_from` tokens the decoder already holds (a conversation's next turn):
// the sink needs rows for [send_from, T) only, and a resumable engine starts after `resume` (a prefix state
// from the prefill server's cache, resume.tokens <= send_from) and leaves its state of the prompt in `kept`.
struct CaptureReuse {
  int64_t send_from = 0;
  std::shared_ptr<const EngineState> resume_state;
  int64_t resume_tokens = 0;
  std::shared_ptr<EngineState> kept;
  size_t keep_max_bytes = SIZE_MAX;  // a state larger than this would not be cached: an engine that copies one skips it
};

class PrefillBackend {
 public:
  virtual ~PrefillBackend() = default;
  virtual const HfConfig& config() const = 0;
  virtual const Recipe& recipe() const = 0;  // the K/V recipe (a pooled-cache backend has none: throws)
  virtual const RecipeInfo& info() const { return recipe().info(); }  // the decoder's geometry (fingerprint, HELLO)
  virtual std::string device() const = 0;  // "cpu" or "cuda: <GPU>"
  virtual std::string weights() const { return ""; }  // how the engine holds its weights (e.g. FP8 products or bf16)
  // Throws (with a message for the user) when a prompt of `tokens` cannot be served at all.
  virtual void check_fits(int64_t tokens, int64_t chunk) const {}
  // Runs the forward and the recipe; `stop` is polled between layers. Returns tokens processed.
  // `reuse` (null: every row from 0, nothing kept): see CaptureReuse. A backend that is not resumable ignores
  // its resume state and computes from 0; the sink may still get rows before send_from (capture.cpp drops them).
  virtual int64_t capture(const std::vector<int32_t>& tokens, int64_t chunk, const CacheSpec& spec, const KvSink& sink,
                          const std::function<bool()>& stop, CaptureReuse* reuse = nullptr) = 0;
  // Whether the engine resumes from a prefix state and keeps one (the prefill server's prefix cache); and the
  // key of what such a state depends on besides the tokens (the cache spec and numerics the engine attends with).
  virtual bool resumable() const { return false; }
  virtual std::string state_key(const CacheSpec& spec) const {
    return fmt::format("{}:{}:{}:{}:{}:{}", device(), int(spec.k_type), int(spec.v_type), spec.rot_k, spec.rot_v, spec.simd_width);
  }
  // The engine alone, no recipe (benchmarks measure the recipe's cost against it).
  // `full_last_layer`: also compute the last layer (what an engine producing logits does).
  // `skip_attention` (benchmarks only, GPU only: the layers' outputs are then not the model's): the
  // attention kernels left out, so that the difference from a normal run is the attention's own time.
  virtual int64_t forward_only(const std::vector<int32_t>& tokens, int64_t chunk, bool full_last_layer = false, bool skip_attention = false) = 0;
};

// Non-owning views work too (tests keep their engine and recipe on the stack).
// `faithful` (default): the engine's matmuls and attention follow the decoder's CPU arithmetic
// (bit-identical caches, slow); false: OpenBLAS GEMMs and attention (several times faster, caches
// equal up to rounding). The recipe itself is always faithful.
std::unique_ptr<PrefillBackend> make_cpu_backend(std::shared_ptr<CpuEngine> engine, std::shared_ptr<const Recipe> recipe,
                                                 bool faithful = true);
// Loads the HF checkpoint onto the GPU; `recipe` supplies the decoder's weights. kv_fp8: the engine's
// own K/V in fp8 (cuda_engine.h). tp: tensor parallel over GPUs 0..tp-1 (model/cuda_engine_tp.h), or with
// tp_shared_device every rank on the current GPU (the sharded forward checked on one GPU). Throws where CUDA
// is not built in or no GPU is present.
std::unique_ptr<PrefillBackend> make_cuda_backend(const std::string& hf_dir, std::shared_ptr<const Recipe> recipe, int threads,
                                                  int64_t max_chunk, bool kv_fp8 = false, int tp = 1, bool tp_shared_device = false);
bool cuda_backend_available();
// DeepSeek-V4 on the CPU (model/cpu_engine_dsv4 + recipes/deepseek4): the decoder GGUF gives the recipe's
// weights; the engine's come from `weights`: an HF checkpoint directory (DeepSeek's FP8 / FP4 layout or f32),
// or a GGUF.
std::unique_ptr<PrefillBackend> make_cpu_dsv4_backend(const std::string& decoder_gguf, const std::string& weights);
// The same with the GPU engine (model/cuda_engine_dsv4.h); throws where CUDA is not built in or no GPU is present.
std::unique_ptr<PrefillBackend> make_cuda_dsv4_backend(const std::string& decoder_gguf, const std::string& weights);
// --kv-dtype of `prefill` and `bench prefill`: bf16, or fp8 with --device cuda; throws std::invalid_argument.
inline void check_kv_dtype(const std::string& device, const std::string& kv_dtype) {
  if (kv_dtype != "bf16" && kv_dtype != "fp8") throw std::invalid_argument("--kv-dtype must be bf16 or fp8");
  if (kv_dtype == "fp8" && device != "cuda") throw std::invalid_argument("--kv-dtype fp8 is the CUDA engine's option (--device cuda)");
}

}  // namespace pdb
