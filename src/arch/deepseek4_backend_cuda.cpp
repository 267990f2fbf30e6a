// DeepSeek-V4 prefilled by the GPU engine (model/cuda_engine_dsv4.h) behind the shared DSV4 backend
// (arch/deepseek4_backend.h: the same wire frames and seals as the CPU engine's).
#include <stdexcept>

#include <fmt/format.h>

#include "arch/backends.h"
#include "cuda/device.h"
#include "model/cuda_engine_dsv4.h"
#include "arch/deepseek4_backend.h"
#include "recipes/deepseek4.h"

namespace pdb {

std::unique_ptr<PrefillBackend> make_cuda_dsv4_backend(const std::string& decoder_gguf, const std::string& weights) {
  if (cuda::device_count() == 0) throw std::runtime_error("--device cuda: " + cuda::device_summary());
  auto recipe = std::make_shared<const Deepseek4Recipe>(decoder_gguf);
  auto engine = std::make_shared<Deepseek4CudaEngine>(*recipe, dsv4_engine_weights(weights));
  Dsv4EngineRun run = [engine, recipe](const std::vector<int32_t>& tokens, int64_t chunk, GgmlType kt, const Deepseek4CpuEngine::ChunkHook& hook,
                                       const std::function<bool()>& stop) { return engine->prefill(tokens, chunk, kt, hook, stop); };
  // the chunk chosen once the weights are on the device: the largest whose buffers fit what they leave free
  return make_dsv4_backend(recipe, std::move(run), "cuda: " + cuda::device_summary(), engine->weights_note(), engine->default_chunk());
}

}  // namespace pdb
