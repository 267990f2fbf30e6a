// The prefill server's prefix cache: the engine's own state (K/V) of recently served prompts, so that a
// conversation's next turn computes from the longest prefix it already has. Keyed by the token prefix: the
// prompt's blocks of kBlock tokens hashed as a chain (a block's hash covers every token before it, as the
// engines' automatic prefix caching does), plus a key naming what the state depends on besides the tokens
// (the decoder's cache spec the engine attended over). A hit is then extended token by token, so it is the
// exact longest common prefix, checked against the stored tokens (a hash collision cannot serve a wrong state).
// Bounded in bytes, least recently used out first; an entry whose tokens a newer entry extends is dropped at
// once (the newer one serves every lookup the older could).
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/engine_state.h"

namespace pdb {

struct PrefixCacheStats {
  uint64_t hits = 0, misses = 0, evictions = 0, superseded = 0, inserts = 0, refused = 0;
  uint64_t reused_tokens = 0;  // prefix tokens the hits spared the engine
  size_t bytes = 0, entries = 0, max_bytes = 0;
};

class PrefixCache {
 public:
  static constexpr int64_t kBlock = 64;
  explicit PrefixCache(size_t max_bytes) : max_bytes_(max_bytes) {}
  struct Hit {
    std::shared_ptr<const EngineState> state;  // null on a miss
    int64_t tokens = 0;                        // the engine resumes after these
  };
  // The longest cached prefix of `tokens`, at most `max_tokens` long, of a state stored under `key`. A prefix
  // shorter than one block is a miss.
  Hit lookup(const std::string& key, const std::vector<int32_t>& tokens, int64_t max_tokens);
  // Stores the state of `tokens` (state->tokens of them; the rest are cut). Returns false when it alone
  // exceeds the bound (refused) or the cache is off.
  bool insert(const std::string& key, std::vector<int32_t> tokens, std::shared_ptr<const EngineState> state);
  void clear();
  PrefixCacheStats stats() const;
  bool enabled() const { return max_bytes_ > 0; }

 private:
  struct Entry {
    uint64_t id = 0;
    std::string key;
    std::vector<int32_t> tokens;
    std::vector<uint64_t> block_hashes;  // chain hash of each whole block
    std::shared_ptr<const EngineState> state;
    size_t bytes = 0;
  };
  using Lru = std::list<Entry>;  // front: most recently used
  static std::vector<uint64_t> chain_hashes(const std::string& key, const std::vector<int32_t>& tokens, int64_t max_tokens);
  void erase(Lru::iterator it);
  mutable std::mutex m_;
  size_t max_bytes_, bytes_ = 0;
  uint64_t next_id_ = 0;
  Lru lru_;
  std::unordered_map<uint64_t, Lru::iterator> by_id_;
  std::unordered_multimap<uint64_t, uint64_t> index_;  // chain hash -> entry id
  PrefixCacheStats st_;
};

}  // namespace pdb
