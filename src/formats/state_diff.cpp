#include "formats/state_diff.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "formats/numeric.h"

namespace pdb {

int64_t StateDiff::elements() const { int64_t n = 0; for (auto& t : tensors) n += t.elements; return n; }
int64_t StateDiff::identical() const { int64_t n = 0; for (auto& t : tensors) n += t.identical; return n; }
int64_t StateDiff::max_ulp() const { int64_t n = 0; for (auto& t : tensors) n = std::max(n, t.max_ulp); return n; }
double StateDiff::max_abs() const { double n = 0; for (auto& t : tensors) n = std::max(n, t.max_abs); return n; }

nlohmann::json StateDiff::to_json() const {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& t : tensors)
    layers.push_back({{"tensor", t.name}, {"elements", t.elements}, {"pct_identical", t.pct_identical()},
                      {"max_abs", t.max_abs}, {"max_ulp", t.max_ulp}, {"pct_within_1_ulp", t.pct_within(0)},
                      {"pct_within_2_ulp", t.pct_within(1)}, {"pct_within_4_ulp", t.pct_within(2)}, {"rel_rms", t.rel_rms()},
                      {"max_rel", t.max_rel()}});
  return {{"same_layout", same_layout}, {"same_tokens", same_tokens}, {"layout_note", layout_note},
          {"elements", elements()}, {"pct_identical", pct_identical()}, {"max_ulp", max_ulp()}, {"max_abs", max_abs()},
          {"tensors", layers}};
}

namespace {

// Monotone integer image of a float type's bit pattern, so |a-b| counts representable values between.
int64_t ordered(uint32_t bits, int width) {
  const uint32_t sign = 1u << (width - 1);
  return (bits & sign) ? -int64_t(bits & (sign - 1)) : int64_t(bits);
}

}  // namespace

void compare_rows(GgmlType t, const uint8_t* a, const uint8_t* b, int64_t n_rows, int64_t row_elems, TensorDiff& d) {
  const size_t rb = ggml_row_bytes(t, row_elems);
  std::vector<float> fa(static_cast<size_t>(row_elems));
  std::vector<float> fb(static_cast<size_t>(row_elems));
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* ra = a + r * rb;
    const uint8_t* rb_ = b + r * rb;
    dequantize_row(t, ra, fa.data(), row_elems);
    dequantize_row(t, rb_, fb.data(), row_elems);
    for (int64_t i = 0; i < row_elems; ++i) {
      d.elements++;
      int64_t ulp = 0;
      if (t == GgmlType::F16 || t == GgmlType::BF16) {
        uint16_t x, y;
        std::memcpy(&x, ra + 2 * i, 2);
        std::memcpy(&y, rb_ + 2 * i, 2);
        ulp = std::llabs(ordered(x, 16) - ordered(y, 16));
      } else if (t == GgmlType::F32) {
        ulp = std::llabs(ordered(f32_bits(fa[size_t(i)]), 32) - ordered(f32_bits(fb[size_t(i)]), 32));
      } else if (t == GgmlType::Q8_0) {
        const int64_t blk = i / 32, j = i % 32;
        ulp = std::abs(int(int8_t(ra[blk * 34 + 2 + j])) - int(int8_t(rb_[blk * 34 + 2 + j])));
        uint16_t da, db;
        std::memcpy(&da, ra + blk * 34, 2);
        std::memcpy(&db, rb_ + blk * 34, 2);
        if (da != db) ulp = std::max<int64_t>(ulp, 1);
      } else {
        ulp = fa[size_t(i)] == fb[size_t(i)] ? 0 : 1;
      }
      if (fa[size_t(i)] == fb[size_t(i)] && (ulp == 0 || t == GgmlType::Q4_0)) d.identical++;
      d.max_ulp = std::max(d.max_ulp, ulp);
      for (int w = 0; w < 3; ++w) d.within_ulp[w] += ulp <= (int64_t(1) << w);
      const double diff = double(fa[size_t(i)]) - double(fb[size_t(i)]);
      d.max_abs = std::max(d.max_abs, std::fabs(diff));
      d.sum_sq_diff += diff * diff;
      d.sum_sq_ref += double(fa[size_t(i)]) * double(fa[size_t(i)]);
    }
  }
}

StateDiff diff_states(const ParsedState& a, const ParsedState& b, int first_layers) {
  StateDiff d;
  d.same_tokens = a.tokens == b.tokens;
  const auto &la = a.layout, &lb = b.layout;
  if (la.n_layer() != lb.n_layer() || la.v_trans != lb.v_trans || a.cell_count != b.cell_count) {
    d.same_layout = false;
    d.layout_note = fmt::format("A: {} ({} cells) / B: {} ({} cells)", la.describe(), a.cell_count, lb.describe(), b.cell_count);
    return d;
  }
  const uint32_t nl = first_layers > 0 ? std::min<uint32_t>(uint32_t(first_layers), la.n_layer()) : la.n_layer();
  for (uint32_t l = 0; l < nl; ++l) {
    const auto &A = la.layers[l], &B = lb.layers[l];
    if (A.k_type != B.k_type || A.v_type != B.v_type || A.k_row_bytes != B.k_row_bytes || A.v_row_bytes != B.v_row_bytes) {
      d.same_layout = false;
      d.layout_note = fmt::format("layer {} types differ", l);
      return d;
    }
    TensorDiff k{fmt::format("layer {} K", l)};
    compare_rows(A.k_type, a.k_data[l], b.k_data[l], a.cell_count, A.n_embd_k, k);
    d.tensors.push_back(k);
    if (!A.has_v()) continue;  // MLA: the K row is the whole cache
    TensorDiff v{fmt::format("layer {} V", l)};
    if (!la.v_trans) compare_rows(A.v_type, a.v_data[l], b.v_data[l], a.cell_count, A.n_embd_v, v);
    else compare_rows(A.v_type, a.v_data[l], b.v_data[l], 1, int64_t(A.n_embd_v) * a.cell_count, v);  // element-major, same order in both
    d.tensors.push_back(v);
  }
  return d;
}

}  // namespace pdb
