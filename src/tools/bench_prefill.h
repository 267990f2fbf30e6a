// `pdbridge bench prefill`: prefill throughput of a backend (CUDA or CPU) on random prompts (fresh
// seed per run): the engine alone, the engine with the recipe and wire frames (the product), and a
// full forward (every layer, like an engine producing logits) for comparisons with other engines;
// achieved TFLOP/s against a bf16 GEMM rate measured in the same run.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace pdb {

struct BenchPrefillOptions {
  std::string model, recipe, device = "cuda", out = "bench-prefill.jsonl", cache_type = "f16", label, kv_dtype = "bf16", kv_rows = "auto",
              numerics = "auto";
  std::vector<int64_t> tokens = {8192, 32768};
  int64_t chunk = 0;  // 0: the backend's own (the server's default), else 4096
  int reps = 3, threads = 0;
  int tp = 1;              // CUDA: tensor parallel over GPUs 0..tp-1
  bool tp_one_gpu = false;      // every rank on GPU 0 (the sharding's overhead on one GPU, not a speed-up)
  double max_gpu_mem_gib = 0;  // the CUDA engine's cap on the device memory in use (0: none)
  std::vector<std::string> modes;  // only these (empty: every mode)
  uint64_t seed = 0;  // 0: from the clock
  // Each timed prompt shorter by a fresh 0..vary_lengths-1 tokens: lengths the warm-up did not see, as a server meets
  // them (the attention plans and buffers of a new length are then part of the time). 0: every prompt T tokens.
  int64_t vary_lengths = 0;
};

int run_bench_prefill(const BenchPrefillOptions& o);

}  // namespace pdb
