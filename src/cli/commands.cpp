#include "formats/weight_source.h"
#include "cli/commands.h"

#include <cstdio>
#include <exception>
#include <string>

#include <fmt/format.h>

#include "cli/command_util.h"
#include "cuda/device.h"
#include "formats/gguf.h"
#include "prefill/server.h"
#include "tools/bench_prefill.h"
#include "tools/make_model.h"

namespace pdb {
namespace {

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
  cmd->add_option("--context-length", o->context_length, "Declared training context (max_position_embeddings; default: the preset's)");
  cmd->add_option("--layers", o->layers, "Number of layers (default: the preset's; real layer shapes with fewer layers, for benchmarks)");
  cmd->add_flag("--no-hf", o->no_hf, "Only the decoder GGUFs, no HF checkpoint (a model larger than the disk holds twice)");
  cmd->add_option("--quantize-from", o->quantize_from, "What llama-quantize starts from: f32 (exact) or q8_0 (written here, byte for byte llama-quantize's; a 30B model's K-quants on a small disk)")
      ->check(CLI::IsMember({"f32", "q8_0"}))
      ->capture_default_str();
  cmd->add_option("--compress-ratios", o->compress_ratios, "deepseek4: the layers' compress ratios (0, 4, 128; comma separated), replacing the preset's")
      ->delimiter(',');
  cmd->add_option("--hash-layers", o->hash_layers, "deepseek4: how many first layers route by token hash (default: the preset's, at most the layer count)");
  cmd->callback([o, types] {
    guarded("make-model", [&] { o->gguf_types = split_csv(*types); make_model(*o); return 0; });
  });
}

constexpr const char* KV_ROWS_HELP =
    "CUDA: the cache rows' source. decoder: recomputed from the residual with the decoder's weights and arithmetic; engine: the "
    "engine's own K/V products, RoPE'd and typed as the decoder does (deepseek2: its latent, normed as the decoder does; needs --model "
    "to be the decoder's GGUF; not deepseek4); auto: engine where its products are the decoder's arithmetic (the GGUF itself with F16 "
    "q/k/v weights under half products), else decoder";

constexpr const char* NUMERICS_HELP =
    "CUDA, --model the decoder's GGUF: how the engine's products round their operands. bf16 (fastest); half (Metal's "
    "products: half weights and activations); cpu (ggml-cpu's: activations quantized to the weight type's Q8_0/Q8_K, half "
    "weights); cuda (ggml-cuda's MMQ: activations as q8_1); auto: half for F16/F32 GGUF weights, else bf16 (closest as "
    "measured, docs/RESULTS.md)";

void register_prefill(CLI::App& app) {
  auto* cmd = app.add_subcommand("prefill", "Run the prefill engine: HF checkpoint + the decoder's recipe, wire protocol over HTTP");
  auto o = std::make_shared<PrefillServerOptions>();
  cmd->add_option("--model", o->model, "HF checkpoint directory (config.json + safetensors), or the decoder's GGUF (llama, qwen3, qwen3moe, deepseek2; its quantized weights stay quantized on the GPU)")->required();
  cmd->add_option("--recipe", o->recipe, "The decoder's GGUF (the recipe's weights and cache math; default: --model when it is a GGUF)");
  cmd->add_option("--port", o->port, "Port")->required();
  cmd->add_option("--host", o->host, "Bind address")->capture_default_str();
  cmd->add_option("--device", o->device, "cpu | cuda")->capture_default_str();
  cmd->add_flag("--cpu-fast", o->cpu_fast, "CPU engine: OpenBLAS matmuls and attention (faster; caches equal to the decoder's up to rounding)");
  cmd->add_option("--chunk", o->chunk, "Prefill chunk size in tokens (default with --device cuda: 4096, for MoE models doubled until the routed experts average 512 rows (to 16384), for DeepSeek-V4 the largest up to 32768 whose buffers fit the GPU; 512 on the cpu)");
  cmd->add_option("--kv-dtype", o->kv_dtype, "CUDA engine's own K/V: bf16, or fp8 (e4m3 + a scale per head row: half the memory, for very long prompts; head_dim 128 on sm_90)")
      ->check(CLI::IsMember({"bf16", "fp8"}))
      ->capture_default_str();
  cmd->add_option("--tp", o->tp, "CUDA: tensor parallel over GPUs 0..N-1 (NCCL; heads and FFN columns split, one capture stream)")
      ->capture_default_str();
  cmd->add_flag("--tp-one-gpu", o->tp_one_gpu, "With --tp N: every rank on GPU 0 (checks the sharded forward on one GPU; not faster)");
  cmd->add_option("--max-gpu-mem", o->max_gpu_mem_gib, "GiB of GPU memory the prefill may hold (weights, recipe and buffers; a prompt that needs more is refused, saying so)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--kv-rows", o->kv_rows, KV_ROWS_HELP)->check(CLI::IsMember({"auto", "decoder", "engine"}))->capture_default_str();
  cmd->add_option("--numerics", o->numerics, NUMERICS_HELP)->check(CLI::IsMember({"auto", "bf16", "half", "cpu", "cuda"}))->capture_default_str();
  cmd->add_option("--threads", o->threads, "CPU threads (default: all cores)");
  cmd->add_option("--api-key", o->api_key, "Require Authorization: Bearer <key> (default: $PDBRIDGE_API_KEY)")->envname("PDBRIDGE_API_KEY");
  cmd->add_option("--max-queue", o->max_queue, "Captures allowed to wait behind the running one")->capture_default_str();
  cmd->add_option("--max-concurrent", o->max_concurrent, "Captures running at once")->capture_default_str();
  cmd->add_option("--max-queue-wait", o->max_queue_wait_s, "Seconds a capture may wait before it is declined")->capture_default_str();
  cmd->add_option("--max-tokens", o->max_tokens, "Longest prompt accepted (tokens)")->capture_default_str();
  cmd->add_option("--max-body-mb", o->max_body_mb, "Largest request body")->capture_default_str();
  cmd->add_option("--memory-limit-mb", o->memory_limit_mb, "Capture backlog limit; past it the capture seals a valid prefix (default: MemAvailable/4, >= 256)");
  cmd->add_option("--link-gbps", o->link_gbps, "Pace the sender to this link rate (emulation for tests and benchmarks)");
  cmd->add_flag("--allow-config-mismatch", o->allow_config_mismatch, "Start even if config.json and the decoder GGUF disagree");
  cmd->add_option("--prefix-cache-gb", o->prefix_cache_gb,
                  "Memory for the engine's state of recent prompts (K/V, least recently used out first), so a conversation's next turn "
                  "computes only past the longest cached prefix (0: off; host memory, the engine's own)")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  cmd->callback([o] {
    guarded("prefill", [&] {
      if (o->recipe.empty() && !is_gguf_path(o->model)) throw std::invalid_argument("--recipe (the decoder's GGUF) is required with an HF checkpoint");
      if (o->recipe.empty()) o->recipe = o->model;
      return run_prefill_server(*o);
    });
  });
}

void register_convert(CLI::App& app) {
  auto* cmd = app.add_subcommand("convert", "Convert an HF checkpoint (safetensors) to decoder GGUFs (float types directly, others via llama-quantize)");
  auto o = std::make_shared<ConvertOptions>();
  auto types = std::make_shared<std::string>("f16");
  cmd->add_option("--hf", o->hf_dir, "HF checkpoint directory (config.json + safetensors)")->required()->check(CLI::ExistingDirectory);
  cmd->add_option("--out", o->out, "Output directory for decoder-<type>.gguf")->required();
  cmd->add_option("--types", *types, "GGUF types, comma separated (f32,f16,bf16,q8_0,q4_0,...)")->capture_default_str();
  cmd->add_option("--vocab-gguf", o->vocab_gguf, "Tokenizer GGUF (default: <hf>/pdbridge-vocab.json, else llama.cpp's vocab for the arch)");
  cmd->add_option("--name", o->name, "general.name");
  cmd->add_option("--threads", o->threads, "Threads");
  cmd->callback([o, types] {
    guarded("convert", [&] {
      o->gguf_types = split_csv(*types);
      convert_model(*o);
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

// The prefill side's benchmark joins the decode side's `bench`.
void register_bench_prefill(CLI::App& app) {
  auto* bench = app.get_subcommand("bench");
  auto* pre = bench->add_subcommand("prefill", "Prefill throughput: engine, engine+recipe (wire frames), full forward; TFLOP/s vs a bf16 GEMM measured now");
  auto po = std::make_shared<BenchPrefillOptions>();
  pre->add_option("--model", po->model, "HF checkpoint directory, or the decoder's GGUF")->required();
  pre->add_option("--recipe", po->recipe, "Decoder GGUF (the recipe's weights; default: --model when it is a GGUF)");
  pre->add_option("--device", po->device, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  pre->add_option("--tokens", po->tokens, "Prompt lengths")->delimiter(',');
  pre->add_option("--chunk", po->chunk, "Chunk size (default: the prefill server's, where the backend has one; else 4096)");
  pre->add_option("--kv-dtype", po->kv_dtype, "CUDA engine's own K/V: bf16 or fp8")->check(CLI::IsMember({"bf16", "fp8"}));
  pre->add_option("--reps", po->reps, "Timed runs per mode (median reported)");
  pre->add_option("--tp", po->tp, "CUDA: tensor parallel over GPUs 0..N-1 (NCCL)");
  pre->add_flag("--tp-one-gpu", po->tp_one_gpu, "With --tp N: every rank on GPU 0 (the sharding's overhead, not a speed-up)");
  pre->add_option("--max-gpu-mem", po->max_gpu_mem_gib, "GiB of GPU memory the prefill may hold (a 24 GB card's budget on a larger one)")->check(CLI::PositiveNumber);
  pre->add_option("--cache-type", po->cache_type, "Decoder cache type for the recipe's rows");
  pre->add_option("--kv-rows", po->kv_rows, KV_ROWS_HELP)->check(CLI::IsMember({"auto", "decoder", "engine"}));
  pre->add_option("--numerics", po->numerics, NUMERICS_HELP)->check(CLI::IsMember({"auto", "bf16", "half", "cpu", "cuda"}));
  pre->add_option("--modes", po->modes, "Only these modes (full-forward, engine, engine-no-attention, engine+recipe, engine+recipe+frames)")
      ->delimiter(',');
  pre->add_option("--threads", po->threads, "Host threads");
  pre->add_option("--seed", po->seed, "First prompt seed (0: from the clock)");
  pre->add_option("--vary-lengths", po->vary_lengths, "Each timed prompt shorter by a fresh 0..N-1 tokens (lengths the warm-up did not see)")
      ->check(CLI::NonNegativeNumber);
  pre->add_option("--label", po->label, "Label stored in each JSONL row");
  pre->add_option("--out", po->out, "JSONL output (appended)");
  pre->callback([po] {
    guarded("bench prefill", [&] {
      if (po->recipe.empty() && !is_gguf_path(po->model)) throw std::invalid_argument("--recipe (the decoder's GGUF) is required with an HF checkpoint");
      if (po->recipe.empty()) po->recipe = po->model;
      return run_bench_prefill(*po);
    });
  });
}

}  // namespace

void register_commands(CLI::App& app) {
  register_decode_side_commands(app);
  register_prefill(app);
  register_make_model(app);
  register_bench_prefill(app);
  register_convert(app);
  register_device_info(app);
}

}  // namespace pdb
