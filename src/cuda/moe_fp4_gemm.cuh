// DeepSeek-V4's routed experts straight from their MXFP4 codes (issue 36's "FP4 without the detour"): one grouped
// product over every expert's rows whose weight operand each thread makes in registers from the codes, instead of a
// bf16 copy of every expert per layer (12.9 GB at V4-Flash's shapes) for cuBLAS. The weights made are the ones
// mxfp4_to_bf16 makes (the same bf16 values, bit for bit), so the products are bf16 x bf16 with f32 accumulation as
// before. Hopper only (wgmma; moe_fp4_gemm.cu).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/tuning.h"
#include "cuda/moe_tiles.h"

namespace pdb::cuda {

// One [rows x cols] matrix per expert with GGUF's MXFP4 blocks taken apart: the 16 code bytes of each 32-block as
// ggml stores them (byte j: element j in the low nibble, j + 16 in the high one) and its E8M0 byte in an array of
// their own, so that a tile's codes are 16-byte aligned loads (a 17-byte block is not).
struct Fp4Matrices {
  uint8_t* codes = nullptr;   // [experts x rows x cols / 2]
  uint8_t* scales = nullptr;  // [experts x rows x cols / 32]
  int64_t experts = 0, rows = 0, cols = 0;
  // some block's E8M0 byte is above 128 (a scale past 2^0): the products then multiply each value twice (as
  // repack_mxfp4 said; true unless known otherwise)
  bool wide_scales = true;
  // the rows are gate/up pairs for the fused SwiGLU (Fp4Fusion): of the logical rows [gate 0 .. rows/2 | up 0 ..
  // rows/2), repack_mxfp4 stores gate j at 16 (j / 8) + j % 8 and up j 8 rows after it, so that one thread's two
  // output rows of a fragment (g, g + 8) are one feature's gate and up
  bool gate_up_pairs = false;
  size_t code_bytes() const { return size_t(experts * rows * cols / 2); }
  size_t scale_bytes() const { return size_t(experts * rows * cols / 32); }
};

// Where logical row n of m is stored: itself, or as a gate/up pair's row (Fp4Matrices::gate_up_pairs).
__host__ __device__ inline int64_t fp4_stored_row(int64_t n, const Fp4Matrices& m) {
  if (!m.gate_up_pairs) return n;
  const int64_t half = m.rows / 2, j = n < half ? n : n - half;
  return 16 * (j / 8) + j % 8 + (n < half ? 0 : 8);
}
// The fused epilogue's feature: a thread holds output rows r16 + g and r16 + g + 8 (r16 its warp's first of 16
// rows, g = lane / 4), with paired weights gate and up of feature r16 / 2 + g.
__host__ __device__ constexpr int64_t fp4_pair_feature(int64_t r16, int g) { return r16 / 2 + g; }

// GGUF MXFP4 blocks of `m.experts` matrices [rows x m.cols] into rows row0 .. row0 + rows - 1 of m's (gate and up
// into the two halves of one [2F x E] matrix per expert), in the products' fragment order (moe_fp4_gemm.cu). Waits
// for the stream; returns whether any of these blocks' E8M0 bytes is above 128 (Fp4Matrices::wide_scales).
bool repack_mxfp4(const uint8_t* blocks, int64_t rows, int64_t row0, const Fp4Matrices& m, cudaStream_t s);

// What the gate|up products take into themselves (the engine's default; PDBRIDGE_DSV4_FP4_FUSE=0: not): the gather of each choice's token row
// into the loads of x, and the clamped SwiGLU into the epilogue, so neither the gathered rows nor the gate|up
// products pass through memory. The same bits as gather_rows, the products and swiglu_clamp_rows one after another.
struct Fp4Fusion {
  const int32_t* x_rows = nullptr;  // device: the products' row r reads x's row x_rows[r] (null: row r)
  bool swiglu = false;              // w.gate_up_pairs; y is [rows x w.rows / 2]: silu(min(g, L)) * clamp(u, -L, L)
  float limit = 0.0f;               // L (<= 1e-6: no clamp), of the bf16-rounded products, as swiglu_clamp_rows
};

// An sm_90 GPU, in a multiple of 64, out a multiple of 128.
bool moe_fp4_products_supported(int64_t in, int64_t out);
// The products' shape a tuning names (PDBRIDGE_DSV4_FP4_TILE=rows256: 128 outputs x 256 rows; else 256 x 128).
Fp4Shape fp4_shape(const Tuning& t);
// y[r, 0 .. w.rows) = x[r, 0 .. w.cols) W_e^T, bf16, for each tile's rows r with e its expert; tiles in device memory,
// made by fp4_tiles for `shape` (a longer tile traps). With f.x_rows, x's rows are x_rows[r]; with f.swiglu, y holds
// the SwiGLU of each gate/up pair instead.
void moe_fp4_products(const __nv_bfloat16* x, const Fp4Matrices& w, const Fp4Tile* tiles, int64_t n_tiles, Fp4Shape shape, __nv_bfloat16* y,
                      cudaStream_t s, const Fp4Fusion& f = {});

}  // namespace pdb::cuda
