// `pdbridge prefill`: the prefill engine as an HTTP server speaking the bridge wire protocol.
#pragma once
#include <string>
#include <vector>

namespace pdb {

struct PrefillServerOptions {
  std::string model, recipe, host = "127.0.0.1", device = "cpu", kv_dtype = "bf16";
  int port = 8090;
  int64_t chunk = 0;  // tokens per engine step; 0: the engine's choice on cuda (4096; MoE: ~512 rows an expert, to 16384), 512 on the cpu
  int threads = 0;
  int64_t memory_limit_mb = 0;  // frames buffered ahead of a slow receiver; past it the capture is sealed (0: from MemAvailable)
  double link_gbps = 0;         // pace the sender to this rate (link emulation); 0: unpaced
  std::string api_key;                         // bearer token required on /v1/bridge/prefill
  int max_queue = 8;                           // captures waiting behind the running ones
  int max_concurrent = 1;                      // captures running at once (each holds the engine's per-prompt K/V)
  double max_queue_wait_s = 30;                // waited longer: declined, the front serves natively
  int64_t max_tokens = 2'000'000;              // per request
  size_t max_body_mb = 64;
  bool allow_config_mismatch = false;          // start even if config.json and the GGUF disagree
  std::string kv_rows = "auto";                 // CUDA: the cache rows' source (arch/architectures.h BackendOptions)
  std::string numerics = "auto";               // CUDA from a GGUF: the products' rounding (model/product_numerics.h)
  bool cpu_fast = false;                       // CPU engine: OpenBLAS numerics instead of the decoder-faithful ones
  double prefix_cache_gb = 4;                  // the engine states of recent prompts kept for tail captures (0: off)
  int tp = 1;                                  // CUDA: tensor parallel over GPUs 0..tp-1
  bool tp_one_gpu = false;                     // every rank on GPU 0 (the sharded forward checked on one GPU)
  double max_gpu_mem_gib = 0;                  // the CUDA engine's cap on the device memory in use (0: none)
};

int run_prefill_server(const PrefillServerOptions& o);

// Differences between the HF config the engine runs and the decoder GGUF the recipe follows
// (layers, heads, head size, norm eps, every RoPE parameter). Empty when they agree.
std::vector<std::string> config_mismatches(const std::string& hf_dir, const std::string& gguf);

}  // namespace pdb
