#include "tools/bench_prefill.h"

#include "arch/architectures.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "common/parallel.h"
#include "cuda/device.h"
#include "formats/weight_source.h"
#include "prefill/backend.h"
#include "prefill/capture.h"

namespace pdb {
using json = nlohmann::json;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The FLOP a prompt costs on this model: the parameters one token meets in an average layer (MoE: the router and the
// experts it uses, shared ones included; MLA: its q, kv_a, kv_b and o products), and the causal attention's products.
struct ModelCost {
  double layer_params = 0;
  double NH = 0, DK = 0, DV = 0;  // heads; score and value widths per head

  explicit ModelCost(const HfConfig& c) : NH(double(c.num_heads)), DK(double(c.head_dim)), DV(double(c.head_dim)) {
    const double H = double(c.hidden_size), F = double(c.intermediate_size), D = double(c.head_dim), KV = double(c.num_kv_heads),
                 L = double(c.num_layers);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      double attn = H * (NH + 2 * KV) * D + NH * D * H;
      if (c.mla()) {
        DK = double(c.qk_nope_head_dim + c.qk_rope_head_dim);
        DV = double(c.v_head_dim);
        const double q = c.q_lora_rank ? H * c.q_lora_rank + double(c.q_lora_rank) * NH * DK : H * NH * DK;
        attn = q + H * double(c.kv_lora_rank + c.qk_rope_head_dim) + double(c.kv_lora_rank) * NH * (c.qk_nope_head_dim + DV) + NH * DV * H;
      }
      double ffn = 3 * H * F;
      if (c.moe() && !(c.mla() && l < c.first_k_dense_replace))
        ffn = H * double(c.num_experts) + 3 * H * double(c.moe_intermediate_size) * double(c.num_experts_per_tok + c.n_shared_experts);
      layer_params += (attn + ffn) / L;
    }
  }
  // causal attention: QK^T and PV over T^2/2 (query, key) pairs per head and layer, 2 FLOP per pair and dimension of each
  double attention(double T, double layers) const { return T * T * NH * (DK + DV) * layers; }
  double products(double T, double layers) const { return 2.0 * layer_params * layers * T; }
};

// One timed mode. engine+recipe: the GPU recipe's rows reach host memory in the decoder's format (the recipe's cost);
// +frames: and are framed for the wire (checksums and copies on the host). On the GPU, engine-no-attention leaves the
// attention kernels out (its output is not a model's): the difference from `engine` is the attention's own time,
// reported below the modes.
struct Mode {
  std::string name;
  double layers;
  bool attention = true;
};

class PrefillBench {
 public:
  explicit PrefillBench(const BenchPrefillOptions& o)
      : o_(o), bo_{.model = o.model, .recipe = o.recipe, .device = o.device, .kv_dtype = o.kv_dtype,
                   .threads = o.threads > 0 ? o.threads : default_threads(), .chunk = o.chunk, .tp = o.tp, .tp_one_gpu = o.tp_one_gpu,
                   .max_gpu_mem_gib = o.max_gpu_mem_gib, .kv_rows = o.kv_rows, .numerics = o.numerics},
        context_bytes_(o.device == "cuda" ? cuda::device_bytes_in_use() : 0),  // before any allocation: the CUDA context
        arch_(read_recipe_info(*GgufFile::open(o.recipe)).arch),
        numerics_(arch_ == "deepseek4" ? "bf16" : product_numerics_name(resolve_numerics(bo_))),  // "auto" as resolved
        be_(architecture(arch_).make_backend(bo_)),
        chunk_(o.chunk > 0 ? o.chunk : be_->preferred_chunk() > 0 ? be_->preferred_chunk() : 4096),
        loaded_bytes_(cuda::device_bytes_in_use()),
        cost_(be_->config()),
        gemm_rate_(o.device == "cuda" ? cuda::measure_bf16_gemm_tflops() : 0.0),
        seed_(o.seed ? o.seed : uint64_t(std::chrono::system_clock::now().time_since_epoch().count())),
        out_(o.out, std::ios::app) {
    const auto ctype = ggml_type_from_name(o.cache_type);
    if (!ctype) throw std::invalid_argument("--cache-type: unknown type " + o.cache_type);
    spec_ = CacheSpec::decoder_default(*ctype, *ctype, be_->info().head_dim);
  }

