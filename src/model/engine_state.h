// What a prefill engine needs to resume a forward after the first `tokens` positions of a prompt: its own
// attention state (K/V), in whatever form and memory the engine keeps it. The prefill server's prefix cache
// (prefill/prefix_cache.h) holds these for recently served prompts; each engine defines its own subclass.
#pragma once
#include <cstddef>
#include <cstdint>

namespace pdb {

struct EngineState {
  virtual ~EngineState() = default;
  virtual size_t bytes() const = 0;  // what the state occupies (host or device memory)
  int64_t tokens = 0;                // positions [0, tokens) are held
};

// Where a forward starts: after the first `tokens` positions of `state` (tokens <= state->tokens; 0: from scratch).
struct ResumePoint {
  const EngineState* state = nullptr;
  int64_t tokens = 0;
};

}  // namespace pdb
