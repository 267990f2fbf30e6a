// `pdbridge verify-state A B`: compares two llama.cpp sequence-state files tensor by tensor.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/state_file.h"

namespace pdb {

struct TensorDiff {
  std::string name;            // "layer 3 K"
  int64_t elements = 0, identical = 0;  // identical: same encoded value (same bits for float types)
  double max_abs = 0;
  int64_t max_ulp = 0;         // float types: distance in representable values; quantized: in int codes
  double pct_identical() const { return elements ? 100.0 * double(identical) / double(elements) : 100.0; }
};

struct StateDiff {
  bool same_layout = true, same_tokens = true;
  std::string layout_note;
  std::vector<TensorDiff> tensors;
  int64_t elements() const;
  int64_t identical() const;
  int64_t max_ulp() const;
  double max_abs() const;
  double pct_identical() const { return elements() ? 100.0 * double(identical()) / double(elements()) : 100.0; }
  nlohmann::json to_json() const;
};

// `first_layers` > 0 limits the comparison to layers [0, first_layers).
StateDiff diff_states(const ParsedState& a, const ParsedState& b, int first_layers = 0);

}  // namespace pdb
