// The whole bridge as real processes on loopback: llama-server (via `pdbridge decoder`), the
// prefill server and the front door, each on a free port, stopped on destruction.
#pragma once
#include "cache/calibration.h"
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/state_file.h"
#include "support/test_env.h"

namespace pdb { class PrefillBackend; }

namespace pdb::test {

struct StackOptions {
  std::string model_dir;              // build/test-models/<name>
  std::string decoder_type = "f32";   // decoder-<type>.gguf
  std::string recipe_gguf;            // default: the decoder's GGUF; "-": no --recipe (--model is a GGUF)
  std::string cache_type = "f16";
  int parallel = 2, ctx = 8192;
  int64_t min_tokens = 256, min_tail = 128;
  bool start_prefill = true;
  int extra_prefill = 0;              // more prefill servers (the front gets them all, comma-separated)
  bool start_front = true;            // false: the decoder (and prefill) only
  std::vector<std::string> front_extra, prefill_extra, decoder_extra;
  std::string hf_dir;  // prefill --model (default: <model_dir>/hf; a GGUF path: the decoder's file as the model)
  std::string decoder_bin;  // llama-server to run (default: the pinned build's); see blas_llama_server()
  // llama-server started as a user would, not by `pdbridge decoder`: its own defaults plus --slot-save-path and
  // decoder_extra (no --parallel, --ctx-size, cache types or cache flags of ours).
  bool decoder_by_hand = false;
  bool by_hand_slot_save_path = true;  // false: started without --slot-save-path (no slot can be saved or restored)
  // Called once the decoder answers, with its port and the slot dir: the URL the front door is given as --decoder
  // (a test's proxy).
  std::function<std::string(int, const std::string&)> front_decoder_url;
};

struct HttpReply {
  int status = 0;
  std::string body;
  std::string bridge_header;
  nlohmann::json json() const { return nlohmann::json::parse(body); }
  nlohmann::json verdict() const { return bridge_header.empty() ? nlohmann::json() : nlohmann::json::parse(bridge_header); }
};

class Stack {
 public:
  explicit Stack(const StackOptions& o);
  ~Stack();
  int decoder_port = 0, prefill_port = 0, front_port = 0;
  std::vector<int> extra_prefill_ports;
  std::string dir, slot_dir, decoder_gguf;
  HttpReply post_front(const std::string& path, const nlohmann::json& body, int timeout_s = 600);
  HttpReply post_decoder(const std::string& path, const nlohmann::json& body, int timeout_s = 600);
  void stop_prefill();
  void stop_extra_prefill(size_t i);
  std::string prefill_url(int port) const { return "http://127.0.0.1:" + std::to_string(port); }
  void start_prefill();  // (re)starts it on the same port
  void restart_decoder(bool wait_healthy = true);
  int run_doctor(std::string* output);
  std::string logs() const;
  // Files in the slot dir besides the state files the front door keeps for conversations' next turns (its
  // /health kept_states): what a failed or finished bridge left behind. Waits up to 10 s for the removals.
  size_t stray_state_files();
  size_t kept_state_files();

 private:
  std::unique_ptr<Child> decoder_, prefill_, front_;
  std::vector<std::unique_ptr<Child>> extra_prefill_;
  std::vector<std::string> prefill_argv_, decoder_argv_;
  int prefill_starts_ = 0;
};

HttpReply http_post(int port, const std::string& path, const std::string& body, int timeout_s);

// Token ids in [1000, min(vocab, 100000)) from `seed`: a prompt of fresh random tokens.
std::vector<int32_t> random_token_ids(uint64_t seed, int n, int vocab);
// A random-weight HF checkpoint made by make-model in a fresh temporary directory (no GGUFs); its path.
std::string make_hf_checkpoint(const std::string& name, const std::string& arch, const std::string& preset, uint64_t seed,
                               const std::string& dtype);

// A one-slot decoder without a prefill server: what the parity tests compare states on.
StackOptions parity_stack_options(const std::string& model_dir, const std::string& decoder_type, const std::string& cache_type);
// A stack whose prefill runs the decoder's GGUF alone: --model <models_dir>/<model>/decoder-<type>.gguf, no --recipe.
StackOptions gguf_alone_stack_options(const std::string& model, const std::string& decoder_type);

// The decoder's own state for `tokens` (slot 0 prefilled, saved as native.bin) and the state the
// backend bridges for the same tokens in the decoder's layout (bridged.bin, assembled in-process by
// the front door's code), both parsed. Throws if a step fails.
// `fidelity` is the calibration of the decoder on these very tokens: its class (mirrored or within
// tolerance) and the SIMD width the bridged state was computed with.
struct StatePair { ParsedState native, bridged; CalibrationResult fidelity; };
StatePair native_and_bridged_states(Stack& st, PrefillBackend& backend, const std::vector<int32_t>& tokens, int64_t chunk);

// The OpenBLAS-backend llama-server that scripts/setup.sh builds beside the pinned one: a CPU decoder
// whose prompt matmuls the recipe does not mirror (fidelity class: tolerance). Throws if missing.
std::string blas_llama_server();
// llama-server of node-llama-cpp `version`'s own llama.cpp bundle (scripts/setup.sh, PDBRIDGE_RELEASES).
std::string release_llama_server(const std::string& version);

// Deterministic pseudo-random text the tokenizers split into many tokens.
std::string random_text(uint64_t seed, int words);

}  // namespace pdb::test
