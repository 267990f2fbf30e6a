// What the CUDA backend can see. Safe to call in builds without CUDA (answers "no device").
#pragma once
#include <cstdint>
#include <string>

namespace pdb::cuda {

int device_count();           // 0 without CUDA or without a GPU
std::string device_summary();  // "NVIDIA H200 (sm_90, 139.8 GiB)" or why there is none
bool compiled_with_cuda();
// The current device is sm_90 (Hopper): the sm_90a kernels (wgmma) run there only. false without CUDA.
bool device_is_sm90();
// The current device's SM count (persistent kernels' grids, tiles per SM); 0 without a device.
int multiprocessor_count();
// Median rate of an n x n x n bf16 GEMM (f32 accumulation) through cuBLASLt on random data, after
// warm-up: the ceiling benchmarks report against. 0 without CUDA.
double measure_bf16_gemm_tflops(int64_t n = 8192);
// Bytes allocated on the current device now (every process's; total - free). 0 without CUDA.
size_t device_bytes_in_use();
// Which causal attention the engines run: "cudnn 91900" (cuDNN's, the default where it loads), "ours (PDBRIDGE_ATTN=ours)",
// or "ours (cuDNN: why not)". "none" without CUDA.
std::string attention_kernel_summary();
// cuDNN attention plans built by this process so far (each a host-side pause of 35-580 ms on the H200); 0 without them.
int64_t attention_plans_built();
// PDBRIDGE_CAPTURE_STATS=1: the host's synchronizing reads of small device results (cuda/readback.cuh, the MoE's
// expert counts) so far in this process: how many, how long the host waited in them, and how long the GPU stood
// idle from each result's arrival until the host queued work again (CUDA events on the stream). Zeros otherwise.
struct ReadbackTotals {
  int64_t syncs = 0;
  double host_wait_ms = 0, gpu_idle_ms = 0;
};
ReadbackTotals readback_totals();

}  // namespace pdb::cuda
