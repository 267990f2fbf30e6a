#include "model/cpu_blocks.h"

#include <cblas.h>

#include <stdexcept>

#include <fmt/format.h>

#include "formats/numeric.h"
#include "numerics/gemm_lanes.h"

namespace pdb {

std::unique_ptr<CpuAttention> make_gqa_attention_cpu(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, int64_t layer);
std::unique_ptr<CpuAttention> make_mla_attention_cpu(const WeightSource& ws, const HfConfig& c, int64_t layer);

std::unique_ptr<CpuAttention> load_cpu_attention(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, int64_t layer) {
  switch (d.attention) {
    case AttentionKind::gqa: return make_gqa_attention_cpu(d, ws, c, layer);
    case AttentionKind::mla: return make_mla_attention_cpu(ws, c, layer);
  }
  throw std::logic_error("load_cpu_attention: unknown attention kind");
}

static void cpu_matmul_rounded(const CpuPass& p, const float* x, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, float* y,
                               ggmlnum::ActQuant aq);

std::vector<float> cpu_q8_1_mins(const WeightSource& ws, const std::string& name, int64_t rows, int64_t cols) {
  if (!ggmlnum::carries_q8_1_sums(ws.storage_type(name))) return {};
  const auto raw = ws.raw_rows(name, rows, cols);  // HF's row order, as matrix()
  if (!raw) return {};
  return ggmlnum::q8_1_block_mins(raw->type, raw->bytes.data(), rows, cols);
}

void cpu_matmul(const CpuPass& p, const float* x, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, float* y,
                ggmlnum::ActQuant aq, const std::vector<float>* q8_1_mins) {
  std::vector<float> corrections;  // Q4_1/Q5_1: from the activations before their rounding
  if (q8_1_mins && !q8_1_mins->empty() && aq != ggmlnum::ActQuant::none && p.quantize_activations) {
    corrections.resize(size_t(rows * (in / 32)));
    ggmlnum::q8_1_sum_corrections(x, rows, in, corrections.data());
  }
  cpu_matmul_rounded(p, x, w, rows, in, out, y, aq);
  if (!corrections.empty())  // y += c m^T, ggml-cpu's mins' term
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(out), int(in / 32), 1.0f, corrections.data(), int(in / 32),
                q8_1_mins->data(), int(in / 32), 1.0f, y, int(out));
}

static void cpu_matmul_rounded(const CpuPass& p, const float* x, const std::vector<float>& w, int64_t rows, int64_t in, int64_t out, float* y,
                               ggmlnum::ActQuant aq) {
  if (aq != ggmlnum::ActQuant::none && p.quantize_activations) {
    std::vector<float>& xr = p.scratch->rounded;
    xr.assign(x, x + rows * in);
    ggmlnum::round_through(aq, xr.data(), rows, in);
    x = xr.data();
  } else if (p.act_precision != 32) {
    std::vector<float>& xr = p.scratch->rounded;
    xr.assign(x, x + rows * in);
    for (auto& e : xr) e = p.act_precision == 16 ? round_f16(e) : round_bf16(e);
    x = xr.data();
  }
  if (p.lanes && in % p.lanes == 0) return gemm_lanes(x, w.data(), y, rows, out, in, p.lanes, p.threads);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(out), int(in), 1.0f, x, int(in), w.data(), int(in), 0.0f, y, int(out));
}

}  // namespace pdb
