#include "numerics/q8_dot.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "formats/numeric.h"

namespace pdb {

bool has_q8_path(GgmlType t) { return t == GgmlType::Q8_0 || t == GgmlType::Q4_0; }

Q8Matrix unpack_q8_blocks(GgmlType t, const uint8_t* blocks, int64_t rows, int64_t cols) {
  if (!has_q8_path(t)) throw std::invalid_argument("unpack_q8_blocks: Q8_0 or Q4_0 only");
  if (cols % 32) throw std::invalid_argument("unpack_q8_blocks: columns not a multiple of 32");
  Q8Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.q.resize(size_t(rows * cols));
  m.d.resize(size_t(rows * cols / 32));
  const size_t block_bytes = ggml_row_bytes(t, 32);  // f16 scale + 32 int8 codes, or 16 nibble pairs
  for (int64_t b = 0; b < rows * cols / 32; ++b) {
    const uint8_t* blk = blocks + size_t(b) * block_bytes;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    m.d[size_t(b)] = fp16_to_f32(h);
    int8_t* q = m.q.data() + b * 32;
    if (t == GgmlType::Q8_0) {
      std::memcpy(q, blk + 2, 32);
    } else {
      for (int j = 0; j < 16; ++j) {
        q[j] = int8_t((blk[2 + j] & 0x0f) - 8);
        q[j + 16] = int8_t((blk[2 + j] >> 4) - 8);
      }
    }
  }
  return m;
}

void quantize_rows_q8(const float* x, int64_t rows, int64_t k, int8_t* q, float* d) {
  if (k % 32) throw std::invalid_argument("quantize_rows_q8: width not a multiple of 32");
  std::vector<uint8_t> blk(34);
  for (int64_t b = 0; b < rows * k / 32; ++b) {
    quantize_row(GgmlType::Q8_0, x + b * 32, blk.data(), 32, Q8Rounding::TiesEven);
    uint16_t h;
    std::memcpy(&h, blk.data(), 2);
    d[b] = fp16_to_f32(h);
    std::memcpy(q + b * 32, blk.data() + 2, 32);
  }
}

void q8_block_gemm(const int8_t* qx, const float* dx, const Q8Matrix& w, int64_t rows, float* y) {
  const int64_t K = w.cols, B = K / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < w.rows; ++o) {
      const int8_t* a = qx + r * K;
      const int8_t* c = w.q.data() + o * K;
      float acc = 0.0f;
      for (int64_t b = 0; b < B; ++b) {
        int32_t sumi = 0;
        for (int j = 0; j < 32; ++j) sumi += int32_t(a[b * 32 + j]) * int32_t(c[b * 32 + j]);
        const float scale = dx[r * B + b] * w.d[size_t(o * B + b)];
        acc = std::fma(scale, float(sumi), acc);
      }
      y[r * w.rows + o] = acc;
    }
}

}  // namespace pdb
