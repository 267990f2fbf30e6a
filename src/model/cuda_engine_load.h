// Internal to the CUDA engines and their blocks: the loaders from the HF checkpoint to device bf16 (or e4m3).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "cuda/gemm.cuh"
#include "model/cuda_blocks.h"

namespace pdb {

namespace cuda_load {
// HF tensor -> bf16 bytes (bf16 as is; f32/f16 rounded; block FP8 dequantized with its scales).
std::vector<uint16_t> to_bf16(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::string& name, int64_t rows, int64_t cols, int threads);
cuda::DeviceBuffer upload_f32(const std::vector<float>& v);
// A tensor's rows [row0, row0 + rows) of `full_rows` (a tensor-parallel rank's slice; row0 0 and rows ==
// full_rows: all of it).
struct RowSlice { std::string name; int64_t full_rows, row0, rows; };
// Row slices stacked along the output dimension, each restricted to the input columns [col0, col0 + cols) of
// `full_cols`, into one bf16 buffer; adds its bytes to total.
cuda::DeviceBuffer upload_sliced(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::vector<RowSlice>& parts, int64_t full_cols,
                                 int64_t col0, int64_t cols, int threads, size_t& total);
// Tensors stacked along their output dimension into one bf16 buffer; adds its bytes to total.
cuda::DeviceBuffer upload_stacked(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::vector<std::pair<std::string, int64_t>>& parts,
                                  int64_t cols, int threads, size_t& total);
// Block-FP8 row slices stacked along their output dimension, each restricted to the input columns [col0, col0 + cols)
// (a tensor-parallel rank's; slices on 128-blocks): e4m3 bytes as they are, and the checkpoint's [out/128 x in/128]
// scale grids cut and concatenated the same way and written in the order the product reads them.
void upload_sliced_fp8(const SafetensorsCheckpoint& ck, const std::vector<RowSlice>& parts, int64_t full_cols, int64_t col0, int64_t cols,
                       const cuda::Fp8ScaleLayout& L, cuda::DeviceBuffer& w, cuda::DeviceBuffer& scales, size_t& total);
// The loaders' weights from either source (CudaLoad): row slices stacked along the output dimension, restricted to the
// input columns [col0, col0 + cols), as layer `layer`'s weight: bf16 resident from a checkpoint or a GGUF's float
// tensors; a GGUF's quantized tensors kept quantized (ld.quant). Adds its device bytes to total. follow_decoder: the
// products of this weight take ld.numerics (half values where it says so; CudaWeight::products); else bf16.
CudaWeight weight(const CudaLoad& ld, int64_t layer, const std::vector<RowSlice>& parts, int64_t full_cols, int64_t col0, int64_t cols,
                  size_t& total, bool follow_decoder = false);
// A norm's (or any vector's) values as f32.
std::vector<float> vector(const CudaLoad& ld, const std::string& name, int64_t n);
}  // namespace cuda_load

}  // namespace pdb
