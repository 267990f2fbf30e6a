// Model shapes as data: the presets `make-model` builds, per architecture.
#pragma once
#include <string>
#include <vector>

#include "formats/hf_config.h"

namespace pdb {

// arch: llama | qwen3; preset: tiny | small | 8b. vocab_size is filled from the tokenizer later.
HfConfig preset_config(const std::string& arch, const std::string& preset);
std::vector<std::string> preset_names();

}  // namespace pdb
