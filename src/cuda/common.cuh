// What every CUDA file of the engine shares: error checks that throw (the prefill server turns a
// throw into a truthful `declined`), and an owning device buffer. Host code includes this too.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pdb::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line);

#define PDB_CUDA_CHECK(expr)                                                           \
  do {                                                                                 \
    cudaError_t pdb_err_ = (expr);                                                     \
    if (pdb_err_ != cudaSuccess) ::pdb::cuda::throw_cuda_error(pdb_err_, #expr, __FILE__, __LINE__); \
  } while (0)
// After every launch: a bad launch configuration surfaces here, not three kernels later.
#define PDB_CUDA_LAUNCHED() PDB_CUDA_CHECK(cudaGetLastError())

// Owning, move-only device allocation (plain cudaMalloc: never managed memory on the lent GPUs).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { resize(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) { release(); p_ = std::exchange(o.p_, nullptr); n_ = std::exchange(o.n_, 0); }
    return *this;
  }
  // Grows (never shrinks); contents are not kept.
  void resize(size_t bytes);
  void upload(const void* src, size_t bytes, size_t offset = 0);
  void download(void* dst, size_t bytes, size_t offset = 0) const;
  template <class T> T* as() { return static_cast<T*>(p_); }
  template <class T> const T* as() const { return static_cast<const T*>(p_); }
  void* get() { return p_; }
  const void* get() const { return p_; }
  size_t bytes() const { return n_; }
  void release();

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Page-locked host memory: what an async device-to-host copy needs to really overlap.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes) { resize(bytes); }
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      PinnedBuffer old(std::move(*this));
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  void resize(size_t bytes);
  template <class T> T* as() { return static_cast<T*>(p_); }
  size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

struct DeviceMemory {
  size_t free = 0, total = 0;
};
DeviceMemory device_memory();

// Diagnostics (PDBRIDGE_CAPTURE_STATS): spans of a stream's device time between two timing events, summed when asked
// (waiting for the last span's end).
class EventSpans {
 public:
  EventSpans() = default;
  EventSpans(const EventSpans&) = delete;
  EventSpans& operator=(const EventSpans&) = delete;
  ~EventSpans();
  void begin(cudaStream_t s);
  void end(cudaStream_t s);
  size_t count() const { return spans_.size(); }
  double take_ms();  // the spans' total; they are released

 private:
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> spans_;
};

}  // namespace pdb::cuda
