// What the CUDA backend can see. Safe to call in builds without CUDA (answers "no device").
#pragma once
#include <string>

namespace pdb::cuda {

int device_count();           // 0 without CUDA or without a GPU
std::string device_summary();  // "NVIDIA H200 (sm_90, 139.8 GiB)" or why there is none
bool compiled_with_cuda();

}  // namespace pdb::cuda
