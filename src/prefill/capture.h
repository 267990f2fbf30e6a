// A capture: the engine's forward with the recipe on its per-layer hook, turned into wire frames.
// Used by the prefill server (frames go to the HTTP stream) and in-process by tests and tools.
#pragma once
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "prefill/backend.h"
#include "prefill/prefix_cache.h"
#include "recipes/recipe.h"
#include "wire/protocol.h"

namespace pdb {

struct CaptureResult {
  std::string status;  // complete | partial | error
  int64_t tokens = 0;  // contiguous prefix [0, tokens) fully sent
  std::string reason;
  double engine_s = 0;
  int64_t tail_from = 0;      // rows sent for [tail_from, tokens) (the decoder held the rest)
  int64_t prefix_reused = 0;  // positions the engine resumed after, from the prefix cache
  int64_t computed = 0;       // positions the engine computed
};

// What the receiver of a frame says: keep going, seal the capture at the last complete chunk (memory
// limit reached: the prefix sent so far is still a valid cache), or stop (the receiver is gone).
enum class Emit { Ok, Seal, Gone };

// `emit` receives encoded frames (HELLO first, TRAILER last). `force` frames (the trailer) must be
// accepted whatever the memory limit says.
using EmitFn = std::function<Emit(wire::Bytes&& frame, bool force)>;
// `cache`: the prefill server's prefix cache (null: none): a tail capture (req.tail_from > 0) resumes from the
// longest prefix it holds (at most tail_from), and every resumable capture leaves its engine state there.
CaptureResult run_capture(PrefillBackend& backend, const wire::PrefillRequest& req, int64_t chunk, const EmitFn& emit,
                          PrefixCache* cache = nullptr);
}  // namespace pdb
