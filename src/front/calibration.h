// Calibration: the decoder's own cache for a probe prompt against what our recipe computes from the
// decoder's GGUF alone (layer 0, whose input is the token embedding in both engines, is bit-exact).
// A mismatch means the running decoder does not compute what its GGUF says — a RoPE override on its
// command line, another model loaded, a different build — and no bridged cache may be mounted.
#pragma once
#include <string>
#include <vector>

#include "formats/state_file.h"
#include "recipes/recipe.h"

namespace pdb {

struct CalibrationResult {
  double pct_identical = 0;  // layer 0 K and V elements
  int64_t elements = 0;
  std::string note;
};

// `decoder_state` is a state the decoder saved for exactly `tokens` (positions 0..n-1).
CalibrationResult calibrate_layer0(const std::string& decoder_gguf, const ParsedState& decoder_state,
                                   const std::vector<int32_t>& tokens, const CacheSpec& spec);

// Probe tokens: deterministic ids spread over the vocabulary, long enough (512) that slow RoPE
// frequencies turn measurably.
std::vector<int32_t> calibration_tokens(int64_t vocab_size, int n = 512);

}  // namespace pdb
