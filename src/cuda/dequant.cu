#include "cuda/dequant.cuh"

#include <cuda_fp16.h>

#include <stdexcept>

#include <fmt/format.h>

#include "cuda/common.cuh"
#include "formats/ggml_decode.h"

namespace pdb::cuda {

namespace {

namespace gd = ggml_decode;

constexpr bool float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

// A launch's unit: 32 weights of a quantized type (its decoders' group), 8 of a float type.
constexpr int64_t group_elements(GgmlType t) { return float_type(t) ? 8 : 32; }

// Group k of a run of type T's blocks (block_bytes each: the host's traits(T).type_size) starting at src (float types:
// elements 8k..8k+7).
template <GgmlType T>
__device__ __forceinline__ void decode_group(const uint8_t* src, int64_t k, int64_t block_bytes, float* y) {
  if constexpr (float_type(T)) {
    for (int j = 0; j < 8; ++j) y[j] = gd::float_element(T, src, 8 * k + j);
  } else {
    const int G = gd::groups_per_block(T);
    gd::group(T, src + (k / G) * block_bytes, int(k % G), y);
  }
}

__device__ __forceinline__ void round_to(float v, __nv_bfloat16& o) { o = __float2bfloat16_rn(v); }
__device__ __forceinline__ void round_to(float v, __half& o) { o = __float2half_rn(v); }

template <int N, class Out>
__device__ __forceinline__ void store_rounded(Out* out, const float* y) {
  for (int c = 0; c < N / 8; ++c) {
    alignas(16) Out v[8];
    for (int j = 0; j < 8; ++j) round_to(y[8 * c + j], v[j]);
    reinterpret_cast<uint4*>(out)[c] = *reinterpret_cast<const uint4*>(v);
  }
}

__device__ __forceinline__ int find_segment(const DequantSegment* segs, int n, int64_t group) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segs[mid].block0 <= group) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One thread per group: consecutive threads write consecutive 64-byte runs (a warp, 2 KiB of one weight's rows).
template <GgmlType T, class Out>
__global__ void expand_kernel(const DequantSegment* segs, int n_segs, int64_t total, int64_t block_bytes, Out* dst) {
  constexpr int GS = int(group_elements(T));
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const DequantSegment& sg = segs[find_segment(segs, n_segs, i)];
  const int64_t k = i - sg.block0;
  float y[GS];
  decode_group<T>(sg.src, k, block_bytes, y);
  store_rounded<GS>(dst + sg.dst_offset + k * GS, y);
}

// One thread per (row, group), the values written as f32.
template <GgmlType T>
__global__ void rows_kernel(const uint8_t* table, int64_t row_bytes, const int32_t* tokens, int64_t rows, int64_t groups_per_row,
                            int64_t block_bytes, float* h) {
  constexpr int GS = int(group_elements(T));
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * groups_per_row) return;
  const int64_t r = i / groups_per_row, k = i % groups_per_row;
  float y[GS];
  decode_group<T>(table + int64_t(tokens[r]) * row_bytes, k, block_bytes, y);
  float4* o = reinterpret_cast<float4*>(h + (r * groups_per_row + k) * GS);
  for (int c = 0; c < GS / 4; ++c) o[c] = make_float4(y[4 * c], y[4 * c + 1], y[4 * c + 2], y[4 * c + 3]);
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

constexpr int kThreads = 256;

}  // namespace

int64_t dequant_group_elements(GgmlType t) { return group_elements(t); }

bool can_dequantize_on_device(GgmlType t) { return can_dequantize(t); }  // the host's decoders are these kernels' (ggml_decode.h)

void dequantize_segments(GgmlType t, const DequantSegment* segments, int n_segments, int64_t total_groups, void* dst, bool half, cudaStream_t s) {
  if (total_groups <= 0 || n_segments <= 0) return;
  const unsigned blocks = unsigned((total_groups + kThreads - 1) / kThreads);
  dispatch(t, [&](auto tc) {
    constexpr GgmlType T = decltype(tc)::value;
    if (half)
      expand_kernel<T><<<blocks, kThreads, 0, s>>>(segments, n_segments, total_groups, traits(t).type_size, static_cast<__half*>(dst));
    else
      expand_kernel<T><<<blocks, kThreads, 0, s>>>(segments, n_segments, total_groups, traits(t).type_size, static_cast<__nv_bfloat16*>(dst));
  });
  PDB_CUDA_LAUNCHED();
}

void dequantize_rows_f32(GgmlType t, const uint8_t* table, int64_t row_bytes, const int32_t* tokens, int64_t rows, int64_t dim, float* h,
                         cudaStream_t s) {
  if (rows <= 0) return;
  if (dim % group_elements(t)) throw std::invalid_argument("dequantize_rows_f32: the row is not whole groups");
  const int64_t gpr = dim / group_elements(t), n = rows * gpr;
  dispatch(t, [&](auto tc) {
    rows_kernel<decltype(tc)::value><<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, s>>>(table, row_bytes, tokens, rows, gpr,
                                                                                                  traits(t).type_size, h);
  });
  PDB_CUDA_LAUNCHED();
}

}  // namespace pdb::cuda
