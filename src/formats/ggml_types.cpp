#include "formats/ggml_types.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "formats/ggml_decode.h"
#include "formats/numeric.h"

namespace pdb {
namespace {

constexpr int QK = 32;     // Q4_0 / Q8_0 / MXFP4 block

struct Entry { uint32_t id; GgmlTypeTraits t; };
constexpr Entry kTypes[] = {
    {0, {"f32", 1, 4}},        {1, {"f16", 1, 2}},        {2, {"q4_0", 32, 18}},     {3, {"q4_1", 32, 20}},
    {6, {"q5_0", 32, 22}},     {7, {"q5_1", 32, 24}},     {8, {"q8_0", 32, 34}},     {9, {"q8_1", 32, 36}},
    {10, {"q2_K", 256, 84}},   {11, {"q3_K", 256, 110}},  {12, {"q4_K", 256, 144}},  {13, {"q5_K", 256, 176}},
    {14, {"q6_K", 256, 210}},  {15, {"q8_K", 256, 292}},  {16, {"iq2_xxs", 256, 66}}, {17, {"iq2_xs", 256, 74}},
    {18, {"iq3_xxs", 256, 98}}, {19, {"iq1_s", 256, 50}}, {20, {"iq4_nl", 32, 18}},  {21, {"iq3_s", 256, 110}},
    {22, {"iq2_s", 256, 82}},  {23, {"iq4_xs", 256, 136}}, {24, {"i8", 1, 1}},       {25, {"i16", 1, 2}},
    {26, {"i32", 1, 4}},       {27, {"i64", 1, 8}},       {28, {"f64", 1, 8}},       {29, {"iq1_m", 256, 56}},
    {30, {"bf16", 1, 2}},      {34, {"tq1_0", 256, 54}},  {35, {"tq2_0", 256, 66}},  {39, {"mxfp4", 32, 17}},
    {40, {"nvfp4", 64, 36}},   {41, {"q1_0", 128, 18}},   {42, {"q2_0", 64, 18}},
};

using ggml_decode::e8m0_half;
using ggml_decode::kMxfp4Values;

inline void wr16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

void check_blocks(GgmlType t, int64_t n) {
  const auto& tr = traits(t);
  if (n % tr.block_size != 0)
    throw std::invalid_argument(fmt::format("{}: {} elements is not a multiple of the block size {}",
                                            tr.name, n, tr.block_size));
}

}  // namespace

std::optional<GgmlTypeTraits> ggml_type_traits(uint32_t id) {
  for (const auto& e : kTypes) if (e.id == id) return e.t;
  return std::nullopt;
}

const GgmlTypeTraits& traits(GgmlType t) {
  for (const auto& e : kTypes) if (e.id == uint32_t(t)) return e.t;
  throw std::invalid_argument(fmt::format("unknown ggml type id {}", uint32_t(t)));
}

std::string ggml_type_name(GgmlType t) {
  auto tr = ggml_type_traits(uint32_t(t));
  return tr ? tr->name : fmt::format("type{}", uint32_t(t));
}

std::optional<GgmlType> ggml_type_from_name(std::string_view name) {
  for (const auto& e : kTypes) {
    std::string_view n = e.t.name;
    if (n.size() == name.size() &&
        std::equal(n.begin(), n.end(), name.begin(), [](char a, char b) { return std::tolower(a) == std::tolower(b); }))
      return GgmlType(e.id);
  }
  return std::nullopt;
}

size_t ggml_row_bytes(GgmlType t, int64_t n) {
  check_blocks(t, n);
  const auto& tr = traits(t);
  return size_t(n / tr.block_size) * tr.type_size;
}

bool can_dequantize(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0: case GgmlType::Q4_0:
    case GgmlType::MXFP4: case GgmlType::Q4_K: case GgmlType::Q6_K: case GgmlType::Q4_1: case GgmlType::Q5_0: case GgmlType::Q5_1:
    case GgmlType::Q2_K: case GgmlType::Q3_K: case GgmlType::Q5_K: case GgmlType::IQ4_NL: case GgmlType::IQ4_XS:
    case GgmlType::IQ2_XXS: case GgmlType::IQ2_XS: case GgmlType::IQ2_S: case GgmlType::IQ3_XXS: case GgmlType::IQ3_S:
    case GgmlType::IQ1_S: case GgmlType::IQ1_M: return true;
    default: return false;
  }
}

bool can_quantize(GgmlType t) {
  switch (t) {
    case GgmlType::F32: case GgmlType::F16: case GgmlType::BF16: case GgmlType::Q8_0: case GgmlType::Q4_0:
    case GgmlType::MXFP4: return true;
    default: return false;
  }
}

