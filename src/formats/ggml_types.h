// ggml tensor types and the block codecs the bridge needs (ggml-common.h / ggml-quants.c layouts).
// Encoders reproduce ggml's reference quantizers byte for byte (tested against llama-quantize).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pdb {

enum class GgmlType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35,
  MXFP4 = 39, NVFP4 = 40, Q1_0 = 41, Q2_0 = 42,
};

struct GgmlTypeTraits {
  const char* name;
  uint32_t block_size;  // elements per block
  uint32_t type_size;   // bytes per block
};

// nullopt for ids that ggml does not define (e.g. removed 4, 5, 31-33, 36-38).
std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t id);
const GgmlTypeTraits& traits(GgmlType t);
std::string ggml_type_name(GgmlType t);
std::optional<GgmlType> ggml_type_from_name(std::string_view name);  // "f16", "q8_0", ...

// Bytes of n elements (n must be a multiple of the block size; throws otherwise).
size_t ggml_row_bytes(GgmlType t, int64_t n);

bool can_dequantize(GgmlType t);
bool can_quantize(GgmlType t);

// Decoders (bit for bit ggml's to_float, tests/ggml_dequant_test.cpp): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S. Throws for
// other types.
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

// Two Q8_0 quantizers exist in ggml. The reference (llama-quantize) scales by 1/d and rounds ties
// away from zero; ggml-cpu's x86 quantizer (KV cache writes, activations before a quantized matmul)
// scales by 127/amax and rounds ties to even. Bits differ between the two, so name the one you mean.
enum class Q8Rounding { TiesAway, TiesEven };

// Encoders: F32, F16, BF16, Q8_0, Q4_0, MXFP4 (ggml reference quantizers). Throws for other types.
void quantize_row(GgmlType t, const float* src, void* dst, int64_t n,
                  Q8Rounding q8_rounding = Q8Rounding::TiesAway);

// HF block-FP8 weight (E4M3 [rows, cols] with scale_inv [ceil(rows/bs), ceil(cols/bs)]) -> f32.
void dequantize_block_fp8(const uint8_t* w, int64_t rows, int64_t cols, const float* scale_inv,
                          int64_t block_rows, int64_t block_cols, float* dst);

}  // namespace pdb
