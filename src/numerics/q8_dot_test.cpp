// The recipe's integer path for Q8_0/Q4_0 weights: codes and scales reproduce the GGUF's values
// exactly, the activation quantizer is ggml-cpu's, and the block product equals the f64 product of
// the dequantized operands to f32 accuracy.
#include "numerics/q8_dot.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "formats/numeric.h"

namespace pdb {

TEST(RecipeQ8, BlocksUnpackToTheValuesDequantizeGivesAndTheProductIsTheF64One) {
  std::mt19937 g(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t rows = 5, K = 256, N = 12;
  std::vector<float> x(size_t(rows * K)), w(size_t(N * K));
  for (auto& v : x) v = nd(g);
  for (auto& v : w) v = 0.05f * nd(g);
  for (GgmlType t : {GgmlType::Q8_0, GgmlType::Q4_0}) {
    const size_t rb = ggml_row_bytes(t, K);
    std::vector<uint8_t> blocks(rb * size_t(N));
    std::vector<float> deq(w.size());
    for (int64_t o = 0; o < N; ++o) {
      quantize_row(t, w.data() + o * K, blocks.data() + size_t(o) * rb, K);
      dequantize_row(t, blocks.data() + size_t(o) * rb, deq.data() + o * K, K);
    }
    const Q8Matrix m = unpack_q8_blocks(t, blocks.data(), N, K);
    size_t exact = 0;
    for (int64_t i = 0; i < N * K; ++i) exact += m.d[size_t(i / 32)] * float(m.q[size_t(i)]) == deq[size_t(i)];
    EXPECT_EQ(exact, size_t(N * K)) << ggml_type_name(t);

    std::vector<int8_t> qx(x.size());
    std::vector<float> dx(x.size() / 32), xdeq(x.size());
    quantize_rows_q8(x.data(), rows, K, qx.data(), dx.data());
    std::vector<uint8_t> xb(ggml_row_bytes(GgmlType::Q8_0, K));
    for (int64_t r = 0; r < rows; ++r) {  // the same codes as ggml-cpu's quantizer writes
      quantize_row(GgmlType::Q8_0, x.data() + r * K, xb.data(), K, Q8Rounding::TiesEven);
      dequantize_row(GgmlType::Q8_0, xb.data(), xdeq.data() + r * K, K);
      for (int64_t i = 0; i < K; ++i) ASSERT_EQ(dx[size_t((r * K + i) / 32)] * float(qx[size_t(r * K + i)]), xdeq[size_t(r * K + i)]);
    }
    std::vector<float> y(size_t(rows * N));
    q8_block_gemm(qx.data(), dx.data(), m, rows, y.data());
    double worst = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < N; ++o) {
        double ref = 0, mag = 0;
        for (int64_t i = 0; i < K; ++i) {
          ref += double(xdeq[size_t(r * K + i)]) * deq[size_t(o * K + i)];
          mag += std::fabs(double(xdeq[size_t(r * K + i)]) * deq[size_t(o * K + i)]);
        }
        worst = std::max(worst, std::fabs(y[size_t(r * N + o)] - ref) / mag);
      }
    EXPECT_LT(worst, 1e-6) << ggml_type_name(t);  // a few f32 roundings over 8 block sums
  }
  EXPECT_THROW(unpack_q8_blocks(GgmlType::F16, nullptr, 1, 32), std::invalid_argument);
  EXPECT_THROW(quantize_rows_q8(x.data(), 1, 48, nullptr, nullptr), std::invalid_argument);
}

}  // namespace pdb
