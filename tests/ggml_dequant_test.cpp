// Our GGUF weight decoders (formats/ggml_types.cpp) against ggml's own, bit for bit: the pinned llama.cpp build's
// `ggml_get_type_traits(type)->to_float` from its libggml-base, linked here. Two kinds of blocks per type: ggml's own
// quantizer's output for random weights (the blocks a llama-quantize GGUF holds), and random bytes (every bit pattern
// of codes and scales; NaN compared as NaN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "formats/ggml_types.h"
#include "ggml.h"
#include "formats/numeric.h"
#include "numerics/decoder_numerics.h"

// ggml-quants.c (libggml-base): the reference Q8_K quantizer (its block type is internal to ggml).
extern "C" void quantize_row_q8_K_ref(const float* x, void* y, int64_t k);
extern "C" void dequantize_row_q8_K(const void* x, float* y, int64_t k);
// ggml-cpu (libggml-cpu): the activation quantizer its Q4_1/Q5_1 products use (this CPU's SIMD version).
extern "C" void quantize_row_q8_1(const float* x, void* y, int64_t k);

namespace pdb {
namespace {

const GgmlType kTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1,   GgmlType::Q5_0,
                           GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K,   GgmlType::Q5_K,
                           GgmlType::Q6_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS, GgmlType::MXFP4, GgmlType::IQ1_S, GgmlType::IQ1_M,
                           GgmlType::IQ2_XXS, GgmlType::IQ2_XS, GgmlType::IQ2_S, GgmlType::IQ3_XXS, GgmlType::IQ3_S};

// Elements that differ in bits (NaN against NaN counts as equal), and the first of them.
int64_t bit_differences(const std::vector<float>& a, const std::vector<float>& b, int64_t* first) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::memcmp(&a[i], &b[i], 4) != 0 && n++ == 0) *first = int64_t(i);
  }
  return n;
}

void expect_same_as_ggml(GgmlType t, const std::vector<uint8_t>& blocks, int64_t n, const char* what) {
  const auto* tr = ggml_get_type_traits(ggml_type(t));
  std::vector<float> theirs(static_cast<size_t>(n)), ours(static_cast<size_t>(n));
  if (t == GgmlType::F32) {
    std::memcpy(theirs.data(), blocks.data(), size_t(n) * 4);  // ggml has no to_float for F32: its values are the bytes
  } else {
    ASSERT_NE(tr->to_float, nullptr) << ggml_type_name(t);
    tr->to_float(blocks.data(), theirs.data(), n);
  }
  dequantize_row(t, blocks.data(), ours.data(), n);
  int64_t first = -1;
  const int64_t diff = bit_differences(theirs, ours, &first);
  EXPECT_EQ(diff, 0) << ggml_type_name(t) << " (" << what << "): " << diff << " of " << n << " elements differ; first at " << first
                     << ": ggml " << theirs[size_t(first < 0 ? 0 : first)] << ", ours " << ours[size_t(first < 0 ? 0 : first)];
}

TEST(GgmlDequant, EveryWeightTypeDecodesBitForBitAsGgmlsToFloat) {
  ASSERT_EQ(ggml_type_size(GGML_TYPE_Q5_K), traits(GgmlType::Q5_K).type_size);  // the same block layouts as the linked ggml
  std::mt19937 rng(35);
  const int64_t rows = 16, per_row = 1024, n = rows * per_row;
  for (GgmlType t : kTypes) {
    ASSERT_TRUE(can_dequantize(t)) << ggml_type_name(t);
    ASSERT_EQ(ggml_row_size(ggml_type(t), per_row), ggml_row_bytes(t, per_row)) << ggml_type_name(t);
    // ggml's quantizer on weights of several magnitudes (an importance matrix where the type takes one)
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> w(static_cast<size_t>(n)), imatrix(static_cast<size_t>(per_row));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < per_row; ++i) w[size_t(r * per_row + i)] = normal(rng) * std::ldexp(1.0f, int(r % 8) - 6);
    for (auto& v : imatrix) v = 0.1f + std::abs(normal(rng));
    std::vector<uint8_t> q(ggml_row_bytes(t, n));
    ggml_quantize_chunk(ggml_type(t), w.data(), q.data(), 0, rows, per_row, imatrix.data());
    expect_same_as_ggml(t, q, n, "ggml-quantized weights");
    // every bit pattern
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& b : q) b = uint8_t(byte(rng));
    expect_same_as_ggml(t, q, n, "random bytes");
  }
}

}  // namespace
}  // namespace pdb

