#include "definitions/definition.h"

#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace pdb {

namespace {
const std::vector<const ModelDefinition*>& table() {
  static const std::vector<const ModelDefinition*> t = {&llama_definition(), &qwen3_definition(), &qwen3moe_definition(),
                                                        &deepseek2_definition()};
  return t;
}
}  // namespace

std::vector<std::string> defined_architectures() {
  std::vector<std::string> out;
  for (const auto* d : table()) out.push_back(d->name);
  return out;
}

const ModelDefinition& model_definition(const std::string& arch) {
  for (const auto* d : table())
    if (d->name == arch) return *d;
  throw std::invalid_argument(fmt::format("no engine definition for architecture '{}' (defined: {})", arch, fmt::join(defined_architectures(), ", ")));
}

}  // namespace pdb
