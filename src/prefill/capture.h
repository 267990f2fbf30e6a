// A capture: the engine's forward with the recipe on its per-layer hook, turned into wire frames.
// Used by the prefill server (frames go to the HTTP stream) and in-process by tests and tools.
#pragma once
#include <atomic>
#include <functional>
#include <string>
#include <vector>

#include "model/cpu_engine.h"
#include "recipes/recipe.h"
#include "wire/protocol.h"

namespace pdb {

struct CaptureResult {
  std::string status;  // complete | partial | error
  int64_t tokens = 0;  // contiguous prefix [0, tokens) fully sent
  std::string reason;
  double engine_s = 0;
};

// `emit` receives encoded frames (HELLO first, TRAILER last) and returns false to abort.
CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk,
                          const std::function<bool(std::vector<uint8_t>&&)>& emit);

}  // namespace pdb
