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

}  // namespace

int run_bench_prefill(const BenchPrefillOptions& o) {
  const int threads = o.threads > 0 ? o.threads : default_threads();
  check_kv_dtype(o.device, o.kv_dtype);
  if (o.device != "cuda" && o.device != "cpu") throw std::invalid_argument("--device must be cuda or cpu");
  const BackendOptions bo{.model = o.model, .recipe = o.recipe, .device = o.device, .kv_dtype = o.kv_dtype, .threads = threads, .chunk = o.chunk,
                          .tp = o.tp, .tp_one_gpu = o.tp_one_gpu, .max_gpu_mem_gib = o.max_gpu_mem_gib, .kv_rows = o.kv_rows, .numerics = o.numerics};
  // what the device holds before any allocation: the CUDA context (and whatever else runs there), counted below apart
  const size_t context_bytes = o.device == "cuda" ? cuda::device_bytes_in_use() : 0;
  const std::string arch = read_recipe_info(*GgufFile::open(o.recipe)).arch;
  const std::string numerics = arch == "deepseek4" ? "bf16" : product_numerics_name(resolve_numerics(bo));  // "auto" as resolved
  std::unique_ptr<PrefillBackend> be = architecture(arch).make_backend(bo);
  const size_t loaded_bytes = cuda::device_bytes_in_use();
  const auto& c = be->config();
  const double H = double(c.hidden_size), F = double(c.intermediate_size), D = double(c.head_dim), NH = double(c.num_heads),
               KV = double(c.num_kv_heads), L = double(c.num_layers);
  // The parameters one token meets in an average layer (MoE: the router and the experts it uses, shared
  // ones included; MLA: its q, kv_a, kv_b and o products).
  double layer_params = 0;
  double DK = D, DV = D;  // score and value widths per head
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
  // causal attention: QK^T and PV over T^2/2 (query, key) pairs per head and layer, 2 FLOP per pair and dimension of each
  auto attention_flops = [&](double T, double layers) { return T * T * NH * (DK + DV) * layers; };
  const double gemm_rate = o.device == "cuda" ? cuda::measure_bf16_gemm_tflops() : 0.0;
  const auto ctype = ggml_type_from_name(o.cache_type);
  if (!ctype) throw std::invalid_argument("--cache-type: unknown type " + o.cache_type);
  const GgmlType ct = *ctype;
  const CacheSpec spec = CacheSpec::decoder_default(ct, ct, be->info().head_dim);
  uint64_t seed = o.seed ? o.seed : uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  std::ofstream out(o.out, std::ios::app);
  std::printf("# pdbridge bench prefill: %s, %s, %s; chunk %lld; cache %s; bf16 GEMM rate measured now: %.0f TFLOP/s\n", be->device().c_str(),
              c.arch.c_str(), o.model.c_str(), (long long)o.chunk, o.cache_type.c_str(), gemm_rate);
  if (!be->weights().empty()) std::printf("# weights: %s\n", be->weights().c_str());
  std::printf("%-8s %-22s %10s %12s %10s %10s\n", "tokens", "mode", "seconds", "tok/s", "TFLOP/s", "of GEMM");
  for (int64_t T : o.tokens) {
    be->check_fits(T, o.chunk);
    auto prompt = [&](bool vary = false) {  // a fresh random prompt per run (vary: of a fresh length, --vary-lengths)
      std::mt19937_64 g(seed++);
      const int64_t n = T - (vary && o.vary_lengths > 0 ? int64_t(g() % uint64_t(o.vary_lengths)) : 0);
      std::vector<int32_t> t(static_cast<size_t>(std::max<int64_t>(n, 1)));
      for (auto& x : t) x = int32_t(g() % uint64_t(c.vocab_size));
      return t;
    };
    // Warm-up: plans, handles, the engine's K/V allocation at this size, and a capture (pinned and
    // host pages of the row path first touched).
    be->forward_only(prompt(), o.chunk, true);
    be->capture(prompt(), o.chunk, spec, [](const KvBlock&) { return true; }, {});
    struct Mode { std::string name; double layers; bool attention = true; };
    // engine+recipe: the GPU recipe's rows reach host memory in the decoder's format (the recipe's
    // cost); +frames: and are framed for the wire (checksums and copies on the host). On the GPU,
    // engine-no-attention leaves the attention kernels out (its output is not a model's): the
    // difference from `engine` is the attention's own time, reported below the modes.
    std::vector<Mode> modes = {Mode{"full-forward", L}, Mode{"engine", L - 1}};
    if (o.device == "cuda") modes.push_back(Mode{"engine-no-attention", L - 1, false});
    modes.push_back(Mode{"engine+recipe", L - 1});
    modes.push_back(Mode{"engine+recipe+frames", L - 1});
    if (!o.modes.empty())
      std::erase_if(modes, [&](const Mode& m) { return std::find(o.modes.begin(), o.modes.end(), m.name) == o.modes.end(); });
    std::map<std::string, double> median_s;
    for (const Mode& m : modes) {
      std::vector<double> ts, rates;
      int64_t bytes = 0;
      const int64_t plans_before = cuda::attention_plans_built();
      const cuda::ReadbackTotals rb_before = cuda::readback_totals();
      for (int r = 0; r < o.reps; ++r) {
        auto toks = prompt(true);
        const double n = double(toks.size());
        if (m.name == "engine+recipe") {
          bytes = 0;
          ts.push_back(seconds([&] {
            be->capture(toks, o.chunk, spec, [&](const KvBlock& b) { bytes += int64_t(b.k_bytes + b.v_bytes); return true; }, {});
          }));
        } else if (m.name == "engine+recipe+frames") {
          wire::PrefillRequest req;
          req.tokens = std::move(toks);
          req.fingerprint = recipe_fingerprint(be->info());
          req.k_type = spec.k_type; req.v_type = spec.v_type; req.rot_k = spec.rot_k; req.rot_v = spec.rot_v;
          req.simd_width = host_simd_width() ? host_simd_width() : 8;
          CaptureResult cr;
          bytes = 0;
          ts.push_back(seconds([&] {
            cr = run_capture(*be, req, o.chunk, EmitFn([&](wire::Bytes&& f, bool) { bytes += int64_t(f.size()); return Emit::Ok; }));
          }));
          if (cr.status != "complete") throw std::runtime_error("capture " + cr.status + ": " + cr.reason);
        } else if (!m.attention) {
          ts.push_back(seconds([&] { be->forward_only(toks, o.chunk, false, true); }));
        } else {
          ts.push_back(seconds([&] { be->forward_only(toks, o.chunk, m.name == "full-forward"); }));
        }
        rates.push_back(n / ts.back());
      }
      const int64_t plans = cuda::attention_plans_built() - plans_before;
      const double t = median(ts), tok_s = median(rates);
      median_s[m.name] = t;
      const double flops = 2.0 * layer_params * m.layers * double(T) + (m.attention ? attention_flops(double(T), m.layers) : 0.0);
      const double tflops = flops / double(T) * tok_s / 1e12;  // the prompts' mean length is about T where they vary
      std::printf("%-8lld %-22s %10.3f %12.0f %10.1f %9.0f%%%s\n", (long long)T, m.name.c_str(), t, tok_s, tflops,
                  gemm_rate > 0 ? 100.0 * tflops / gemm_rate : 0.0, plans ? fmt::format("  ({} attention plans built)", plans).c_str() : "");
      const cuda::ReadbackTotals rb = cuda::readback_totals();
      if (rb.syncs > rb_before.syncs) {  // PDBRIDGE_CAPTURE_STATS=1: the MoE's per-layer reads of its expert counts
        const double n = double(o.reps), syncs = double(rb.syncs - rb_before.syncs);
        std::printf("#        readbacks: %.0f per prompt; the GPU idle after each %.1f us (%.2f ms per prompt); the host waited %.2f ms per prompt\n",
                    syncs / n, 1e3 * (rb.gpu_idle_ms - rb_before.gpu_idle_ms) / syncs, (rb.gpu_idle_ms - rb_before.gpu_idle_ms) / n,
                    (rb.host_wait_ms - rb_before.host_wait_ms) / n);
      }
      std::fflush(stdout);
      json row = {{"label", o.label}, {"device", be->device()}, {"weights", be->weights()}, {"tp", o.tp}, {"kv_rows", o.kv_rows}, {"numerics", numerics}, {"attention", o.device == "cuda" ? cuda::attention_kernel_summary() : "cpu"}, {"tp_one_gpu", o.tp_one_gpu}, {"arch", c.arch}, {"model", o.model}, {"tokens", T}, {"mode", m.name},
                  {"chunk", o.chunk}, {"cache_type", o.cache_type}, {"seconds_median", t}, {"seconds_all", ts}, {"tok_s", tok_s},
                  {"vary_lengths", o.vary_lengths}, {"attention_plans_built", plans},
                  {"tflops", tflops}, {"gemm_tflops", gemm_rate}, {"wire_bytes", bytes},
                  // the engine's buffers grow and stay: what the device holds after the runs is their peak
                  {"gpu_gib_loaded", double(loaded_bytes) / double(1 << 30)}, {"gpu_gib_in_use", double(cuda::device_bytes_in_use()) / double(1 << 30)}};
      out << row.dump() << "\n";
    }
    if (o.device == "cuda" && is_gguf_path(o.model) && !c.mla()) {
      // issue 35's memory target: the GGUF's size plus the caches (the engine's own K/V at T, as it keeps them), +10%
      const double gib = double(1 << 30), file = double(std::filesystem::file_size(o.model)) / gib;
      const double kv = 2.0 * (L - 1) * KV * D * double(T) * (o.kv_dtype == "fp8" ? 1.0 + 4.0 / D : 2.0) / gib;
      const double in_use = double(cuda::device_bytes_in_use()) / gib;
      const double context = double(context_bytes) / gib;
      std::printf("#        memory at %lld: %.2f GiB in use (%.2f before any allocation: the CUDA context); the GGUF %.2f GiB + the engine's K/V "
                  "%.2f GiB = %.2f GiB (+10%%: %.2f)\n",
                  (long long)T, in_use, context, file, kv, file + kv, 1.1 * (file + kv));
      out << json{{"label", o.label}, {"tokens", T}, {"mode", "memory"}, {"gpu_gib_in_use", in_use}, {"context_gib", context}, {"gguf_gib", file},
                  {"engine_kv_gib", kv}}
                 .dump()
          << "\n";
    }
    if (median_s.count("engine-no-attention")) {
      const double attn_s = median_s["engine"] - median_s["engine-no-attention"];
      const double attn_tflops = attn_s > 0 ? attention_flops(double(T), L - 1) / attn_s / 1e12 : 0.0;
      std::printf("#        attention: %.3f s of the engine's %.3f s (%.0f%%), %.0f TFLOP/s; the rest (products, norms, RoPE): %.0f TFLOP/s\n",
                  attn_s, median_s["engine"], 100.0 * attn_s / median_s["engine"], attn_tflops,
                  2.0 * layer_params * (L - 1) * double(T) / median_s["engine-no-attention"] / 1e12);
      std::fflush(stdout);
      out << json{{"label", o.label}, {"device", be->device()}, {"arch", c.arch}, {"tokens", T}, {"mode", "attention-share"}, {"chunk", o.chunk},
                  {"attention_seconds", attn_s}, {"engine_seconds", median_s["engine"]}, {"attention_tflops", attn_tflops}}
                 .dump()
          << "\n";
    }
  }
  return 0;
}

}  // namespace pdb
