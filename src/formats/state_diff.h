// Two llama.cpp sequence-state files compared tensor by tensor: the fidelity guard's layer-0 numbers, `pdbridge verify-state`, the parity tests.
#pragma once
#include <cmath>
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
  int64_t within_ulp[3] = {};  // elements at most 1, 2, 4 ulp (codes) apart
  double sum_sq_diff = 0, sum_sq_ref = 0;  // sums over elements of (a-b)^2 and a^2 (a: the first state)
  double pct_identical() const { return elements ? 100.0 * double(identical) / double(elements) : 100.0; }
  double pct_within(int i) const { return elements ? 100.0 * double(within_ulp[i]) / double(elements) : 100.0; }
  // The error's RMS relative to the first state's RMS: ~1e-4 for a different summation order in f16,
  // of the order of 1 for another model or RoPE.
  double rel_rms() const { return sum_sq_ref > 0 ? std::sqrt(sum_sq_diff / sum_sq_ref) : (sum_sq_diff > 0 ? INFINITY : 0.0); }
  // The largest single error in units of the first state's RMS.
  double max_rel() const {
    const double rms = elements ? std::sqrt(sum_sq_ref / double(elements)) : 0.0;
    return rms > 0 ? max_abs / rms : (max_abs > 0 ? INFINITY : 0.0);
  }
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

// Accumulates the element-wise differences of `n_rows` rows of type `t` (a: the reference) into `d`.
void compare_rows(GgmlType t, const uint8_t* a, const uint8_t* b, int64_t n_rows, int64_t row_elems, TensorDiff& d);

// `first_layers` > 0 limits the comparison to layers [0, first_layers).
StateDiff diff_states(const ParsedState& a, const ParsedState& b, int first_layers = 0);

}  // namespace pdb
