#include "front/state_store.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include <spdlog/spdlog.h>

namespace pdb {
namespace fs = std::filesystem;

BackgroundRemover::BackgroundRemover() : worker_([this] { run(); }) {}

BackgroundRemover::~BackgroundRemover() {
  {
    std::lock_guard<std::mutex> l(m_);
    stop_ = true;
  }
  cv_.notify_one();
  worker_.join();
}

void BackgroundRemover::remove(std::string path) {
  if (path.empty()) return;
  {
    std::lock_guard<std::mutex> l(m_);
    queue_.push_back(std::move(path));
  }
  cv_.notify_one();
}

void BackgroundRemover::run() {
  std::unique_lock<std::mutex> l(m_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    const std::string p = std::move(queue_.front());
    queue_.pop_front();
    l.unlock();
    std::error_code ec;
    fs::remove(p, ec);
    if (ec) spdlog::warn("front: could not remove {}: {}", p, ec.message());
    l.lock();
  }
}

KeptStates::File::~File() {
  if (remover) remover->remove(path);
}

std::shared_ptr<const KeptStates::File> KeptStates::best(const std::vector<int32_t>& prompt, int64_t* common) {
  *common = 0;
  std::lock_guard<std::mutex> l(m_);
  auto best = lru_.end();
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    const auto& t = (*it)->tokens;
    const size_t n = std::min(t.size(), prompt.size());
    const int64_t p = int64_t(std::mismatch(t.begin(), t.begin() + std::ptrdiff_t(n), prompt.begin()).first - t.begin());
    if (p > *common) { *common = p; best = it; }
  }
  if (best == lru_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, best);
  return lru_.front();
}

void KeptStates::keep(std::string path, std::vector<int32_t> tokens, uint64_t bytes) {
  auto f = std::make_shared<File>();
  f->path = std::move(path);
  f->tokens = std::move(tokens);
  f->bytes = bytes;
  f->remover = &remover_;
  std::lock_guard<std::mutex> l(m_);
  if (bytes > max_bytes_) {
    ++st_.refused;
    return;  // f goes now: removed
  }
  for (auto it = lru_.begin(); it != lru_.end();) {
    const auto& t = (*it)->tokens;
    if (t.size() <= f->tokens.size() && std::equal(t.begin(), t.end(), f->tokens.begin())) {
      bytes_ -= (*it)->bytes;
      ++st_.superseded;
      it = lru_.erase(it);
    } else {
      ++it;
    }
  }
  evict_past(max_bytes_ - bytes);
  bytes_ += bytes;
  ++st_.kept;
  lru_.push_front(std::move(f));
}

void KeptStates::evict_past(uint64_t bound) {
  while (bytes_ > bound && !lru_.empty()) {
    bytes_ -= lru_.back()->bytes;
    ++st_.evictions;
    lru_.pop_back();
  }
}

void KeptStates::drop(const std::string& path) {
  std::lock_guard<std::mutex> l(m_);
  for (auto it = lru_.begin(); it != lru_.end(); ++it)
    if ((*it)->path == path) {
      bytes_ -= (*it)->bytes;
      lru_.erase(it);
      return;
    }
}

void KeptStates::clear() {
  std::lock_guard<std::mutex> l(m_);
  lru_.clear();
  bytes_ = 0;
}

KeptStatesStats KeptStates::stats() const {
  std::lock_guard<std::mutex> l(m_);
  KeptStatesStats s = st_;
  s.bytes = bytes_;
  s.files = lru_.size();
  s.max_bytes = max_bytes_;
  return s;
}

}  // namespace pdb