void dequantize_row(GgmlType t, const void* src_v, float* y, int64_t n) {
  check_blocks(t, n);
  if (!can_dequantize(t)) throw std::invalid_argument(fmt::format("no decoder for ggml type {}", ggml_type_name(t)));
  const auto* src = static_cast<const uint8_t*>(src_v);
  if (t == GgmlType::F32) return void(std::memcpy(y, src, size_t(n) * 4));
  if (t == GgmlType::F16) {
    for (int64_t i = 0; i < n; ++i) y[i] = ggml_decode::f16(src + 2 * i);
    return;
  }
  if (t == GgmlType::BF16) {
    for (int64_t i = 0; i < n; ++i) y[i] = ggml_decode::float_element(t, src, i);
    return;
  }
  const auto& tr = traits(t);
  const int groups = ggml_decode::groups_per_block(t);
  for (int64_t b = 0; b < n / tr.block_size; ++b)
    for (int g = 0; g < groups; ++g) ggml_decode::group(t, src + b * tr.type_size, g, y + b * tr.block_size + 32 * g);
}

void quantize_row(GgmlType t, const float* x, void* dst_v, int64_t n, Q8Rounding q8_rounding) {
  check_blocks(t, n);
  auto* dst = static_cast<uint8_t*>(dst_v);
  switch (t) {
    case GgmlType::F32: std::memcpy(dst, x, size_t(n) * 4); return;
    case GgmlType::F16: for (int64_t i = 0; i < n; ++i) wr16(dst + 2 * i, f32_to_fp16(x[i])); return;
    case GgmlType::BF16: for (int64_t i = 0; i < n; ++i) wr16(dst + 2 * i, f32_to_bf16(x[i])); return;
    case GgmlType::Q8_0:
      for (int64_t b = 0; b < n / QK; ++b) {
        const float* xb = x + b * QK;
        uint8_t* blk = dst + b * 34;
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float d = amax / 127.0f;
        const bool ref = q8_rounding == Q8Rounding::TiesAway;
        const float id = ref ? (d != 0.0f ? 1.0f / d : 0.0f) : (amax != 0.0f ? 127.0f / amax : 0.0f);
        wr16(blk, f32_to_fp16(d));
        for (int j = 0; j < QK; ++j) {
          const float v = xb[j] * id;
          blk[2 + j] = uint8_t(int8_t(ref ? std::round(v) : std::nearbyint(v)));
        }
      }
      return;
    case GgmlType::Q4_0:
      for (int64_t b = 0; b < n / QK; ++b) {
        const float* xb = x + b * QK;
        uint8_t* blk = dst + b * 18;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; ++j)
          if (amax < std::fabs(xb[j])) { amax = std::fabs(xb[j]); max = xb[j]; }
        const float d = max / -8;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        wr16(blk, f32_to_fp16(d));
        for (int j = 0; j < QK / 2; ++j) {
          const float x0 = xb[j] * id, x1 = xb[QK / 2 + j] * id;
          const uint8_t xi0 = uint8_t(std::min<int>(15, int8_t(x0 + 8.5f)));
          const uint8_t xi1 = uint8_t(std::min<int>(15, int8_t(x1 + 8.5f)));
          blk[2 + j] = uint8_t(xi0 | (xi1 << 4));
        }
      }
      return;
    case GgmlType::MXFP4:
      for (int64_t b = 0; b < n / QK; ++b) {
        const float* xb = x + b * QK;
        uint8_t* blk = dst + b * 17;
        float amax = 0.0f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const uint8_t e = amax > 0.0f ? uint8_t(std::floor(std::log2(amax)) - 2 + 127) : 0;
        const float d = e8m0_half(e);
        auto best = [d](float v) {
          int bi = 0;
          float be = std::fabs(kMxfp4Values[0] * d - v);
          for (int i = 1; i < 16; ++i) {
            const float err = std::fabs(kMxfp4Values[i] * d - v);
            if (err < be) { bi = i; be = err; }
          }
          return uint8_t(bi);
        };
        blk[0] = e;
        for (int j = 0; j < QK / 2; ++j) blk[1 + j] = uint8_t(best(xb[j]) | (best(xb[QK / 2 + j]) << 4));
      }
      return;
    default:
      throw std::invalid_argument(fmt::format("no encoder for ggml type {}", ggml_type_name(t)));
  }
}

void dequantize_block_fp8(const uint8_t* w, int64_t rows, int64_t cols, const float* scale_inv,
                          int64_t block_rows, int64_t block_cols, float* dst) {
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scale_inv + (r / block_rows) * scale_cols;
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = fp8_e4m3_to_f32(w[r * cols + c]) * srow[c / block_cols];
  }
}

}  // namespace pdb
