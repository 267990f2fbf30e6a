// RMSNorm on the GPU: one block per row, f32 statistics. CPU twin: model/rmsnorm.h.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w   (w may be null)
void rmsnorm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream);

}  // namespace pdb::cuda
