#include "cache/decoder_cache.h"

namespace pdb {

LearnedCache learn_decoder_cache(std::vector<uint8_t> state, const CacheProbe& probe) {
  switch (probe.info.cache_kind) {
    case CacheKind::token_rows: return learn_token_rows(std::move(state), probe);
    case CacheKind::pooled_sections: return learn_pooled_sections(std::move(state), probe);
  }
  throw std::logic_error("unknown cache kind");
}

int64_t min_bridge_prompt(const RecipeInfo& info) { return info.cache_kind == CacheKind::pooled_sections ? 2 : 0; }

std::string calibration_refusal(const CalibrationResult& c, const std::string& decoder_gguf) {
  return "decoder calibration failed (" + c.note + "): the running llama-server does not compute what " + decoder_gguf +
         " says (RoPE or model override?)";
}

}  // namespace pdb
