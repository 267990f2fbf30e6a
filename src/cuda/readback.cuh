// Small device results the host must see before it can go on (the MoE block's expert counts, which cuBLAS takes on
// the host): written by a kernel straight into mapped pinned host memory, then one event waited on. A D2H copy
// (cudaMemcpyAsync) would wait behind any copy already on the GPU's device-to-host copy engine, such as a layer's
// cache rows leaving on another stream; a kernel's stores over PCIe do not. PDBRIDGE_READBACK=copy: the copy (A/B).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace pdb::cuda {

class Readback {
 public:
  Readback();
  ~Readback();
  Readback(const Readback&) = delete;
  Readback& operator=(const Readback&) = delete;
  // The n values at src once the work queued on s before this call is done (the host waits); valid until the next call.
  const int32_t* fetch(const int32_t* src, int64_t n, cudaStream_t s);

 private:
  // PDBRIDGE_CAPTURE_STATS=1 (device.h readback_totals): per fetch, timing events at the result's arrival and where
  // the host queued work again; a pair is read at the next fetch, when both have passed.
  struct Gap {
    cudaEvent_t arrived = nullptr, resumed = nullptr;
    bool pending = false;
  };
  void record_gap(cudaStream_t s, double host_wait_ms);

  PinnedBuffer host_;
  int32_t* mapped_ = nullptr;  // host_ as the device addresses it
  cudaEvent_t done_ = nullptr;
  bool copy_ = false, stats_ = false;
  Gap gaps_[2];
  int gap_ = 0;
};

}  // namespace pdb::cuda
