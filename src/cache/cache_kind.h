// What the prefill side needs to know of a cache kind (the front door's side is cache/decoder_cache.h), as data.
#pragma once
#include <string>

#include "recipes/recipe.h"

namespace pdb {

struct CacheKindTraits {
  const char* wire_name;  // HELLO's `cache` (docs/WIRE.md)
  // One K (and V) row per token: a capture may start at a tail (the decoder holds the rest), the HELLO states the
  // row sizes. Otherwise the cache is captured whole, as sections (the HELLO states the window).
  bool per_token_rows;
};

inline const CacheKindTraits& cache_kind_traits(CacheKind k) {
  static const CacheKindTraits token_rows{"kv", true}, pooled_sections{"dsv4", false};
  return k == CacheKind::pooled_sections ? pooled_sections : token_rows;
}

}  // namespace pdb
