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

// Runs llama-server in the foreground, forwarding SIGINT/SIGTERM/SIGHUP; returns its exit status.
int run_decoder(const DecoderOptions& o);

}  // namespace pdb
