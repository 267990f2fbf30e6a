#include "prefill/prefix_cache.h"

#include <algorithm>

#include <xxhash.h>

namespace pdb {

std::vector<uint64_t> PrefixCache::chain_hashes(const std::string& key, const std::vector<int32_t>& tokens, int64_t max_tokens) {
  const int64_t n = std::min<int64_t>(int64_t(tokens.size()), max_tokens) / kBlock;
  std::vector<uint64_t> out(size_t(std::max<int64_t>(n, 0)));
  uint64_t h = XXH3_64bits(key.data(), key.size());
  for (int64_t b = 0; b < n; ++b) {
    h = XXH3_64bits_withSeed(tokens.data() + b * kBlock, size_t(kBlock) * sizeof(int32_t), h);
    out[size_t(b)] = h;
  }
  return out;
}

PrefixCache::Hit PrefixCache::lookup(const std::string& key, const std::vector<int32_t>& tokens, int64_t max_tokens) {
  std::lock_guard<std::mutex> l(m_);
  Hit hit;
  if (!enabled()) return hit;
  const auto hashes = chain_hashes(key, tokens, max_tokens);
  const int64_t limit = std::min<int64_t>(int64_t(tokens.size()), max_tokens);
  Lru::iterator best = lru_.end();
  int64_t best_len = 0;
  // The deepest block any entry shares gives the longest prefix; among the entries sharing it, the one that
  // extends furthest past it.
  for (int64_t b = int64_t(hashes.size()) - 1; b >= 0 && best == lru_.end(); --b) {
    auto [lo, hi] = index_.equal_range(hashes[size_t(b)]);
    for (auto it = lo; it != hi; ++it) {
      auto e = by_id_.find(it->second);
      if (e == by_id_.end()) continue;
      const Entry& en = *e->second;
      if (en.key != key) continue;
      const int64_t n = std::min<int64_t>({limit, int64_t(en.tokens.size()), en.state->tokens});
      int64_t p = 0;
      while (p < n && en.tokens[size_t(p)] == tokens[size_t(p)]) ++p;
      if (p < (b + 1) * kBlock) continue;  // a colliding hash: the tokens differ inside the hashed blocks
      if (p > best_len) { best = e->second; best_len = p; }
    }
  }
  if (best == lru_.end()) {
    ++st_.misses;
    return hit;
  }
  lru_.splice(lru_.begin(), lru_, best);  // most recently used
  ++st_.hits;
  st_.reused_tokens += uint64_t(best_len);
  hit.state = best->state;
  hit.tokens = best_len;
  return hit;
}

void PrefixCache::erase(Lru::iterator it) {
  for (uint64_t h : it->block_hashes) {
    auto [lo, hi] = index_.equal_range(h);
    for (auto i = lo; i != hi; ++i)
      if (i->second == it->id) { index_.erase(i); break; }
  }
  bytes_ -= it->bytes;
  by_id_.erase(it->id);
  lru_.erase(it);
}

bool PrefixCache::insert(const std::string& key, std::vector<int32_t> tokens, std::shared_ptr<const EngineState> state) {
  if (!state || state->tokens <= 0) return false;
  tokens.resize(size_t(std::min<int64_t>(int64_t(tokens.size()), state->tokens)));
  std::lock_guard<std::mutex> l(m_);
  if (!enabled()) return false;
  const size_t bytes = state->bytes() + tokens.size() * sizeof(int32_t);
  if (bytes > max_bytes_) {
    ++st_.refused;
    return false;
  }
  // Entries this one extends (the same key, their tokens a prefix of these) serve nothing it does not.
  for (auto it = lru_.begin(); it != lru_.end();) {
    auto next = std::next(it);
    if (it->key == key && it->tokens.size() <= tokens.size() && std::equal(it->tokens.begin(), it->tokens.end(), tokens.begin())) {
      erase(it);
      ++st_.superseded;
    }
    it = next;
  }
  while (!lru_.empty() && bytes_ + bytes > max_bytes_) {
    erase(std::prev(lru_.end()));
    ++st_.evictions;
  }
  Entry e;
  e.id = ++next_id_;
  e.key = key;
  e.block_hashes = chain_hashes(key, tokens, int64_t(tokens.size()));
  e.tokens = std::move(tokens);
  e.state = std::move(state);
  e.bytes = bytes;
  lru_.push_front(std::move(e));
  by_id_[lru_.front().id] = lru_.begin();
  for (uint64_t h : lru_.front().block_hashes) index_.emplace(h, lru_.front().id);
  bytes_ += bytes;
  ++st_.inserts;
  return true;
}

void PrefixCache::clear() {
  std::lock_guard<std::mutex> l(m_);
  lru_.clear();
  by_id_.clear();
  index_.clear();
  bytes_ = 0;
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard<std::mutex> l(m_);
  PrefixCacheStats s = st_;
  s.bytes = bytes_;
  s.entries = lru_.size();
  s.max_bytes = max_bytes_;
  return s;
}

}  // namespace pdb
