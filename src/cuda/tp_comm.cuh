// The all-reduce of a tensor-parallel group: each rank's f32 buffer becomes the sum over the ranks, in
// place, ordered on the rank's stream. Two groups behind one interface:
//  - NCCL across devices (the CUDA toolkit's libnccl.so.2, loaded when a group is first made, so that a
//    one-GPU prefill server and CI need no NCCL; NVLink multicast is kept off: NCCL_NVLS_ENABLE=0);
//  - ranks sharing one device (their buffers summed by a kernel): the sharded forward runs, and is checked
//    against the unsharded one, on a machine of one GPU.
// Every rank calls all_reduce_sum the same number of times, from its own host thread; the result is the
// same on every rank (the shared-device group sums in rank order; NCCL's reduction is computed once per
// element and broadcast).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace pdb::cuda {

class TpComm {
 public:
  virtual ~TpComm() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual int device() const = 0;  // the CUDA device this rank runs on
  virtual void all_reduce_sum(float* buf, size_t n, cudaStream_t s) = 0;
  // Wakes every rank blocked in an all-reduce with an error (a rank that failed would leave them waiting);
  // the group is unusable afterwards.
  virtual void abort() = 0;
  virtual std::string describe() const = 0;
};

// One rank per device of `devices` (distinct devices). Throws with the reason (no libnccl.so.2, NCCL errors).
std::vector<std::unique_ptr<TpComm>> make_nccl_group(const std::vector<int>& devices);
// `world` ranks on `device`.
std::vector<std::unique_ptr<TpComm>> make_shared_device_group(int world, int device);

}  // namespace pdb::cuda
