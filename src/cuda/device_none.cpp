// Build without the CUDA toolkit: the CPU backend is the only one.
#include "cuda/device.h"

namespace pdb::cuda {
bool compiled_with_cuda() { return false; }
int device_count() { return 0; }
bool device_is_sm90() { return false; }
int multiprocessor_count() { return 0; }
std::string device_summary() { return "pdbridge was built without CUDA"; }
double measure_bf16_gemm_tflops(int64_t) { return 0.0; }
size_t device_bytes_in_use() { return 0; }
std::string attention_kernel_summary() { return "none"; }
int64_t attention_plans_built() { return 0; }
ReadbackTotals readback_totals() { return {}; }

}  // namespace pdb::cuda
