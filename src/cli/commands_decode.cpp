// The decode side's commands: what runs beside the decoder (front door, decoder launcher, doctor, bench cold and
// plot, eval parity, verify-state, gguf-info). They build without CUDA, BLAS or the prefill engine
// (PDBRIDGE_DECODE_SIDE=ON builds a pdbridge of these alone, for a Mac or an aarch64 box).
#include "cli/commands.h"

#include <cstdio>
#include <exception>
#include <string>

#include <fmt/format.h>

#include "cli/command_util.h"
#include "decoder/launcher.h"
#include "formats/gguf.h"
#include "front/front.h"
#include "tools/bench_cold.h"
#include "tools/doctor.h"
#include "tools/eval_parity.h"
#include "formats/state_diff.h"

namespace pdb {
namespace {

void register_decoder(CLI::App& app) {
  auto* cmd = app.add_subcommand("decoder", "Run the decoder: unmodified llama-server with the flags the bridge needs");
  auto o = std::make_shared<DecoderOptions>();
  cmd->add_option("--gguf", o->gguf, "Decoder model (GGUF)")->required();
  cmd->add_option("--port", o->port, "Port")->required();
  cmd->add_option("--slot-dir", o->slot_dir, "Slot save directory (created if missing)")->required();
  cmd->add_option("--host", o->host, "Bind address")->capture_default_str();
  cmd->add_option("--ctx", o->ctx, "Context per slot (tokens)")->capture_default_str();
  cmd->add_option("--parallel", o->parallel, "Slots")->capture_default_str();
  cmd->add_option("--cache-type", o->cache_type, "KV cache type: f16|q8_0|q4_0|f32|bf16")->capture_default_str();
  cmd->add_option("--threads", o->threads, "CPU threads (default: llama-server's)");
  cmd->add_option("--server-bin", o->server_bin, "llama-server binary (default: build/llama/bin/llama-server)")->envname("PDBRIDGE_LLAMA_SERVER");
  cmd->add_option("extra", o->extra, "Extra llama-server arguments (after --)");
  cmd->callback([o] { guarded("decoder", [&] { return run_decoder(*o); }); });
}

void register_gguf_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("gguf-info", "Print a GGUF's metadata and tensors (validating the file)");
  auto path = std::make_shared<std::string>();
  cmd->add_option("file", *path, "GGUF file")->required();
  cmd->callback([path] {
    guarded("gguf-info", [&] {
      auto g = GgufFile::open(*path);
      fmt::print("GGUF v{}  alignment {}  {} keys  {} tensors\n", g->version(), g->alignment(), g->kv().size(), g->tensors().size());
      for (const auto& [k, v] : g->kv()) {
        std::string val;
        if (v.type == GgufType::ARRAY) val = fmt::format("[{} x {}]", v.arr.size(), gguf_type_name(v.arr_type));
        else if (v.type == GgufType::STRING) val = v.s.size() > 80 ? fmt::format("\"{}...\" ({} bytes)", v.s.substr(0, 77), v.s.size()) : "\"" + v.s + "\"";
        else if (v.type == GgufType::F32 || v.type == GgufType::F64) val = fmt::format("{}", v.f);
        else val = fmt::format("{}", v.as_int());
        fmt::print("  {:<48} {:<6} {}\n", k, gguf_type_name(v.type), val);
      }
      for (const auto& t : g->tensors()) fmt::print("  {:<32} {:<6} {}\n", t.name, ggml_type_name(t.type), fmt::join(t.ne, " x "));
      return 0;
    });
  });
}

void register_front(CLI::App& app) {
  auto* cmd = app.add_subcommand("front", "Run the OpenAI-compatible front door beside the decoder");
  auto o = std::make_shared<FrontOptions>();
  cmd->add_option("--decoder", o->decoder_url, "llama-server URL (http://host:port)")->required();
  cmd->add_option("--decoder-gguf", o->decoder_gguf, "The GGUF the decoder runs (for the recipe fingerprint)")->required();
  cmd->add_option("--slot-dir", o->slot_dir, "The decoder's --slot-save-path")->required();
  cmd->add_option("--prefill", o->prefill_url,
                  "Prefill server URL, or several separated by commas: a conversation goes to the server holding its prefix, else to the "
                  "least loaded; one that is down or busy is skipped")
      ->required();
  cmd->add_flag("!--no-tail", o->tail_bridge,
                "Bridge a slot's next turn whole instead of only its new tail (the A/B of tail bridging)");
  cmd->add_option("--keep-states-gb", o->keep_states_gb,
                  "Disk the front door keeps its bridged state files in (in --slot-dir) for conversations' next turns: a turn's prefix "
                  "comes from its own file instead of a slot save; 0: save the slot")
      ->capture_default_str();
  cmd->add_option("--port", o->port, "Port")->required();
  cmd->add_option("--host", o->host, "Bind address")->capture_default_str();
  cmd->add_option("--min-tokens", o->min_tokens, "Prompts shorter than this are served natively")->capture_default_str();
  cmd->add_option("--min-tail", o->min_tail, "Bridge only when at least this many prompt tokens are uncached")->capture_default_str();
  cmd->add_option("--bridge-timeout", o->bridge_timeout_s, "Seconds to wait for the prefill stream")->capture_default_str();
  cmd->add_option("--attn-rot", o->attn_rot, "Decoder's quantized-cache Hadamard rotation: auto|on|off")->capture_default_str();
  cmd->add_option("--api-key", o->api_key, "Require Authorization: Bearer <key> from clients (default: $PDBRIDGE_API_KEY)")->envname("PDBRIDGE_API_KEY");
  cmd->add_option("--prefill-api-key", o->prefill_api_key, "Key for the prefill server (default: --api-key)")->envname("PDBRIDGE_PREFILL_API_KEY");
  cmd->add_option("--max-prompt-tokens", o->max_prompt_tokens, "Longest prompt accepted (0: no limit beyond the decoder's)")->capture_default_str();
  cmd->add_option("--max-body-mb", o->max_body_mb, "Largest request body")->capture_default_str();
  cmd->add_flag("!--no-calibrate", o->calibrate, "Skip the layer-0 check of the running decoder against its GGUF");
  cmd->add_option("--decoder-simd", o->decoder_simd, "Decoder CPU SIMD width the CPU engine mirrors: 16 AVX-512, 8 AVX2, 4 NEON, 0 none (default: learned by the calibration probe)");
  cmd->callback([o] { guarded("front", [&] { return run_front(*o); }); });
}

void register_verify_state(CLI::App& app) {
  auto* cmd = app.add_subcommand("verify-state", "Compare two llama.cpp slot files tensor by tensor");
  auto a = std::make_shared<std::string>(), b = std::make_shared<std::string>();
  auto max_ulp = std::make_shared<int64_t>(1);
  auto min_identical = std::make_shared<double>(99.0);
  auto as_json = std::make_shared<bool>(false);
  cmd->add_option("a", *a, "State file A")->required();
  cmd->add_option("b", *b, "State file B")->required();
  cmd->add_option("--max-ulp", *max_ulp, "Largest tolerated element difference (ulp / quant steps)")->capture_default_str();
  cmd->add_option("--min-identical", *min_identical, "Smallest tolerated % of identical elements")->capture_default_str();
  cmd->add_flag("--json", *as_json, "Print the report as JSON");
  cmd->callback([=] {
    guarded("verify-state", [&] {
      auto A = parse_state_file(*a), B = parse_state_file(*b);
      auto d = diff_states(A, B);
      if (*as_json) fmt::print("{}\n", d.to_json().dump(2));
      else {
        fmt::print("tokens {} ({}), layout {}\n", A.tokens.size(), d.same_tokens ? "same" : "DIFFERENT", d.same_layout ? "same" : "DIFFERENT: " + d.layout_note);
        for (const auto& t : d.tensors) fmt::print("  {:<14} {:>10} elements  {:8.4f}% identical  max |d| {:.3g}  max ulp {}\n", t.name, t.elements, t.pct_identical(), t.max_abs, t.max_ulp);
        fmt::print("total: {:.4f}% identical, max ulp {}, max |d| {:.3g}\n", d.pct_identical(), d.max_ulp(), d.max_abs());
      }
      const bool ok = d.same_layout && d.same_tokens && d.max_ulp() <= *max_ulp && d.pct_identical() >= *min_identical;
      if (!ok) fmt::print(stderr, "verify-state: outside tolerance (max ulp {} > {} or {:.4f}% < {}%)\n", d.max_ulp(), *max_ulp, d.pct_identical(), *min_identical);
      return ok ? 0 : 2;
    });
  });
}

void register_doctor(CLI::App& app) {
  auto* cmd = app.add_subcommand("doctor", "Check every link of a deployment; one line per check, with a fix");
  auto o = std::make_shared<DoctorOptions>();
  cmd->add_option("--front", o->front_url, "Front door URL (supplies the rest)");
  cmd->add_option("--decoder", o->decoder_url, "llama-server URL");
  cmd->add_option("--prefill", o->prefill_url, "Prefill server URL");
  cmd->add_option("--decoder-gguf", o->decoder_gguf, "The GGUF the decoder runs");
  cmd->add_option("--slot-dir", o->slot_dir, "The decoder's slot directory");
  cmd->add_option("--model", o->model_dir, "The prefill engine's model: its HF checkpoint directory, or the GGUF it runs");
  cmd->add_option("--memory-limit-mb", o->memory_limit_mb, "Memory the prefill box must have available")->capture_default_str();
  cmd->add_option("--fidelity-json", o->fidelity_json, "Write the decoder calibration's fidelity numbers (class, ISA, layer-0 errors) to this file");
  cmd->add_option("--server-bin", o->server_bin, "llama-server for the load check when no decoder answers (default: the pinned build)")
      ->envname("PDBRIDGE_LLAMA_SERVER");
  cmd->callback([o] { guarded("doctor", [&] { return run_doctor(*o) == 0 ? 0 : 1; }); });
}

void register_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  auto* cold = bench->add_subcommand("cold", "Cold-prompt benchmark: native vs bridged TTFT, needle check, fresh seeds");
  auto o = std::make_shared<BenchColdOptions>();
  auto chars = std::make_shared<std::string>("32000");
  cold->add_option("--front", o->front_url, "Front door URL (bridged leg)")->required();
  cold->add_option("--native-url", o->native_url, "llama-server URL (native leg)");
  cold->add_flag("--skip-native", o->skip_native, "Only the bridged leg");
  cold->add_flag("--skip-bridged", o->skip_bridged, "Only the native leg");
  cold->add_option("--stop-after", o->stop_after, "Hang up after this many streamed pieces (0: read the whole answer)")->capture_default_str();
  cold->add_option("--chars", *chars, "Document sizes in characters, comma separated")->capture_default_str();
  cold->add_option("--runs", o->runs, "Runs per size (each with a fresh seed)")->capture_default_str();
  cold->add_option("--max-tokens", o->max_tokens, "Token budget of the answer")->capture_default_str();
  cold->add_option("--seed", o->seed, "First seed (default: from the clock)");
  cold->add_option("--corpus", o->corpus_dir, "Directory of .py files for the haystack (default: the system's Python stdlib)");
  cold->add_option("--out", o->out, "JSONL output (appended)")->capture_default_str();
  cold->add_option("--api-key", o->api_key, "Bearer key for the front door")->envname("PDBRIDGE_API_KEY");
  cold->callback([o, chars] {
    guarded("bench cold", [&] {
      o->chars.clear();
      for (const auto& c : split_csv(*chars)) o->chars.push_back(std::stoll(c));
      return run_bench_cold(*o);
    });
  });
  auto* plot = bench->add_subcommand("plot", "Plot a bench cold JSONL to PNG (TTFT vs length; stage breakdown)");
  auto in = std::make_shared<std::string>(), out = std::make_shared<std::string>("bench-cold.png");
  plot->add_option("--in", *in, "JSONL from bench cold")->required();
  plot->add_option("--out", *out, "PNG")->capture_default_str();
  plot->callback([in, out] { guarded("bench plot", [&] { return run_bench_plot(*in, *out); }); });
}

