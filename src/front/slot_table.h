// The decoder's slots as the front door owns them: which one a request takes, and what each one holds.
#pragma once
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace pdb {

// What the front knows each decoder slot holds (a lower bound: the last prompt it processed there).
struct SlotTable {
  struct Slot { bool busy = false; std::vector<int32_t> tokens; uint64_t last_used = 0; };
  std::mutex m;
  std::condition_variable cv;
  std::vector<Slot> slots;
  uint64_t tick = 0;

  static size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
    size_t n = std::min(a.size(), b.size()), i = 0;
    while (i < n && a[i] == b[i]) ++i;
    return i;
  }
  // Takes the idle slot sharing the longest prefix with `tokens` (else the least recently used).
  int acquire(const std::vector<int32_t>& tokens, size_t* cached) {
    std::unique_lock<std::mutex> l(m);
    for (;;) {
      int best = -1;
      size_t best_prefix = 0;
      uint64_t best_age = UINT64_MAX;
      for (size_t s = 0; s < slots.size(); ++s) {
        if (slots[s].busy) continue;
        const size_t p = common_prefix(slots[s].tokens, tokens);
        if (best < 0 || p > best_prefix || (p == best_prefix && slots[s].last_used < best_age)) {
          best = int(s); best_prefix = p; best_age = slots[s].last_used;
        }
      }
      if (best >= 0) {
        slots[size_t(best)].busy = true;
        *cached = best_prefix;
        return best;
      }
      cv.wait(l);
    }
  }
  void release(int s, std::optional<std::vector<int32_t>> holds) {
    std::lock_guard<std::mutex> l(m);
    auto& sl = slots[size_t(s)];
    sl.busy = false;
    sl.last_used = ++tick;
    if (holds) sl.tokens = std::move(*holds);
    cv.notify_all();
  }
};

}  // namespace pdb
