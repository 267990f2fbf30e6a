// Calibration: the decoder's own cache for a probe prompt against what our recipe computes from the
// decoder's GGUF alone. Layer 0's input is the token embedding in both engines, so any difference
// there is the decoder's arithmetic: a summation order other than the recipe's (another SIMD ISA, a
// GPU or BLAS backend) gives errors of a few ulp, a different geometry (a RoPE override on its
// command line, another model loaded, another cache layout) errors of the order of the values. The
// guard tells them apart by measured fidelity, not by bit identity, and classes the decoder:
//   mirrored  — layer 0 bit-identical (every element): a CPU decoder whose arithmetic the recipe
//               mirrors (its ISA is the SIMD width at which it is identical);
//   tolerance — within the summation-order bounds of its cache type (FidelityBounds, measured);
//   mismatch  — outside them: nothing is ever mounted on that decoder.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/state_file.h"
#include "formats/state_file_dsv4.h"
#include "recipes/recipe.h"
#include "formats/state_diff.h"

namespace pdb {

enum class FidelityClass { mirrored, tolerance, mismatch };
const char* to_string(FidelityClass c);

// The largest layer-0 error (K and V each) a decoder that differs from the recipe only in summation
// order may show, per cache type. Measured (docs/RESULTS.md, "Fidelity guard"): summation order at most
// 2.4e-3 (f16, CUDA decoder, 8B shape), 1.3e-3 (q8_0), 4.6e-3 (q4_0); geometry mismatches at least
// 0.29 (f16, YaRN factor 2), 0.30 (q8_0), 0.31 (q4_0). The bounds sit 8-23x above the first and 6-14x
// below the second.
struct FidelityBounds {
  double max_rel_rms;  // RMS of the error / RMS of the decoder's values
};
FidelityBounds fidelity_bounds(GgmlType cache_type);

// The SIMD ISA of a CPU decoder, by the float width of its vectors (8 AVX2, 16 AVX-512, 4 NEON).
std::string isa_name(int simd_width);

struct CalibrationResult {
  FidelityClass cls = FidelityClass::mismatch;
  int simd_width = 0;       // the width the recipe's and the engine's CPU arithmetic should mirror
  std::string isa;          // "avx2", "avx512", "neon" for a mirrored decoder; else "not mirrored"
  std::string isa_source;   // how the width was chosen
  TensorDiff k, v;          // layer 0
  double pct_identical = 0;  // layer 0 K and V together
  int64_t elements = 0;
  std::string note;         // one line with the numbers
  nlohmann::json to_json() const;
};

struct CalibrationOptions {
  // Widths to try; the first one at which layer 0 is bit-identical wins. Empty: 8, 16, 4 with this
  // host's first. A width given by the operator (--decoder-simd) is the only candidate.
  std::vector<int> widths;
  bool width_from_operator = false;
};

// `decoder_state` is a state the decoder saved for exactly `tokens` (positions 0..n-1).
CalibrationResult calibrate_layer0(const std::string& decoder_gguf, const ParsedState& decoder_state,
                                   const std::vector<int32_t>& tokens, const CacheSpec& spec, const CalibrationOptions& opt = {});

// DeepSeek-V4 (a pooled state, formats/state_file_dsv4.h): layer 0's sections of the decoder's state for `tokens`
// against the deepseek4 recipe's from the decoder's GGUF. `k` sums the cache rows (window, CSA / HCA, LID), `v`
// the f32 compressor rings. The recipe does not mirror the decoder's SIMD arithmetic: identical or tolerance.
CalibrationResult calibrate_dsv4_layer0(const std::string& decoder_gguf, const Dsv4State& decoder_state, const std::vector<int32_t>& tokens);

// Probe tokens: deterministic ids spread over the vocabulary, long enough (512) that slow RoPE
// frequencies turn measurably.
std::vector<int32_t> calibration_tokens(int64_t vocab_size, int n = 512);

}  // namespace pdb
