// Recipe for llama.cpp's `qwen3moe` architecture (Qwen3-30B-A3B; src/models/qwen3moe.cpp in the decoder).
// Its attention and KV cache are qwen3's, unchanged (q_norm/k_norm, NEOX RoPE, one K and one V row per
// token per layer); only the FFN is a mixture of experts, which never reaches the cache directly. So the
// cached rows are computed by the qwen3 recipe (recipes/qwen3.cpp). The architecture name still
// enters the fingerprint: a qwen3 GGUF and a qwen3moe GGUF never share a bridge.
#include <memory>
#include <string>

#include "recipes/recipe.h"

namespace pdb {

std::unique_ptr<Recipe> make_qwen3_family_recipe(const GgufFile& g, int threads, int max_layers, const std::string& arch);

std::unique_ptr<Recipe> make_qwen3moe_recipe(const GgufFile& g, int threads, int max_layers) {
  return make_qwen3_family_recipe(g, threads, max_layers, "qwen3moe");
}

}  // namespace pdb
