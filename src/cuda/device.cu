#include <cuda_runtime.h>

#include <cstdio>

#include "cuda/device.h"

namespace pdb::cuda {

bool compiled_with_cuda() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
  return n;
}

bool device_is_sm90() {
  static const bool yes = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) { cudaGetLastError(); return false; }
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return major == 9 && minor == 0;
  }();
  return yes;
}

int multiprocessor_count() {
  static const int n = [] {
    int dev = 0, c = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return c;
  }();
  return n;
}

size_t device_bytes_in_use() {
  size_t free = 0, total = 0;
  if (device_count() == 0 || cudaMemGetInfo(&free, &total) != cudaSuccess) return 0;
  return total - free;
}

std::string device_summary() {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) { cudaGetLastError(); return std::string("no CUDA device: ") + cudaGetErrorString(e); }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  char buf[512];
  std::snprintf(buf, sizeof buf, "%s (sm_%d%d, %.1f GiB)", p.name, p.major, p.minor, double(p.totalGlobalMem) / (1 << 30));
  return buf;
}

}  // namespace pdb::cuda
