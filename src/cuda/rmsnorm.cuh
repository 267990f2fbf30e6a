// RMSNorm on the GPU: one block per row, f32 statistics. CPU twin: numerics/rmsnorm.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdb::cuda {

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w   (w may be null)
void rmsnorm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream);
// rmsnorm_rows' rows rounded to f16 (f32_to_f16's rounding) in the same pass: the same bits as the two passes, without
// the f32 rows' write and read (the recipe's input to F16 K/V weights).
void rmsnorm_rows_f16(const float* x, const float* w, __half* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream);
// The same over the first `dim` elements of rows x_stride / y_stride apart (in place allowed): MLA's latent
// norm inside its cache row.
void rmsnorm_rows_strided(const float* x, int64_t x_stride, const float* w, float* y, int64_t y_stride, int64_t rows, int64_t dim, float eps,
                          cudaStream_t stream);
// The engine's variant: f32 residual in, bf16 matmul input out (f32 statistics; float sum).
void rmsnorm_rows_bf16(const float* x, const float* w, __nv_bfloat16* y, int64_t rows, int64_t dim, float eps, cudaStream_t stream);

}  // namespace pdb::cuda

#include <string>
#include <vector>

namespace pdb::cuda {
// Host convenience for tests and tools: copies in, runs the kernel, copies out. Throws on CUDA errors.
std::vector<float> rmsnorm_rows_host(const std::vector<float>& x, const std::vector<float>& w, int64_t rows, int64_t dim, float eps);
}  // namespace pdb::cuda