namespace pdb {
// The CPU engine's activations before a product with K-quant or IQ weights (numerics/decoder_numerics.h): the values
// of ggml's own Q8_K quantization of the row (quantize_row_q8_K_ref, then dequantize_row_q8_K), bit for bit.
TEST(GgmlDequant, ActivationsRoundThroughQ8KAsGgmlQuantizesThem) {
  std::mt19937 g(std::random_device{}());
  std::normal_distribution<float> d(0.0f, 1.0f);
  const int64_t n = 1024;
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<float> x(static_cast<size_t>(n)), ours;
    for (auto& v : x) v = d(g) * (trial % 3 == 0 ? 1e-3f : trial % 3 == 1 ? 1.0f : 40.0f);
    // bf16 rows (the engine's attention output): half the largest magnitude is common, an exact tie at code 63.5
    if (trial >= 20) for (auto& v : x) v = round_bf16(v);
    if (trial == 5) std::fill(x.begin(), x.begin() + 256, 0.0f);  // an all-zero block stays zero
    ours = x;
    ggmlnum::round_through(ggmlnum::ActQuant::q8_k, ours.data(), 1, n);
    std::vector<uint8_t> q(ggml_row_size(GGML_TYPE_Q8_K, n));
    quantize_row_q8_K_ref(x.data(), q.data(), n);
    std::vector<float> want(static_cast<size_t>(n));
    dequantize_row_q8_K(q.data(), want.data(), n);
    EXPECT_EQ(std::memcmp(ours.data(), want.data(), size_t(n) * 4), 0) << "trial " << trial;
  }
}
}  // namespace pdb

namespace pdb {
// The recipe's Q4_1/Q5_1 term (ggmlnum::q8_1_sum_corrections) against ggml-cpu's own Q8_1 blocks: f16(d) * sum q plus
// the correction is the block sum ggml stores (its `s`, f16 at bytes 2-3 of each 36-byte block), bit for bit, and
// the codes are round_through's Q8_0 codes (its `d` at bytes 0-1 is f16(amax/127)).
TEST(GgmlDequant, Q81BlockSumsAreGgmlCpusOwn) {
  std::mt19937 g(std::random_device{}());
  std::normal_distribution<float> d(0.0f, 1.0f);
  const int64_t n = 1024, nb = n / 32;
  int64_t nonzero = 0;
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = d(g) * (trial % 2 ? 1.0f : 30.0f);
    if (trial >= 10) for (auto& v : x) v = round_bf16(v);
    std::vector<uint8_t> q(static_cast<size_t>(nb * 36));
    quantize_row_q8_1(x.data(), q.data(), n);
    std::vector<float> c(static_cast<size_t>(nb)), vals = x;
    ggmlnum::q8_1_sum_corrections(x.data(), 1, n, c.data());
    ggmlnum::round_through(ggmlnum::ActQuant::q8_0, vals.data(), 1, n);
    for (int64_t b = 0; b < nb; ++b) {
      uint16_t dh, sh;
      std::memcpy(&dh, &q[size_t(b * 36)], 2);
      std::memcpy(&sh, &q[size_t(b * 36 + 2)], 2);
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int8_t code = int8_t(q[size_t(b * 36 + 4 + j)]);
        sum += code;
        ASSERT_EQ(vals[size_t(b * 32 + j)], fp16_to_f32(dh) * float(code)) << "trial " << trial << " block " << b << " value " << j;
      }
      EXPECT_EQ(fp16_to_f32(dh) * float(sum) + c[size_t(b)], fp16_to_f32(sh)) << "trial " << trial << " block " << b;
      nonzero += c[size_t(b)] != 0.0f;
    }
  }
  EXPECT_GT(nonzero, 20 * nb / 4);  // the f16 rounding of the sums is there to be mirrored
}
}  // namespace pdb

