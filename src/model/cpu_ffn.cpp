// The CPU engine's FFN blocks: a SwiGLU (dense layers, or deepseek2's shared experts), the routed experts
// (model/moe_ffn.h), and both summed (deepseek2's MoE layers: llama.cpp adds the shared experts' output to the
// routed one).
#include <cmath>
#include <memory>

#include <fmt/format.h>

#include "model/cpu_blocks.h"
#include "model/moe_ffn.h"
#include "numerics/decoder_numerics.h"

namespace pdb {
namespace {

class SwigluFfnCpu final : public CpuFfn {
 public:
  SwigluFfnCpu(const WeightSource& ws, const HfConfig& c, const std::string& prefix, int64_t width)
      : hidden_(c.hidden_size), ff_(width) {
    wg_ = ws.matrix(prefix + "gate_proj.weight", ff_, hidden_);
    wu_ = ws.matrix(prefix + "up_proj.weight", ff_, hidden_);
    wd_ = ws.matrix(prefix + "down_proj.weight", hidden_, ff_);
    for (int i = 0; i < 3; ++i)
      aq_[i] = ggmlnum::act_quant_for(ws.storage_type(prefix + (i == 0 ? "gate" : i == 1 ? "up" : "down") + "_proj.weight"));
    mins_[0] = cpu_q8_1_mins(ws, prefix + "gate_proj.weight", ff_, hidden_);
    mins_[1] = cpu_q8_1_mins(ws, prefix + "up_proj.weight", ff_, hidden_);
    mins_[2] = cpu_q8_1_mins(ws, prefix + "down_proj.weight", hidden_, ff_);
  }
  void forward(const float* x, int64_t n, const CpuPass& p, float* out) override {
    std::vector<float>& g = p.scratch->g;
    std::vector<float>& u = p.scratch->u;
    g.resize(size_t(n * ff_));
    u.resize(size_t(n * ff_));
    cpu_matmul(p, x, wg_, n, hidden_, ff_, g.data(), aq_[0], &mins_[0]);
    cpu_matmul(p, x, wu_, n, hidden_, ff_, u.data(), aq_[1], &mins_[1]);
    if (p.faithful) ggmlnum::swiglu(n, ff_, g.data(), g.data(), u.data(), p.lanes);
    else for (size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    cpu_matmul(p, g.data(), wd_, n, ff_, hidden_, out, aq_[2], &mins_[2]);
  }
  bool accepts_lanes(int lanes) const override { return hidden_ % lanes == 0 && ff_ % lanes == 0; }
  void round_weights(const WeightRounding& round) override {
    for (auto* w : {&wg_, &wu_, &wd_}) round(*w);
  }

 private:
  int64_t hidden_, ff_;
  std::vector<float> wg_, wu_, wd_;  // HF layout [out x in]
  ggmlnum::ActQuant aq_[3] = {};     // gate, up, down: the activations as ggml-cpu quantizes them for each weight's type
  std::vector<float> mins_[3];       // Q4_1/Q5_1 weights' block mins (cpu_matmul)
};

class RoutedFfnCpu final : public CpuFfn {
 public:
  RoutedFfnCpu(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, const std::string& prefix) {
    auto& m = w_;
    m.n_expert = c.num_experts; m.n_used = c.num_experts_per_tok; m.hidden = c.hidden_size; m.ff = c.moe_intermediate_size;
    m.norm_topk = d.renormalize_topk(c);
    m.w_scale = float(c.routed_scaling_factor);
    m.router = ws.matrix(prefix + "gate.weight", m.n_expert, m.hidden);
    for (int64_t e = 0; e < m.n_expert; ++e) {
      const std::string x = fmt::format("{}experts.{}.", prefix, e);
      m.gate.push_back(ws.matrix(x + "gate_proj.weight", m.ff, m.hidden));
      m.up.push_back(ws.matrix(x + "up_proj.weight", m.ff, m.hidden));
      m.down.push_back(ws.matrix(x + "down_proj.weight", m.hidden, m.ff));
    }
  }
  void forward(const float* x, int64_t n, const CpuPass& p, float* out) override {
    moe_ffn(w_, x, n, p.faithful ? p.lanes : 0, p.act_precision, p.threads, out);
  }
  bool accepts_lanes(int) const override { return true; }
  void round_weights(const WeightRounding& round) override {
    round(w_.router);  // an F32 tensor in the GGUF, holding the checkpoint's (rounded) values
    for (auto* set : {&w_.gate, &w_.up, &w_.down})
      for (auto& w : *set) round(w);
  }

 private:
  MoeWeights w_;
};

class SharedAndRoutedFfnCpu final : public CpuFfn {
 public:
  SharedAndRoutedFfnCpu(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, const std::string& layer_prefix,
                        const FfnPlan& plan)
      : hidden_(c.hidden_size), shared_(ws, c, layer_prefix + plan.swiglu_prefix, plan.swiglu_width), routed_(d, ws, c, layer_prefix + "mlp.") {}
  void forward(const float* x, int64_t n, const CpuPass& p, float* out) override {
    shared_.forward(x, n, p, out);
    std::vector<float>& y = p.scratch->y;
    y.resize(size_t(n * hidden_));
    routed_.forward(x, n, p, y.data());
    for (size_t i = 0; i < y.size(); ++i) out[i] = y[i] + out[i];  // moe_out + shexp
  }
  bool accepts_lanes(int lanes) const override { return shared_.accepts_lanes(lanes); }
  void round_weights(const WeightRounding& round) override {
    shared_.round_weights(round);
    routed_.round_weights(round);
  }

 private:
  int64_t hidden_;
  SwigluFfnCpu shared_;
  RoutedFfnCpu routed_;
};

}  // namespace

std::unique_ptr<CpuFfn> load_cpu_ffn(const ModelDefinition& d, const WeightSource& ws, const HfConfig& c, int64_t layer) {
  const FfnPlan plan = d.ffn(c, layer);
  const std::string p = fmt::format("model.layers.{}.", layer);
  switch (plan.kind) {
    case FfnKind::swiglu: return std::make_unique<SwigluFfnCpu>(ws, c, p + plan.swiglu_prefix, plan.swiglu_width);
    case FfnKind::routed: return std::make_unique<RoutedFfnCpu>(d, ws, c, p + "mlp.");
    case FfnKind::shared_and_routed: return std::make_unique<SharedAndRoutedFfnCpu>(d, ws, c, p, plan);
  }
  throw std::logic_error("load_cpu_ffn: unknown FFN kind");
}

}  // namespace pdb
