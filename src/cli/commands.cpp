#include "cli/commands.h"

#include <cstdio>
#include <exception>
#include <string>

#include <fmt/format.h>

#include "cuda/device.h"
#include "decoder/launcher.h"
#include "formats/gguf.h"
#include "tools/make_model.h"

namespace pdb {
namespace {
int g_exit_code = 0;

template <class Fn>
void guarded(const char* name, Fn&& fn) {
  try {
    g_exit_code = fn();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pdbridge %s: error: %s\n", name, e.what());
    g_exit_code = 1;
  }
}

std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  while (b <= s.size()) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    if (e > b) out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

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
  cmd->add_option("--server-bin", o->server_bin, "llama-server binary (default: build/llama/bin/llama-server)");
  cmd->add_option("extra", o->extra, "Extra llama-server arguments (after --)");
  cmd->callback([o] { guarded("decoder", [&] { return run_decoder(*o); }); });
}

void register_make_model(CLI::App& app) {
  auto* cmd = app.add_subcommand("make-model", "Write a random-weight test model: HF checkpoint + decoder GGUFs");
  auto o = std::make_shared<MakeModelOptions>();
  auto types = std::make_shared<std::string>("f32");
  cmd->add_option("--arch", o->arch, "llama | qwen3")->required();
  cmd->add_option("--preset", o->preset, "tiny | small | 8b")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Master weight seed")->capture_default_str();
  cmd->add_option("--out", o->out, "Output directory")->required();
  cmd->add_option("--hf-dtype", o->hf_dtype, "HF checkpoint dtype: f32|f16|bf16|fp8")->capture_default_str();
  cmd->add_option("--gguf-types", *types, "Decoder GGUF types, comma separated (f32,f16,bf16,q8_0,q4_0,...)")->capture_default_str();
  cmd->add_option("--vocab-dir", o->vocab_dir, "llama.cpp models/ directory with ggml-vocab-*.gguf");
  cmd->add_option("--llama-bin", o->llama_bin, "Directory with llama-quantize");
  cmd->add_option("--threads", o->threads, "Threads (default: all cores)");
  cmd->callback([o, types] {
    guarded("make-model", [&] { o->gguf_types = split_csv(*types); make_model(*o); return 0; });
  });
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

void register_device_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("device-info", "Show whether a CUDA device is usable by the prefill engine");
  cmd->callback([] {
    guarded("device-info", [] {
      fmt::print("compiled with CUDA: {}\n{}\n", cuda::compiled_with_cuda() ? "yes" : "no", cuda::device_summary());
      return 0;
    });
  });
}

}  // namespace

void register_commands(CLI::App& app) {
  register_decoder(app);
  register_make_model(app);
  register_gguf_info(app);
  register_device_info(app);
}

int command_exit_code() { return g_exit_code; }
void set_command_exit_code(int rc) { g_exit_code = rc; }

}  // namespace pdb
