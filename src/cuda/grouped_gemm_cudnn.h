// The experts' grouped products through cuDNN's MoE grouped matmul (cuDNN >= 9.15's MOE_GROUPED_MATMUL operation,
// built by hand through cudnn_graph.h), the A/B peer of grouped_gemm.cuh's cuBLAS calls: every expert's weights in one
// buffer, each expert's rows found on the device from where they start, so nothing is downloaded per layer and no
// pointer arrays are built. One plan per shape, kept per device; cudnn_moe_stats() reports the builds.
// CPU twin: the per-expert products of model/moe_ffn.h (kernels_test: CudaGroupedGemm.*).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cudnn_graph.h"

namespace pdb::cuda {

struct MoeGroupedShape {
  int64_t rows = 0;     // grouped rows (the tokens' choices), expert after expert
  int64_t experts = 0;
  int64_t in = 0, out = 0;
  int64_t x_rows = 0;   // with a gather index: the rows of x (the tokens); unused without
};

// y[r] = x[gather ? gather[r] : r] . W_e^T for the rows r of expert e, [first_row[e], first_row[e+1]) (the last
// expert's up to s.rows): x bf16 [rows (or x_rows) x in], w bf16 [experts x out x in], first_row int32 [experts] and
// gather int32 [rows] on the device, y bf16 [rows x out], f32 accumulation. Throws std::runtime_error where cuDNN is
// missing or has no engine for the shape (remembered: the next call with that shape throws at once).
void moe_grouped_xwt_cudnn(const __nv_bfloat16* x, const int32_t* gather, const __nv_bfloat16* w, const int32_t* first_row,
                           __nv_bfloat16* y, const MoeGroupedShape& s, cudaStream_t stream);

CudnnPlanStats cudnn_moe_stats();

}  // namespace pdb::cuda
