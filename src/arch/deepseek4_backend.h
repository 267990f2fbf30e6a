// DeepSeek-V4's prefill backend, shared by the CPU and the GPU engine (backend_dsv4.cpp, backend_cuda_dsv4.cpp):
// whichever engine runs the chunks hands each layer's sections to the same wire and seal logic.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/cpu_engine_dsv4.h"
#include "prefill/backend.h"

namespace pdb {

class Deepseek4Recipe;

// An engine's chunked prefill (Deepseek4CpuEngine::prefill's contract; the hook's x may be null).
using Dsv4EngineRun = std::function<int64_t(const std::vector<int32_t>& tokens, int64_t chunk, GgmlType k_type,
                                            const Deepseek4CpuEngine::ChunkHook& hook, const std::function<bool()>& stop)>;
// preferred_chunk: PrefillBackend::preferred_chunk (0: the server's default).
std::unique_ptr<PrefillBackend> make_dsv4_backend(std::shared_ptr<const Deepseek4Recipe> recipe, Dsv4EngineRun run, const std::string& device,
                                                  const std::string& weights_note, int64_t preferred_chunk = 0);
// The engine's weights: an HF checkpoint directory (DeepSeek's FP8 / FP4 layout or f32), or a GGUF.
Deepseek4Weights dsv4_engine_weights(const std::string& weights);

}  // namespace pdb
