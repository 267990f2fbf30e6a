// The GPU's weight expansion (cuda/dequant.cuh, model/cuda_weights.h) against its CPU twin, the host decoders that
// tests/ggml_dequant_test.cpp holds bit for bit to ggml's to_float: every weight type, random blocks, several
// weights of mixed types in one layer, the bf16 values equal bit for bit (NaN to NaN). And the quantized token
// table's rows, gathered by token id, equal the host's f32 rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "cuda/device.h"
#include "formats/ggml_types.h"
#include "formats/numeric.h"
#include "numerics/decoder_numerics.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include "cuda/common.cuh"
#include "cuda/dequant.cuh"
#include "cuda/elementwise.cuh"
#include "model/cuda_weights.h"
#endif

namespace pdb {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary()

constexpr GgmlType kTypes[] = {GgmlType::F32,  GgmlType::F16,    GgmlType::BF16,    GgmlType::Q4_0,    GgmlType::Q4_1,   GgmlType::Q5_0,
                               GgmlType::Q5_1, GgmlType::Q8_0,   GgmlType::Q2_K,    GgmlType::Q3_K,    GgmlType::Q4_K,   GgmlType::Q5_K,
                               GgmlType::Q6_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS,  GgmlType::MXFP4,   GgmlType::IQ1_S,  GgmlType::IQ1_M,
                               GgmlType::IQ2_XXS, GgmlType::IQ2_XS, GgmlType::IQ2_S, GgmlType::IQ3_XXS, GgmlType::IQ3_S};

// Random bytes as blocks of t, with every f16 scale field a finite value of a weight's size (random scales are
// often inf or NaN, and products of those decide nothing).
std::vector<uint8_t> random_rows(GgmlType t, int64_t rows, int64_t cols, std::mt19937& g) {
  std::vector<uint8_t> b(ggml_row_bytes(t, cols) * size_t(rows));
  for (auto& x : b) x = uint8_t(g());
  if (t == GgmlType::F32) {
    std::normal_distribution<float> d(0.0f, 0.05f);
    for (size_t i = 0; i < b.size(); i += 4) { const float v = d(g); std::memcpy(&b[i], &v, 4); }
  } else if (t == GgmlType::F16 || t == GgmlType::BF16) {
    for (size_t i = 0; i < b.size(); i += 2) b[i + 1] &= 0x3b;  // sign clear, exponent small
  }
  return b;
}

bool same_bits(uint16_t a, uint16_t b, bool half) {
  const uint16_t e = half ? 0x7c00 : 0x7f80;
  const bool na = (a & e) == e && (a & ~e & 0x7fff), nb = (b & e) == e && (b & ~e & 0x7fff);
  return a == b || (na && nb);
}

}  // namespace

// Each weight twice: bf16, and half (the decoder's numerics, model/product_numerics.h).
TEST(CudaDequant, EveryWeightTypeExpandsToTheHostsValuesInBf16AndHalf) {
  SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  std::mt19937 g(std::random_device{}());
  const int64_t cols = 512;
  CudaQuantStore store;
  struct Want { CudaWeight w; std::vector<uint16_t> bits; bool half; std::string what; };
  std::vector<Want> wants;
  std::vector<std::vector<uint8_t>> keep;
  for (int layer = 0; layer < 2; ++layer) {
    // every type alone, then one weight of three types stacked (the fused q|k|v of a Q4_K_M GGUF is q4_K, q4_K, q6_K)
    std::vector<std::vector<GgmlType>> weights;
    for (GgmlType t : kTypes) weights.push_back({t});
    weights.push_back({GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q4_K});
    for (const auto& types : weights)
      for (const bool half : {false, true}) {
        std::vector<CudaQuantStore::Part> parts;
        std::vector<uint16_t> want;
        std::string what;
        for (GgmlType t : types) {
          const int64_t rows = 3 + int64_t(g() % 5);
          keep.push_back(random_rows(t, rows, cols, g));
          parts.push_back({t, keep.back().data(), rows, cols});
          std::vector<float> f(size_t(rows * cols));
          for (int64_t r = 0; r < rows; ++r) dequantize_row(t, keep.back().data() + size_t(r) * ggml_row_bytes(t, cols), f.data() + r * cols, cols);
          for (float v : f) want.push_back(half ? f32_to_fp16(v) : f32_to_bf16(v));
          what += ggml_type_name(t) + " ";
        }
        wants.push_back({store.add(layer, parts, half), std::move(want), half, fmt::format("layer {}: {}{}", layer, what, half ? "(half) " : "")});
      }
  }
  store.finish();
  EXPECT_GT(store.quant_bytes(), 0u);
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<uint8_t> poison(store.scratch_bytes(), 0xff);
    PDB_CUDA_CHECK(cudaMemcpy(const_cast<uint8_t*>(store.scratch()), poison.data(), poison.size(), cudaMemcpyHostToDevice));
    store.expand(layer, nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    for (const Want& w : wants) {
      if (w.what.rfind(fmt::format("layer {}:", layer), 0) != 0) continue;
      std::vector<uint16_t> got(w.bits.size());
      PDB_CUDA_CHECK(cudaMemcpy(got.data(), w.w.get(), got.size() * 2, cudaMemcpyDeviceToHost));
      size_t bad = 0, first = got.size();
      for (size_t i = 0; i < got.size(); ++i)
        if (!same_bits(got[i], w.bits[i], w.half)) { if (!bad++) first = i; }
      EXPECT_EQ(bad, 0u) << w.what << "first at " << first << ": got 0x" << std::hex << (first < got.size() ? got[first] : 0) << " want 0x"
                         << (first < got.size() ? w.bits[first] : 0);
    }
    // a prefix of the layer (the last layer run for its K/V rows only): the weights up to the middle one expand as
    // before, and nothing past its end is written
    std::vector<const Want*> mine;
    for (const Want& w : wants)
      if (w.what.rfind(fmt::format("layer {}:", layer), 0) == 0) mine.push_back(&w);
    const size_t upto = mine[mine.size() / 2]->w.scratch_end();
    PDB_CUDA_CHECK(cudaMemcpy(const_cast<uint8_t*>(store.scratch()), poison.data(), poison.size(), cudaMemcpyHostToDevice));
    store.expand(layer, nullptr, upto);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> after(store.scratch_bytes());
    PDB_CUDA_CHECK(cudaMemcpy(after.data(), store.scratch(), after.size(), cudaMemcpyDeviceToHost));
    for (const Want* w : mine) {
      const auto* at = after.data() + (static_cast<const uint8_t*>(w->w.get()) - store.scratch());
      if (w->w.scratch_end() <= upto) {
        size_t bad = 0;
        for (size_t i = 0; i < w->bits.size(); ++i) {
          uint16_t v;
          std::memcpy(&v, at + 2 * i, 2);
          bad += !same_bits(v, w->bits[i], w->half);
        }
        EXPECT_EQ(bad, 0u) << w->what << "(expanded as a prefix)";
      } else {
        EXPECT_TRUE(std::all_of(at, at + w->bits.size() * 2, [](uint8_t b) { return b == 0xff; })) << w->what << "written past the prefix";
      }
    }
  }
#endif
}

