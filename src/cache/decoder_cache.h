// A cache kind, as the front door meets it: learned from a state the running decoder saved (its layout probe),
// checked against the decoder's GGUF (calibration), and the maker of the bridged file (the assembler). The front
// door calls this interface only; each kind is one implementation:
//   token_rows.cpp      — one K row (and V row) per token and layer: llama.cpp's KV cache (MLA: K only)
//   pooled_sections.cpp — DeepSeek-V4's window, compressed pools and rings (llama.cpp's deepseek4 memory)
// Which kind a decoder has is the GGUF's geometry's (RecipeInfo::cache_kind), set where the recipe reads it.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/assembler.h"
#include "cache/calibration.h"
#include "formats/state_file.h"
#include "recipes/recipe.h"

namespace pdb {

// What learning a decoder's cache needs besides the state it saved.
struct CacheProbe {
  std::string decoder_gguf;
  RecipeInfo info;
  std::vector<int32_t> tokens;  // the prompt the probe state is of
  bool calibrate = true;        // layer 0 of the probe against the recipe's (cache/calibration.h)
  CalibrationOptions calibration;
  std::string attn_rot = "auto";  // the decoder's Hadamard rotation of quantized caches: auto | on | off
};

class DecoderCache {
 public:
  virtual ~DecoderCache() = default;
  virtual std::string describe() const = 0;  // /health's `layout`
  // The prefill request's cache spec; `simd_width` is the decoder's as the front door knows it (a kind whose rows
  // do not follow the decoder's SIMD order ignores it).
  virtual CacheSpec spec(int simd_width) const = 0;
  // The tokens of a T-token prompt the bridged file holds: the decoder computes the rest itself.
  virtual int64_t file_tokens(int64_t prompt_tokens) const = 0;
  // Whether an earlier turn's state (a kept file, the slot's own) can give a capture its first tokens.
  virtual bool carries_turns() const = 0;
  // The first tokens of `tokens` that `held` (a state of this decoder) can give a tail capture (0: none).
  virtual int64_t usable_prefix(const ParsedState& held, const std::vector<int32_t>& tokens) const = 0;
  // The assembler of a capture of `tokens` (the decoder holds the first `tail_from`) into the file at `path`.
  virtual std::unique_ptr<StateAssembler> assembler(const std::string& path, const std::vector<int32_t>& tokens,
                                                    const std::string& fingerprint, int64_t tail_from) const = 0;
};

struct LearnedCache {
  std::shared_ptr<const DecoderCache> cache;
  int streams = 0;             // the decoder's cache streams (its KV unified or per slot)
  uint32_t state_version = 0;  // the version its state files are written in
  std::optional<CalibrationResult> fidelity;  // when calibrated
  std::string refusal;  // non-empty: nothing may be mounted on this decoder, and why (every bridge declines with it)
};

// Learns the decoder's cache from `state`, a state it saved for probe.tokens. Throws when the state does not fit
// the GGUF (another layer count or row width: not sticky, the next request probes again).
LearnedCache learn_decoder_cache(std::vector<uint8_t> state, const CacheProbe& probe);
// The shortest prompt a bridge can be made of (a pooled cache's file holds T-1 tokens: at least 2).
int64_t min_bridge_prompt(const RecipeInfo& info);

// The kinds (token_rows.cpp, pooled_sections.cpp).
LearnedCache learn_token_rows(std::vector<uint8_t> state, const CacheProbe& probe);
LearnedCache learn_pooled_sections(std::vector<uint8_t> state, const CacheProbe& probe);
// The refusal of a decoder whose layer 0 is not what its GGUF says.
std::string calibration_refusal(const CalibrationResult& c, const std::string& decoder_gguf);

}  // namespace pdb
