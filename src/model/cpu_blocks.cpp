#include "model/cpu_blocks.h"

#include <cblas.h>

#include <stdexcept>

#include <fmt/format.h>

#include "formats/ggml_types.h"
#include "formats/numeric.h"
#include "formats/safetensors.h"
#include "numerics/gemm_lanes.h"

namespace pdb {

std::unique_ptr<CpuAttention> make_gqa_attention_cpu(const ModelDefinition& d, const SafetensorsCheckpoint& ck, const HfConfig& c, int64_t layer);
std::unique_ptr<CpuAttention> make_mla_attention_cpu(const SafetensorsCheckpoint& ck, const HfConfig& c, int64_t layer);

std::unique_ptr<CpuAttention> load_cpu_attention(const ModelDefinition& d, const SafetensorsCheckpoint& ck, const HfConfig& c, int64_t layer) {
  switch (d.attention) {
    case AttentionKind::gqa: return make_gqa_attention_cpu(d, ck, c, layer);
    case AttentionKind::mla: return make_mla_attention_cpu(ck, c, layer);
  }
  throw std::logic_error("load_cpu_attention: unknown attention kind");
}

std::vector<float> load_matrix(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::string& name, int64_t rows, int64_t cols) {
  const StTensor& t = ck.get(name);
  if (t.shape.size() != 2 || t.shape[0] != rows || t.shape[1] != cols)
    throw std::runtime_error(fmt::format("{}: shape does not match config.json ({} x {})", name, rows, cols));
  if (t.dtype == StDtype::F8_E4M3) {
    const std::string sname = name.substr(0, name.size() - 6) + "weight_scale_inv";
    if (!ck.find(sname)) throw std::runtime_error(name + " is FP8 but " + sname + " is missing");
    auto s = ck.to_f32(sname);
    const int64_t sr = (rows + c.fp8_block_rows - 1) / c.fp8_block_rows, sc = (cols + c.fp8_block_cols - 1) / c.fp8_block_cols;
    if (int64_t(s.size()) != sr * sc) throw std::runtime_error(sname + " has the wrong shape for the block size");
    std::vector<float> w(static_cast<size_t>(rows * cols));
    dequantize_block_fp8(t.data, rows, cols, s.data(), c.fp8_block_rows, c.fp8_block_cols, w.data());
    return w;
  }
  return ck.to_f32(name);
}

std::vector<float> load_vector(const SafetensorsCheckpoint& ck, const std::string& name, int64_t n) {
  auto v = ck.to_f32(name);
  if (int64_t(v.size()) != n) throw std::runtime_error(fmt::format("{}: {} elements, expected {}", name, v.size(), n));
  return v;
}

void cpu_matmul(const CpuPass& p, const float* x, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, float* y) {
  if (p.act_precision != 32) {
    std::vector<float>& xr = p.scratch->rounded;
    xr.assign(x, x + rows * in);
    for (auto& e : xr) e = p.act_precision == 16 ? round_f16(e) : round_bf16(e);
    x = xr.data();
  }
  if (p.lanes && in % p.lanes == 0) return gemm_lanes(x, w.data(), y, rows, out, in, p.lanes, p.threads);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(out), int(in), 1.0f, x, int(in), w.data(), int(in), 0.0f, y, int(out));
}

}  // namespace pdb
