// The architecture table (architectures.cpp): what the prefill side knows of each architecture, as one entry.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "formats/gguf.h"
#include "model/product_numerics.h"
#include "prefill/backend.h"
#include "recipes/recipe.h"

namespace pdb {

// What a prefill backend is made of: the model the engine runs (an HF checkpoint, or a GGUF where the architecture's
// engine reads one), the decoder's GGUF (the recipe), the device and the engine's options.
struct BackendOptions {
  std::string model, recipe, device = "cpu", kv_dtype = "bf16";
  int threads = 1;
  int64_t chunk = 0;  // the CUDA engine's largest chunk (its buffers); 0: its own choice (CudaEngine::default_chunk)
  int tp = 1;
  bool tp_one_gpu = false;
  double max_gpu_mem_gib = 0;  // the CUDA engine's cap on the device's memory in use (0: none)
  bool faithful = true;  // CPU engine: the decoder's arithmetic (false: OpenBLAS, --cpu-fast)
  // CUDA: where the cache rows come from. "decoder": the recipe's products of the decoder's weights with its
  // arithmetic; "engine": the engine's own K/V products (the model must be the decoder's GGUF); "auto": the engine's
  // where they are the recipe's arithmetic (the GGUF itself, F16 q/k/v under half products), else the decoder's.
  std::string kv_rows = "auto";
  // CUDA, from the decoder's GGUF: how the engine's products round their operands (model/product_numerics.h); auto:
  // the mode measured closest to the decoders for the GGUF's weight types (half for F16/F32 weights, else bf16).
  std::string numerics = "auto";
};

struct Architecture {
  const char* name;        // general.architecture
  bool tensor_parallel;    // the CUDA engine splits it over GPUs (--tp)
  std::unique_ptr<PrefillBackend> (*make_backend)(const BackendOptions&);
  // Differences between the model the engine runs and the decoder's GGUF (empty: they agree).
  std::vector<std::string> (*config_mismatches)(const std::string& model, const GgufFile& decoder_gguf, const RecipeInfo& info);
};

// Throws std::invalid_argument naming the known ones.
const Architecture& architecture(const std::string& name);
// The products' rounding BackendOptions::numerics asks for ("auto" resolved for its model); throws
// std::invalid_argument where the mode cannot follow a decoder (not CUDA, not a GGUF, an unknown name).
ProductNumerics resolve_numerics(const BackendOptions& o);
// Whether the cache rows come from the engine's own K/V products (o.kv_rows: engine, decoder, or auto: where they are
// the recipe's arithmetic); throws std::invalid_argument where engine rows cannot be the decoder's.
bool kv_rows_from_engine(const BackendOptions& o, ProductNumerics numerics, const RecipeInfo& info);
std::string tensor_parallel_architectures();  // "llama, qwen3, qwen3moe"

}  // namespace pdb
