// `pdbridge make-model`: one deterministic random master copy of a model's weights, written as the
// HF checkpoint the prefill engine loads and as the decoder's GGUFs (quantized ones by llama-quantize).
#pragma once
#include <string>
#include <vector>

namespace pdb {

struct MakeModelOptions {
  std::string arch = "llama", preset = "tiny", out;
  uint64_t seed = 1;
  std::string hf_dtype = "f32";                   // f32 | f16 | bf16 | fp8
  std::vector<std::string> gguf_types = {"f32"};  // f32 f16 bf16 q8_0 q4_0 (others: any llama-quantize type)
  std::string vocab_dir;                          // llama.cpp models/ (default: next to the executable)
  std::string llama_bin;                          // llama-quantize's directory
  int threads = 0;
};

void make_model(const MakeModelOptions& o);

// The master weight value of element i of tensor `name` (also used by tests to check files).
float master_weight(uint64_t seed, const std::string& name, int64_t i, int64_t n_layers);

}  // namespace pdb