TEST(CudaDequant, TokenRowsOfAQuantizedTableAreTheHostsRows) {
  SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  std::mt19937 g(std::random_device{}());
  const int64_t vocab = 97, dim = 768, n = 41;
  for (GgmlType t : kTypes) {
    const auto table = random_rows(t, vocab, dim, g);
    const size_t rb = ggml_row_bytes(t, dim);
    std::vector<int32_t> tokens(n);
    for (auto& x : tokens) x = int32_t(g() % vocab);
    cuda::DeviceBuffer dt(table.size()), dtok(size_t(n) * 4), dh(size_t(n * dim) * 4);
    dt.upload(table.data(), table.size());
    dtok.upload(tokens.data(), tokens.size() * 4);
    cuda::dequantize_rows_f32(t, dt.as<uint8_t>(), int64_t(rb), dtok.as<int32_t>(), n, dim, dh.as<float>(), nullptr);
    std::vector<float> got(size_t(n * dim)), want(got.size());
    dh.download(got.data(), got.size() * 4);
    for (int64_t i = 0; i < n; ++i) dequantize_row(t, table.data() + size_t(tokens[size_t(i)]) * rb, want.data() + i * dim, dim);
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (std::memcmp(&got[i], &want[i], 4) != 0 && !(std::isnan(got[i]) && std::isnan(want[i]))) ++bad;
    EXPECT_EQ(bad, 0u) << ggml_type_name(t);
  }
#endif
}

// The GPU recipe's activations before a product with K-quant or IQ weights: Q8_K values, as its CPU twin makes them
// (itself ggml's quantize_row_q8_K_ref then dequantize_row_q8_K bit for bit: tests/ggml_dequant_test.cpp), including
// ties for the largest magnitude and an all-zero block.
TEST(CudaDequant, Q8KRoundTripIsTheCpuTwinsBitForBit) {
  SKIP_WITHOUT_GPU();
#ifdef PDBRIDGE_HAVE_CUDA
  std::mt19937 g(std::random_device{}());
  std::normal_distribution<float> d(0.0f, 1.0f);
  const int64_t n = 256 * 40;
  std::vector<float> x(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) x[i] = d(g) * (i / 256 % 3 == 0 ? 1e-3f : 3.0f);
  std::fill(x.begin() + 256, x.begin() + 512, 0.0f);
  x[600] = 9.0f; x[700] = -9.0f;  // equal magnitudes: the first one sets the sign of the scale
  auto want = x;
  ggmlnum::round_through(ggmlnum::ActQuant::q8_k, want.data(), 1, n);
  cuda::DeviceBuffer dx(x.size() * 4);
  dx.upload(x.data(), x.size() * 4);
  cuda::q8_k_round_trip(dx.as<float>(), n, nullptr);
  std::vector<float> got(x.size());
  dx.download(got.data(), got.size() * 4);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0);
#endif
}

}  // namespace pdb
