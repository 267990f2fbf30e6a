// A minimal fork-join over index ranges. Work items are coarse (rows, tensors), so one
// std::thread per worker per call is cheap next to the work and keeps the code obvious.
#pragma once
#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace pdb {

inline int default_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

// Calls fn(begin, end) on disjoint chunks of [0, n) from up to `threads` workers; rethrows the first error.
template <class Fn>
void parallel_for(int64_t n, int threads, Fn&& fn) {
  threads = int(std::clamp<int64_t>(threads, 1, std::max<int64_t>(1, n)));
  if (threads == 1) { if (n > 0) fn(int64_t(0), n); return; }
  std::vector<std::thread> ws;
  std::exception_ptr err;
  std::mutex m;
  const int64_t step = (n + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int64_t b = t * step, e = std::min(n, b + step);
    if (b >= e) break;
    ws.emplace_back([&, b, e] {
      try { fn(b, e); } catch (...) { std::lock_guard<std::mutex> l(m); if (!err) err = std::current_exception(); }
    });
  }
  for (auto& w : ws) w.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace pdb
