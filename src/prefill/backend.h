// A prefill backend: an engine and a recipe that together turn a prompt into the decoder's cache rows, layer by
// layer, chunk by chunk (K/V rows, or a pooled cache's sections). The implementations are the architectures'
// (src/arch/backends.h, made from the architecture table); capture.cpp turns any backend's rows into wire frames.
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
  std::vector<SectionRows> sections = {};
  // Where the backend copied k and v into one buffer laid out as their frames (kHeaderBytes of room before k, and
  // before v right after k): hands that buffer over as the frames' bytes, so that the sink writes the headers and
  // copies nothing. It may return empty bytes (no buffer to spare just now); null where the rows lie otherwise.
  std::function<wire::Bytes()> take_frames = {};
  // The payloads' wire::payload_hash where the backend made them as the rows landed (a capture's last block, in
  // pieces hashed on threads of their own, so the frames after the engine's end wait for no hash): k's and v's as given.
  bool hashed = false;
  uint64_t k_hash = 0, v_hash = 0;
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
  // a state larger than this would not be cached: an engine that copies one skips it (0: no cache, nothing kept)
  size_t keep_max_bytes = SIZE_MAX;
  bool wants_state() const { return keep_max_bytes > 0; }
};

class PrefillBackend {
 public:
  virtual ~PrefillBackend() = default;
  virtual const HfConfig& config() const = 0;
  virtual const RecipeInfo& info() const = 0;  // the decoder's geometry (fingerprint, HELLO, the cache kind)
  virtual std::string device() const = 0;  // "cpu" or "cuda: <GPU>"
  virtual std::string weights() const { return ""; }  // how the engine holds its weights (e.g. FP8 products or bf16)
  // The chunk the engine runs best where neither the request nor the server names one (0: the server's default).
  virtual int64_t preferred_chunk() const { return 0; }
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

// --kv-dtype of `prefill` and `bench prefill`: bf16, or fp8 with --device cuda; throws std::invalid_argument.
inline void check_kv_dtype(const std::string& device, const std::string& kv_dtype) {
  if (kv_dtype != "bf16" && kv_dtype != "fp8") throw std::invalid_argument("--kv-dtype must be bf16 or fp8");
  if (kv_dtype == "fp8" && device != "cuda") throw std::invalid_argument("--kv-dtype fp8 is the CUDA engine's option (--device cuda)");
}

}  // namespace pdb
