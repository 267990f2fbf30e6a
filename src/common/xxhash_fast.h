// xxHash for the large buffers (the frames' payloads, the recipe's weights): libxxhash's x86 dispatching entry
// points where the installed library has them (CMake's PDBRIDGE_XXH_DISPATCH), which pick AVX2 or AVX-512 at run
// time. Debian builds the plain XXH3 functions for SSE2; the dispatching ones give the same hashes, 1.5x faster over
// an 8 MB payload on an AVX-512 EPYC (16.8 -> 26.2 GB/s, docs/RESULTS.md, session 45). Include this instead of
// <xxhash.h>: XXH3_64bits and XXH3_64bits_update then name the dispatching functions.
#pragma once
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>
#if defined(PDBRIDGE_XXH_DISPATCH)
#include <xxh_x86dispatch.h>
#endif