  void run() {
    const auto& c = be_->config();
    std::printf("# pdbridge bench prefill: %s, %s, %s; chunk %lld; cache %s; bf16 GEMM rate measured now: %.0f TFLOP/s\n", be_->device().c_str(),
                c.arch.c_str(), o_.model.c_str(), (long long)chunk_, o_.cache_type.c_str(), gemm_rate_);
    if (!be_->weights().empty()) std::printf("# weights: %s\n", be_->weights().c_str());
    std::printf("%-8s %-22s %10s %12s %10s %10s\n", "tokens", "mode", "seconds", "tok/s", "TFLOP/s", "of GEMM");
    for (int64_t T : o_.tokens) {
      be_->check_fits(T, chunk_);
      // Warm-up: plans, handles, the engine's K/V allocation at this size, and a capture (pinned and host pages of
      // the row path first touched).
      be_->forward_only(prompt(T), chunk_, true);
      be_->capture(prompt(T), chunk_, spec_, [](const KvBlock&) { return true; }, {});
      std::map<std::string, double> median_s;
      for (const Mode& m : modes()) median_s[m.name] = run_mode(T, m);
      if (o_.device == "cuda" && is_gguf_path(o_.model) && !c.mla()) report_memory(T);
      if (median_s.count("engine-no-attention")) report_attention_share(T, median_s["engine"], median_s["engine-no-attention"]);
    }
  }

 private:
  // A fresh random prompt per run (vary: of a fresh length, --vary-lengths).
  std::vector<int32_t> prompt(int64_t T, bool vary = false) {
    std::mt19937_64 g(seed_++);
    const int64_t n = T - (vary && o_.vary_lengths > 0 ? int64_t(g() % uint64_t(o_.vary_lengths)) : 0);
    std::vector<int32_t> t(static_cast<size_t>(std::max<int64_t>(n, 1)));
    for (auto& x : t) x = int32_t(g() % uint64_t(be_->config().vocab_size));
    return t;
  }

  std::vector<Mode> modes() const {
    const double L = double(be_->config().num_layers);
    std::vector<Mode> modes = {Mode{"full-forward", L}, Mode{"engine", L - 1}};
    if (o_.device == "cuda") modes.push_back(Mode{"engine-no-attention", L - 1, false});
    modes.push_back(Mode{"engine+recipe", L - 1});
    modes.push_back(Mode{"engine+recipe+frames", L - 1});
    if (!o_.modes.empty())
      std::erase_if(modes, [&](const Mode& m) { return std::find(o_.modes.begin(), o_.modes.end(), m.name) == o_.modes.end(); });
    return modes;
  }

  // One prompt through mode m: its seconds; bytes gets what reached the host (the rows, or the frames).
  double time_one(const Mode& m, std::vector<int32_t> toks, int64_t& bytes) {
    if (m.name == "engine+recipe") {
      bytes = 0;
      return seconds([&] {
        be_->capture(toks, chunk_, spec_, [&](const KvBlock& b) { bytes += int64_t(b.k_bytes + b.v_bytes); return true; }, {});
      });
    }
    if (m.name == "engine+recipe+frames") {
      wire::PrefillRequest req;
      req.tokens = std::move(toks);
      req.fingerprint = recipe_fingerprint(be_->info());
      req.k_type = spec_.k_type; req.v_type = spec_.v_type; req.rot_k = spec_.rot_k; req.rot_v = spec_.rot_v;
      req.simd_width = host_simd_width() ? host_simd_width() : 8;
      CaptureResult cr;
      bytes = 0;
      const double t = seconds([&] {
        cr = run_capture(*be_, req, chunk_, EmitFn([&](wire::Bytes&& f, bool) { bytes += int64_t(f.size()); return Emit::Ok; }));
      });
      if (cr.status != "complete") throw std::runtime_error("capture " + cr.status + ": " + cr.reason);
      return t;
    }
    if (!m.attention) return seconds([&] { be_->forward_only(toks, chunk_, false, true); });
    return seconds([&] { be_->forward_only(toks, chunk_, m.name == "full-forward"); });
  }

  // --reps prompts through mode m: a line and a row; returns the median seconds.
  double run_mode(int64_t T, const Mode& m) {
    std::vector<double> ts, rates;
    int64_t bytes = 0;
    const int64_t plans_before = cuda::attention_plans_built();
    const cuda::ReadbackTotals rb_before = cuda::readback_totals();
    for (int r = 0; r < o_.reps; ++r) {
      auto toks = prompt(T, true);
      const double n = double(toks.size());
      ts.push_back(time_one(m, std::move(toks), bytes));
      rates.push_back(n / ts.back());
    }
    const int64_t plans = cuda::attention_plans_built() - plans_before;
    const double t = median(ts), tok_s = median(rates);
    const double flops = cost_.products(double(T), m.layers) + (m.attention ? cost_.attention(double(T), m.layers) : 0.0);
    const double tflops = flops / double(T) * tok_s / 1e12;  // the prompts' mean length is about T where they vary
    std::printf("%-8lld %-22s %10.3f %12.0f %10.1f %9.0f%%%s\n", (long long)T, m.name.c_str(), t, tok_s, tflops,
                gemm_rate_ > 0 ? 100.0 * tflops / gemm_rate_ : 0.0, plans ? fmt::format("  ({} attention plans built)", plans).c_str() : "");
    report_readbacks(rb_before);
    std::fflush(stdout);
    const auto& c = be_->config();
    json row = {{"label", o_.label}, {"device", be_->device()}, {"weights", be_->weights()}, {"tp", o_.tp}, {"kv_rows", o_.kv_rows},
                {"numerics", numerics_}, {"attention", o_.device == "cuda" ? cuda::attention_kernel_summary() : "cpu"}, {"tp_one_gpu", o_.tp_one_gpu},
                {"arch", c.arch}, {"model", o_.model}, {"tokens", T}, {"mode", m.name}, {"chunk", chunk_}, {"cache_type", o_.cache_type},
                {"seconds_median", t}, {"seconds_all", ts}, {"tok_s", tok_s}, {"vary_lengths", o_.vary_lengths}, {"attention_plans_built", plans},
                {"tflops", tflops}, {"gemm_tflops", gemm_rate_}, {"wire_bytes", bytes},
                // the engine's buffers grow and stay: what the device holds after the runs is their peak
                {"gpu_gib_loaded", double(loaded_bytes_) / double(1 << 30)}, {"gpu_gib_in_use", double(cuda::device_bytes_in_use()) / double(1 << 30)}};
    out_ << row.dump() << "\n";
    return t;
  }

