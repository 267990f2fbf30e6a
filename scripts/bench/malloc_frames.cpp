// How fast one thread can hand large blocks to another through the C++ heap, the pattern of a capture's
// frames (made on the backend's delivery thread, freed on the sender's once written to the socket), with
// glibc's default settings and with the ones src/main.cpp sets. Build and run:
//   g++ -O2 -pthread scripts/bench/malloc_frames.cpp -o /tmp/malloc_frames
//   for mb in 16 34; do for m in 0 1 2; do /tmp/malloc_frames $mb $m; done; done
// mode 0: glibc defaults; 1: M_MMAP_THRESHOLD 256 MB + M_TRIM_THRESHOLD 512 MB; 2: those and M_ARENA_MAX 1.
#include <malloc.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 3) { std::fprintf(stderr, "usage: malloc_frames MB MODE\n"); return 2; }
  const int mode = std::atoi(argv[2]);
  if (mode >= 1) { mallopt(M_MMAP_THRESHOLD, 256 << 20); mallopt(M_TRIM_THRESHOLD, 512 << 20); }
  if (mode >= 2) mallopt(M_ARENA_MAX, 1);
  const size_t n = size_t(std::atoi(argv[1])) << 20;
  constexpr int kBlocks = 64;
  std::deque<std::vector<uint8_t>> q;
  std::mutex m;
  uint64_t sum = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread maker([&] {
    for (int i = 0; i < kBlocks; ++i) {
      std::vector<uint8_t> v(n, uint8_t(i));  // written, as a frame is
      std::lock_guard<std::mutex> l(m);
      q.push_back(std::move(v));
    }
  });
  for (int got = 0; got < kBlocks;) {
    std::vector<uint8_t> v;
    {
      std::lock_guard<std::mutex> l(m);
      if (q.empty()) continue;
      v = std::move(q.front());
      q.pop_front();
    }
    sum += v[n / 2];
    ++got;
  }  // each block is freed here, on this thread
  maker.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%zu MB blocks, mode %d: %.2f GB/s (checksum %llu)\n", n >> 20, mode, double(kBlocks) * double(n) / s / 1e9,
              (unsigned long long)sum);
  return 0;
}
