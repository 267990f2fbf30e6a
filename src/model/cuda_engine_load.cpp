// The loaders from an HF checkpoint to device memory (model/cuda_engine_load.h).
#include "model/cuda_engine_load.h"

#include <cuda_bf16.h>

#include <cstring>
#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "common/parallel.h"
#include "formats/ggml_types.h"
#include "formats/numeric.h"
#include "formats/weight_source.h"
#include "cuda/dequant.cuh"
#include "model/tensor_parallel.h"

namespace pdb {

using cuda::DeviceBuffer;

namespace cuda_load {

namespace {
std::vector<uint16_t> rounded_to_bf16(const float* w, int64_t n, int threads, bool half = false) {
  std::vector<uint16_t> out(static_cast<size_t>(n));
  parallel_for(n, threads, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[size_t(i)] = half ? f32_to_fp16(w[i]) : f32_to_bf16(w[i]);
  });
  return out;
}
}  // namespace

// HF tensor -> bf16 bytes (bf16 as is; f32/f16 rounded; block FP8 dequantized with its scales).
std::vector<uint16_t> to_bf16(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::string& name, int64_t rows, int64_t cols,
                              int threads) {
  const StTensor& t = ck.get(name);
  if (t.shape.size() != 2 || t.shape[0] != rows || t.shape[1] != cols)
    throw std::runtime_error(fmt::format("{}: shape does not match config.json ({} x {})", name, rows, cols));
  std::vector<uint16_t> out(size_t(rows * cols));
  const int64_t n = rows * cols;
  switch (t.dtype) {
    case StDtype::BF16: std::memcpy(out.data(), t.data, size_t(n) * 2); break;
    case StDtype::F16:
      parallel_for(n, threads, [&](int64_t b, int64_t e) {
        const auto* s = reinterpret_cast<const uint16_t*>(t.data);
        for (int64_t i = b; i < e; ++i) out[size_t(i)] = f32_to_bf16(fp16_to_f32(s[i]));
      });
      break;
    case StDtype::F32: out = rounded_to_bf16(reinterpret_cast<const float*>(t.data), n, threads); break;
    case StDtype::F8_E4M3: {
      const std::string sname = name.substr(0, name.size() - 6) + "weight_scale_inv";
      if (!ck.find(sname)) throw std::runtime_error(name + " is FP8 but " + sname + " is missing");
      auto s = ck.to_f32(sname);
      std::vector<float> w(static_cast<size_t>(n));
      dequantize_block_fp8(t.data, rows, cols, s.data(), c.fp8_block_rows, c.fp8_block_cols, w.data());
      out = rounded_to_bf16(w.data(), n, threads);
      break;
    }
    default: throw std::runtime_error(fmt::format("{}: dtype {} not supported by the CUDA engine", name, st_dtype_name(t.dtype)));
  }
  return out;
}

DeviceBuffer upload_f32(const std::vector<float>& v) {
  DeviceBuffer b(v.size() * 4);
  b.upload(v.data(), v.size() * 4);
  return b;
}

// Uploads tensors stacked along their output dimension into one bf16 buffer.
DeviceBuffer upload_stacked(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::vector<std::pair<std::string, int64_t>>& parts,
                            int64_t cols, int threads, size_t& total) {
  int64_t rows = 0;
  for (const auto& p : parts) rows += p.second;
  DeviceBuffer b(size_t(rows * cols) * 2);
  size_t off = 0;
  for (const auto& [name, r] : parts) {
    auto w = to_bf16(ck, c, name, r, cols, threads);
    b.upload(w.data(), w.size() * 2, off);
    off += w.size() * 2;
  }
  total += b.bytes();
  return b;
}

DeviceBuffer upload_sliced(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::vector<RowSlice>& parts, int64_t full_cols,
                           int64_t col0, int64_t cols, int threads, size_t& total) {
  int64_t rows = 0;
  for (const auto& p : parts) rows += p.rows;
  DeviceBuffer b(size_t(rows * cols) * 2);
  size_t off = 0;
  for (const auto& p : parts) {
    auto w = rows_of(to_bf16(ck, c, p.name, p.full_rows, full_cols, threads), full_cols, p.row0, p.rows);
    if (cols != full_cols) w = cols_of(w, p.rows, full_cols, col0, cols);
    b.upload(w.data(), w.size() * 2, off);
    off += w.size() * 2;
  }
  total += b.bytes();
  return b;
}

// weight_scale_inv: w = code * scale.
void upload_sliced_fp8(const SafetensorsCheckpoint& ck, const std::vector<RowSlice>& parts, int64_t full_cols, int64_t col0, int64_t cols,
                       const cuda::Fp8ScaleLayout& L, DeviceBuffer& w, DeviceBuffer& scales, size_t& total) {
  if (col0 % 128 || cols % 128) throw std::invalid_argument("FP8 weights are sliced on 128-column blocks");
  int64_t rows = 0;
  for (const auto& p : parts) {
    if (p.row0 % 128 || p.rows % 128) throw std::invalid_argument(p.name + ": FP8 weights are sliced on 128-row blocks");
    rows += p.rows;
  }
  const int64_t FKB = full_cols / 128, KB = cols / 128, kb0 = col0 / 128, NB = rows / 128;
  w.resize(size_t(rows * cols));
  std::vector<float> grid(size_t(L.weight_scale_count(NB, KB)), 0.0f);
  size_t off = 0;
  int64_t nb0 = 0;
  for (const auto& p : parts) {
    const StTensor& t = ck.get(p.name);
    if (t.dtype != StDtype::F8_E4M3 || t.shape.size() != 2 || t.shape[0] != p.full_rows || t.shape[1] != full_cols)
      throw std::runtime_error(fmt::format("{}: expected F8_E4M3 [{} x {}]", p.name, p.full_rows, full_cols));
    const auto* codes = static_cast<const uint8_t*>(t.data);
    std::vector<uint8_t> slice(size_t(p.rows * cols));
    for (int64_t r = 0; r < p.rows; ++r) std::memcpy(&slice[size_t(r * cols)], codes + (p.row0 + r) * full_cols + col0, size_t(cols));
    w.upload(slice.data(), slice.size(), off);
    off += slice.size();
    const auto s = ck.to_f32(p.name.substr(0, p.name.size() - 6) + "weight_scale_inv");
    if (int64_t(s.size()) != (p.full_rows / 128) * FKB) throw std::runtime_error(p.name + ": weight_scale_inv does not hold one scale per 128x128 block");
    for (int64_t nb = 0; nb < p.rows / 128; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb)
        grid[size_t(L.weight_index(nb0 + nb, kb, NB, KB))] = s[size_t((p.row0 / 128 + nb) * FKB + kb0 + kb)];
    nb0 += p.rows / 128;
  }
  scales.resize(grid.size() * 4);
  scales.upload(grid.data(), grid.size() * 4);
  total += w.bytes() + scales.bytes();
}

namespace {
bool float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

// A GGUF weight as resident bf16 (or half): its float tensors, and kv_b_proj (rebuilt from two tensors).
DeviceBuffer gguf_resident(const CudaLoad& ld, const std::vector<RowSlice>& parts, int64_t cols, size_t& total, bool half) {
  int64_t rows = 0;
  for (const auto& p : parts) rows += p.rows;
  DeviceBuffer b(size_t(rows * cols) * 2);
  size_t off = 0;
  for (const auto& p : parts) {
    const auto w = ld.gguf->matrix(p.name, p.rows, cols);
    const auto h = rounded_to_bf16(w.data(), int64_t(w.size()), ld.threads, half);
    b.upload(h.data(), h.size() * 2, off);
    off += h.size() * 2;
  }
  total += b.bytes();
  return b;
}
}  // namespace

namespace {
// One product's rounding for a weight whose parts may differ in type: the largest part's (a Q4_K_M q|k|v is
// q4_K, q4_K, q6_K: one activation type under every mode). Parts that disagree are named in the log.
WeightProducts products_of(const CudaLoad& ld, const std::vector<RowSlice>& parts, int64_t cols) {
  WeightProducts p;
  int64_t largest = -1;
  std::vector<std::string> differ;
  for (const auto& part : parts) {
    const WeightProducts q = weight_products(ld.numerics, ld.gguf->storage_type(part.name));
    if (largest >= 0 && !(q == p)) differ.push_back(part.name);
    if (part.rows > largest) { p = q; largest = part.rows; }
  }
  if (!differ.empty())
    spdlog::warn("cuda engine: {} fused with weights of another activation type: its product takes the largest part's ({} values, {})",
                 differ.front(), cols, p.act_block ? fmt::format("q8 blocks of {}", p.act_block) : std::string("no quantization"));
  return p;
}
}  // namespace

CudaWeight weight(const CudaLoad& ld, int64_t layer, const std::vector<RowSlice>& parts, int64_t full_cols, int64_t col0, int64_t cols,
                  size_t& total, bool follow_decoder) {
  if (ld.ck) return upload_sliced(*ld.ck, ld.c, parts, full_cols, col0, cols, ld.threads, total);
  if (col0 != 0 || cols != full_cols) throw std::logic_error("a GGUF's weights are not sliced (tensor parallel reads checkpoints)");
  bool quantized = false;
  for (const auto& p : parts) {
    if (p.row0 != 0 || p.rows != p.full_rows) throw std::logic_error("a GGUF's weights are not sliced (tensor parallel reads checkpoints)");
    quantized |= !float_type(ld.gguf->storage_type(p.name));
  }
  const WeightProducts products = follow_decoder ? products_of(ld, parts, cols) : WeightProducts{};
  auto resident = [&] {
    CudaWeight w = gguf_resident(ld, parts, cols, total, products.half);
    w.set_products(products);
    return w;
  };
  if (!quantized || !ld.quant) return resident();
  std::vector<RawRows> raw;
  for (const auto& p : parts) {
    auto r = ld.gguf->raw_rows(p.name, p.rows, cols);
    if (!r) return resident();  // a weight the source rebuilds (deepseek2's kv_b_proj)
    raw.push_back(std::move(*r));
  }
  std::vector<CudaQuantStore::Part> qp;
  for (size_t i = 0; i < parts.size(); ++i) qp.push_back({raw[i].type, raw[i].bytes.data(), parts[i].rows, cols});
  CudaWeight w = ld.quant->add(layer, qp, products.half);
  w.set_products(products);
  total += w.bytes();
  return w;
}

std::vector<float> vector(const CudaLoad& ld, const std::string& name, int64_t n) {
  auto v = ld.ck ? ld.ck->to_f32(name) : ld.gguf->vector(name, n);
  if (int64_t(v.size()) != n) throw std::runtime_error(fmt::format("{}: {} values, expected {}", name, v.size(), n));
  return v;
}

}  // namespace cuda_load

}  // namespace pdb
