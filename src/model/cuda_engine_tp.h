// The CUDA engine over a tensor-parallel group: one CudaEngine per rank (its heads and FFN columns,
// model/tensor_parallel.h), each driven by a host thread of its own, the residual stream all-reduced after
// o_proj and down_proj (cuda/tp_comm.cuh). Rank 0 runs in the caller's thread on its own device and is the
// one whose residual the hook sees: the recipe computes every layer's cached rows there, after the
// all-reduce, so the capture stays one stream and the recipe code is the one-GPU code. World 1 is the plain
// engine (no group, no threads).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/cuda_engine.h"

namespace pdb {

namespace cuda { class TpComm; }

class CudaTpEngine {
 public:
  // world > 1: ranks on GPUs 0..world-1 over NCCL, or (shared_device) all on the current GPU: the sharded
  // forward checked on a machine of one GPU, not faster.
  CudaTpEngine(const std::string& hf_dir, int threads, bool kv_fp8 = false, int world = 1, bool shared_device = false,
               ProductNumerics numerics = ProductNumerics::bf16);
  ~CudaTpEngine();
  int world() const { return int(ranks_.size()); }
  CudaEngine& rank0() { return *ranks_[0]; }
  const HfConfig& config() const { return ranks_[0]->config(); }
  cuda::Gemm& gemm() { return ranks_[0]->gemm(); }
  cudaStream_t stream() const { return ranks_[0]->stream(); }
  std::string weights_note() const;
  bool kv_fp8() const { return ranks_[0]->kv_fp8(); }
  const std::optional<cuda::Fp8ScaleLayout>& fp8() const { return ranks_[0]->fp8(); }
  size_t bytes_for_prompt(int64_t tokens, int64_t chunk) const { return ranks_[0]->bytes_for_prompt(tokens, chunk); }
  // Every rank's GPU (a rank's share is the same size on each).
  void check_fits(int64_t tokens, int64_t chunk, size_t extra_bytes = 0) const;
  int64_t default_chunk() const { return ranks_[0]->default_chunk(); }
  void set_memory_cap(size_t bytes);  // every rank's (CudaEngine::set_memory_cap)
  bool resumable() const { return ranks_[0]->resumable(); }
  // As CudaEngine::prefill; the hook sees rank 0's residual (the whole one). A failure on any rank aborts the
  // group (no rank is left waiting in an all-reduce), is rethrown here, and the next call makes a new group.
  int64_t prefill(const std::vector<int32_t>& tokens, int64_t chunk, const CudaEngine::DeviceHook& hook,
                  const std::function<bool()>& cancelled = {}, bool full_last_layer = false, bool skip_attention = false,
                  ResumePoint resume = {}, std::shared_ptr<EngineState>* keep = nullptr, size_t keep_max_bytes = SIZE_MAX);

 private:
  void make_group();
  std::vector<int> devices_;
  bool shared_device_ = false;
  std::vector<std::unique_ptr<cuda::TpComm>> comms_;
  std::vector<std::unique_ptr<CudaEngine>> ranks_;
  bool broken_ = false;  // the last group was aborted
};

}  // namespace pdb
