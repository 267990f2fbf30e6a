#include "cuda/dequant.cuh"

#include <stdexcept>

#include <fmt/format.h>

#include "cuda/common.cuh"
#include "formats/ggml_decode.h"

namespace pdb::cuda {

namespace {

namespace gd = ggml_decode;

constexpr int64_t block_elements(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: return 8;
    case GgmlType::Q8_0: case GgmlType::Q4_0: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1: case GgmlType::MXFP4:
    case GgmlType::IQ4_NL: return 32;
    default: return 256;
  }
}

constexpr int64_t block_bytes(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return 32;
    case GgmlType::F16: case GgmlType::BF16: return 16;
    case GgmlType::Q8_0: return 34;
    case GgmlType::Q4_0: return 18;
    case GgmlType::Q4_1: return 20;
    case GgmlType::Q5_0: return 22;
    case GgmlType::Q5_1: return 24;
    case GgmlType::MXFP4: return 17;
    case GgmlType::IQ4_NL: return 18;
    case GgmlType::Q2_K: return 84;
    case GgmlType::Q3_K: return 110;
    case GgmlType::Q4_K: return 144;
    case GgmlType::Q5_K: return 176;
    case GgmlType::Q6_K: return 210;
    case GgmlType::IQ4_XS: return 136;
    case GgmlType::IQ2_XXS: return 66;
    case GgmlType::IQ2_XS: return 74;
    case GgmlType::IQ2_S: return 82;
    case GgmlType::IQ3_XXS: return 98;
    case GgmlType::IQ3_S: return 110;
    case GgmlType::IQ1_S: return 50;
    case GgmlType::IQ1_M: return 56;
    default: return 0;
  }
}

// A launch block of T: the type's block, or eight values of a float type.
template <GgmlType T>
__device__ __forceinline__ void decode(const uint8_t* b, float* y) {
  constexpr int64_t kStep = T == GgmlType::F32 ? 4 : 2;
  if constexpr (block_elements(T) == 8) {
    for (int j = 0; j < 8; ++j) gd::block(T, b + j * kStep, y + j);
  } else {
    gd::block(T, b, y);
  }
}

__device__ __forceinline__ int find_segment(const DequantSegment* segs, int n, int64_t block) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segs[mid].block0 <= block) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One warp per CUDA block: each lane decodes one block into shared memory (rows padded by one float: no bank
// conflicts), then the warp writes the 32 blocks' bf16 values as 16-byte stores, consecutive lanes on consecutive
// addresses.
template <GgmlType T>
__global__ void __launch_bounds__(32) expand_kernel(const DequantSegment* segs, int n_segs, int64_t total, __nv_bfloat16* dst) {
  constexpr int BS = int(block_elements(T)), BB = int(block_bytes(T)), CPB = BS / 8;
  __shared__ float stage[32][BS + 1];
  __shared__ __nv_bfloat16* out[32];
  const int lane = threadIdx.x;
  const int64_t i = int64_t(blockIdx.x) * 32 + lane;
  out[lane] = nullptr;
  if (i < total) {
    const DequantSegment& sg = segs[find_segment(segs, n_segs, i)];
    const int64_t k = i - sg.block0;
    decode<T>(sg.src + k * BB, stage[lane]);
    out[lane] = dst + sg.dst_offset + k * BS;
  }
  __syncwarp();
  for (int c = lane; c < 32 * CPB; c += 32) {
    const int k = c / CPB, w = c % CPB;
    if (!out[k]) continue;
    alignas(16) __nv_bfloat16 v[8];
    for (int j = 0; j < 8; ++j) v[j] = __float2bfloat16_rn(stage[k][w * 8 + j]);
    *reinterpret_cast<uint4*>(out[k] + w * 8) = *reinterpret_cast<const uint4*>(v);
  }
}

// One thread per (row, block): the block decoded into registers, then written as f32.
template <GgmlType T>
__global__ void rows_kernel(const uint8_t* table, int64_t row_bytes, const int32_t* tokens, int64_t rows, int64_t blocks_per_row, float* h) {
  constexpr int BS = int(block_elements(T)), BB = int(block_bytes(T));
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * blocks_per_row) return;
  const int64_t r = i / blocks_per_row, b = i % blocks_per_row;
  float y[BS];
  decode<T>(table + int64_t(tokens[r]) * row_bytes + b * BB, y);
  float* o = h + (r * blocks_per_row + b) * BS;
  for (int j = 0; j < BS; ++j) o[j] = y[j];
}

template <class F>
void dispatch(GgmlType t, F&& f) {
  switch (t) {
#define PDB_DQ(X) case GgmlType::X: return f(std::integral_constant<GgmlType, GgmlType::X>{});
    PDB_DQ(F32) PDB_DQ(F16) PDB_DQ(BF16) PDB_DQ(Q8_0) PDB_DQ(Q4_0) PDB_DQ(Q4_1) PDB_DQ(Q5_0) PDB_DQ(Q5_1) PDB_DQ(MXFP4) PDB_DQ(IQ4_NL)
    PDB_DQ(Q2_K) PDB_DQ(Q3_K) PDB_DQ(Q4_K) PDB_DQ(Q5_K) PDB_DQ(Q6_K) PDB_DQ(IQ4_XS) PDB_DQ(IQ2_XXS) PDB_DQ(IQ2_XS) PDB_DQ(IQ2_S)
    PDB_DQ(IQ3_XXS) PDB_DQ(IQ3_S) PDB_DQ(IQ1_S) PDB_DQ(IQ1_M)
#undef PDB_DQ
    default: throw std::invalid_argument(fmt::format("no GPU decoder for ggml type {}", ggml_type_name(t)));
  }
}

}  // namespace

int64_t dequant_block_elements(GgmlType t) { return block_elements(t); }

bool can_dequantize_on_device(GgmlType t) { return block_bytes(t) > 0; }

void dequantize_segments_bf16(GgmlType t, const DequantSegment* segments, int n_segments, int64_t total_blocks, __nv_bfloat16* dst,
                              cudaStream_t s) {
  if (total_blocks <= 0 || n_segments <= 0) return;
  dispatch(t, [&](auto tc) {
    expand_kernel<decltype(tc)::value><<<unsigned((total_blocks + 31) / 32), 32, 0, s>>>(segments, n_segments, total_blocks, dst);
  });
  PDB_CUDA_LAUNCHED();
}

void dequantize_rows_f32(GgmlType t, const uint8_t* table, int64_t row_bytes, const int32_t* tokens, int64_t rows, int64_t dim, float* h,
                         cudaStream_t s) {
  if (rows <= 0) return;
  const int64_t bpr = dim / block_elements(t), n = rows * bpr;
  if (dim % block_elements(t)) throw std::invalid_argument("dequantize_rows_f32: the row is not whole blocks");
  dispatch(t, [&](auto tc) {
    rows_kernel<decltype(tc)::value><<<unsigned((n + 127) / 128), 128, 0, s>>>(table, row_bytes, tokens, rows, bpr, h);
  });
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
