// `pdbridge decoder`: runs the unmodified llama-server with the flags the bridge relies on.
#pragma once
#include <string>
#include <vector>

namespace pdb {

struct DecoderOptions {
  std::string gguf, slot_dir, host = "127.0.0.1", server_bin;
  int port = 8080;
  int ctx = 8192;       // per slot
  int parallel = 1;     // slots (explicit -np: one KV stream per slot)
  std::string cache_type = "f16";
  int threads = 0;
  std::vector<std::string> extra;
};

// The exact argv (llama-server first).
std::vector<std::string> decoder_argv(const DecoderOptions& o);

// Runs llama-server in the foreground, forwarding SIGINT/SIGTERM/SIGHUP; returns its exit status. Says when it is
// ready, and says plainly when it dies before that (while loading the model), with the likely cause.
int run_decoder(const DecoderOptions& o);

// Why a llama-server that exited with `code` before answering /health died (the signal or status, and for a crash
// on a CPU with AMX the known llama.cpp cause and its fix).
std::string diagnose_load_death(const std::string& gguf, int code);

// Starts llama-server on `gguf` on a free loopback port (one small slot) and waits until it answers /health or
// exits: whether this host's llama-server can load the model at all. Used by `pdbridge doctor` when no decoder answers.
struct LoadCheck { bool loaded = false; std::string detail; };
LoadCheck check_decoder_loads(const std::string& gguf, const std::string& server_bin, double timeout_s);

}  // namespace pdb
