// A capture: the engine's forward with the recipe on its per-layer hook, turned into wire frames.
// Used by the prefill server (frames go to the HTTP stream) and in-process by tests and tools.
#pragma once
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "model/cpu_engine.h"
#include "prefill/backend.h"
#include "recipes/recipe.h"
#include "wire/protocol.h"

namespace pdb {

struct CaptureResult {
  std::string status;  // complete | partial | error
  int64_t tokens = 0;  // contiguous prefix [0, tokens) fully sent
  std::string reason;
  double engine_s = 0;
};

// What the receiver of a frame says: keep going, seal the capture at the last complete chunk (memory
// limit reached: the prefix sent so far is still a valid cache), or stop (the receiver is gone).
enum class Emit { Ok, Seal, Gone };

// `emit` receives encoded frames (HELLO first, TRAILER last). `force` frames (the trailer) must be
// accepted whatever the memory limit says.
using EmitFn = std::function<Emit(std::vector<uint8_t>&& frame, bool force)>;
CaptureResult run_capture(PrefillBackend& backend, const wire::PrefillRequest& req, int64_t chunk, const EmitFn& emit);
CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk, const EmitFn& emit);

// Convenience for in-process use: every frame accepted.
CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk,
                          const std::function<bool(std::vector<uint8_t>&&)>& emit);

}  // namespace pdb
