// The decoder's RoPE cos/sin (numerics/rope_ggml.h ggml_rope_cache) of every position reached so far, in pinned host
// memory: computed once per process on the host (grown by doubling, by at most 256K positions past the need), and a
// chunk's rows copied to the device without the host waiting. Where an engine waits on the host at every layer (the
// MoE engines: the expert counts), a per-chunk computation and a pageable upload left the GPU idle 2.5-4 ms per chunk
// (docs/RESULTS.md, session 29). Used by the GPU recipe and the MLA attention.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "numerics/rope_ggml.h"

namespace pdb::cuda {

class RopeTable {
 public:
  RopeTable(GgmlRopeParams p, int threads) : p_(std::move(p)), threads_(threads) {}
  // cos/sin of positions pos0 .. pos0 + rows - 1 into dst [rows x n_dims] f32, queued on s
  void upload(int64_t pos0, int64_t rows, float* dst, cudaStream_t s);
  int64_t dims() const { return p_.n_dims; }

 private:
  GgmlRopeParams p_;
  int threads_;
  PinnedBuffer table_;  // [rows_ x n_dims]
  int64_t rows_ = 0;
};

}  // namespace pdb::cuda
