// Internal to the CUDA engine (cuda_engine.cpp, cuda_engine_mla.cpp, cuda_moe_ffn.cpp): its weights and
// per-prompt buffers, and the loaders from the HF checkpoint to device bf16.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "model/cuda_engine.h"
#include "model/cuda_moe_ffn.h"

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
}  // namespace cuda_load

struct CudaEngine::Weights {
  using DeviceBuffer = cuda::DeviceBuffer;
  DeviceBuffer embed;  // [vocab x hidden] f32 (exact for every checkpoint dtype)
  struct Layer {
    DeviceBuffer in_norm, post_norm, q_norm, k_norm;  // f32
    DeviceBuffer wqkv, wo, wgu, wd;                   // bf16 [out x in], or e4m3 on the FP8 path; qkv and gate|up fused along out
    DeviceBuffer wqkv_s, wo_s, wgu_s, wd_s;           // FP8 path: f32 scale per 128x128 block, in the product's order
    std::unique_ptr<CudaMoeWeights> moe;              // qwen3moe: the routed experts in place of wgu/wd
    // deepseek2 (MLA): wqkv = [q_proj (or q_a_proj) ; kv_a_proj_with_mqa] fused along out; wgu/wd the dense
    // FFN or the shared experts.
    DeviceBuffer q_a_norm, kv_a_norm, wq_b, wkv_b;
  };
  std::vector<Layer> layers;
  DeviceBuffer inv_freq;  // f32 [head_dim/2]
  // Per-prompt state, grown on demand and kept for the next prompt.
  DeviceBuffer kcache, vcache;  // [layers x kv_heads x capacity x head_dim] bf16, or e4m3 codes (kv_fp8); MLA: K 192 and V 128 wide per head
  DeviceBuffer kscale, vscale;  // kv_fp8: [layers x kv_heads x capacity] f32
  DeviceBuffer kx, vx;          // kv_fp8, expanded: one layer's rows as bf16 [kv_heads x capacity x head_dim]
  int64_t capacity = 0;
  DeviceBuffer tokens, h, x, qkv, q, att, gu, act;
  DeviceBuffer xq, xs, ybf;  // FP8 path: quantized activations, their scales, bf16 product for the residual add
  DeviceBuffer qa, qfull, ckv, kvb, cs;  // MLA: the normed q LoRA, q, the normed c_kv, kv_b's output, the chunk's RoPE cos/sin
  CudaMoeFfn moe;            // the MoE block's scratch
  size_t buffer_bytes() const {
    return kcache.bytes() + vcache.bytes() + kscale.bytes() + vscale.bytes() + kx.bytes() + vx.bytes() + h.bytes() + x.bytes() + qkv.bytes() +
           q.bytes() + att.bytes() + gu.bytes() + act.bytes() + xq.bytes() + xs.bytes() + ybf.bytes() + qa.bytes() + qfull.bytes() + ckv.bytes() +
           kvb.bytes() + cs.bytes() +
           moe.scratch_bytes();
  }
};

}  // namespace pdb