  // PDBRIDGE_CAPTURE_STATS=1: the MoE's per-layer reads of its expert counts, per prompt.
  void report_readbacks(const cuda::ReadbackTotals& before) const {
    const cuda::ReadbackTotals rb = cuda::readback_totals();
    if (rb.syncs <= before.syncs) return;
    const double n = double(o_.reps), syncs = double(rb.syncs - before.syncs);
    std::printf("#        readbacks: %.0f per prompt; the GPU idle after each %.1f us (%.2f ms per prompt); the host waited %.2f ms per prompt\n",
                syncs / n, 1e3 * (rb.gpu_idle_ms - before.gpu_idle_ms) / syncs, (rb.gpu_idle_ms - before.gpu_idle_ms) / n,
                (rb.host_wait_ms - before.host_wait_ms) / n);
  }

  // issue 35's memory target: the GGUF's size plus the caches (the engine's own K/V at T, as it keeps them), +10%
  void report_memory(int64_t T) {
    const auto& c = be_->config();
    const double gib = double(1 << 30), file = double(std::filesystem::file_size(o_.model)) / gib;
    const double kv = 2.0 * double(c.num_layers - 1) * double(c.num_kv_heads) * double(c.head_dim) * double(T) *
                      (o_.kv_dtype == "fp8" ? 1.0 + 4.0 / double(c.head_dim) : 2.0) / gib;
    const double in_use = double(cuda::device_bytes_in_use()) / gib;
    const double context = double(context_bytes_) / gib;
    std::printf("#        memory at %lld: %.2f GiB in use (%.2f before any allocation: the CUDA context); the GGUF %.2f GiB + the engine's K/V "
                "%.2f GiB = %.2f GiB (+10%%: %.2f)\n",
                (long long)T, in_use, context, file, kv, file + kv, 1.1 * (file + kv));
    out_ << json{{"label", o_.label}, {"tokens", T}, {"mode", "memory"}, {"gpu_gib_in_use", in_use}, {"context_gib", context}, {"gguf_gib", file},
                 {"engine_kv_gib", kv}}
                .dump()
         << "\n";
  }

  // The attention's own time: the engine's less the engine's without its attention kernels.
  void report_attention_share(int64_t T, double engine_s, double no_attention_s) {
    const double L = double(be_->config().num_layers);
    const double attn_s = engine_s - no_attention_s;
    const double attn_tflops = attn_s > 0 ? cost_.attention(double(T), L - 1) / attn_s / 1e12 : 0.0;
    std::printf("#        attention: %.3f s of the engine's %.3f s (%.0f%%), %.0f TFLOP/s; the rest (products, norms, RoPE): %.0f TFLOP/s\n", attn_s,
                engine_s, 100.0 * attn_s / engine_s, attn_tflops, cost_.products(double(T), L - 1) / no_attention_s / 1e12);
    std::fflush(stdout);
    out_ << json{{"label", o_.label}, {"device", be_->device()}, {"arch", be_->config().arch}, {"tokens", T}, {"mode", "attention-share"},
                 {"chunk", chunk_}, {"attention_seconds", attn_s}, {"engine_seconds", engine_s}, {"attention_tflops", attn_tflops}}
                .dump()
         << "\n";
  }

  const BenchPrefillOptions& o_;
  const BackendOptions bo_;
  const size_t context_bytes_;
  const std::string arch_, numerics_;
  std::unique_ptr<PrefillBackend> be_;
  const int64_t chunk_;  // --chunk, else the backend's own (the server's default), else 4096
  const size_t loaded_bytes_;
  const ModelCost cost_;
  const double gemm_rate_;
  uint64_t seed_;
  std::ofstream out_;
  CacheSpec spec_;
};

}  // namespace

int run_bench_prefill(const BenchPrefillOptions& o) {
  check_kv_dtype(o.device, o.kv_dtype);
  if (o.device != "cuda" && o.device != "cpu") throw std::invalid_argument("--device must be cuda or cpu");
  PrefillBench(o).run();
  return 0;
}

}  // namespace pdb