void register_eval(CLI::App& app) {
  auto* ev = app.add_subcommand("eval", "Evaluations");
  ev->require_subcommand(1);
  auto* parity = ev->add_subcommand("parity", "Output parity: next-token distributions bridged vs native (KL, top-1, greedy)");
  auto o = std::make_shared<EvalParityOptions>();
  parity->add_option("--front", o->front_url, "Front door URL (bridged)")->required();
  parity->add_option("--decoder", o->decoder_url, "llama-server URL (native)")->required();
  parity->add_option("--ref-decoder", o->ref_decoder_url, "A second llama-server with another quantization, for context");
  parity->add_option("--prompts", o->prompts, "Prompts (fresh seeds)")->capture_default_str();
  parity->add_option("--chars", o->chars, "Prompt length in characters")->capture_default_str();
  parity->add_option("--n-probs", o->n_probs, "Top-K probabilities per token")->capture_default_str();
  parity->add_option("--n-predict", o->n_predict, "Greedy continuation length")->capture_default_str();
  parity->add_option("--seed", o->seed, "First seed (default: from the clock)");
  parity->add_option("--out", o->out, "Per-prompt JSONL (appended)");
  parity->callback([o] { guarded("eval parity", [&] { return run_eval_parity(*o); }); });
}

}  // namespace

void register_decode_side_commands(CLI::App& app) {
  register_decoder(app);
  register_front(app);
  register_verify_state(app);
  register_doctor(app);
  register_bench(app);
  register_eval(app);
  register_gguf_info(app);
}

namespace {
int g_exit_code = 0;
}
int command_exit_code() { return g_exit_code; }
void set_command_exit_code(int rc) { g_exit_code = rc; }

}  // namespace pdb
