// What the running llama-server was started with, as far as the bridge depends on it, read from what the server
// shows (/props, the layout of a state file it saved) since it reports none of its flags. Each problem names the
// flag that fixes it and why; the front door logs them at start and shows them on /health, `pdbridge doctor` prints
// them. The llama.cpp builds pdbridge was measured against are listed here too (docs/RESULTS.md, "Releases").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace pdb {

struct MeasuredRelease {
  const char* node_llama_cpp;  // the npm package whose llama.cpp bundle it is
  const char* commit;          // llama.cpp commit (12 hex)
  unsigned state_version;      // LLAMA_STATE_SEQ_VERSION
  bool pinned;                 // the build scripts/setup.sh makes
};
const std::vector<MeasuredRelease>& measured_releases();
// The measured release whose commit appears in a build string (/props build_info, `llama-server --version`), or null.
const MeasuredRelease* find_measured_release(const std::string& build_info);

struct DecoderSetup {
  std::string build;         // /props build_info
  std::string release;       // "node-llama-cpp 3.21.1 (pinned)", or "" when not one measured
  int slots = 0;
  int64_t slot_ctx = 0;      // tokens per slot
  int streams = 0;           // KV streams in its state files (0: not probed yet); 1 with several slots = unified
  uint32_t state_version = 0;
  bool slots_endpoint = true;
  std::vector<std::string> problems;  // each: what is wrong, the flag, why
  nlohmann::json to_json() const;
};

// From /props (and, once a probe was saved, the state's stream count and version). min_tokens: the shortest
// prompt the front door bridges.
DecoderSetup assess_decoder(const nlohmann::json& props, int streams, uint32_t state_version, int64_t min_tokens);

// A slot action's error, with the flag that fixes it where the server's message says which.
std::string explain_slot_error(const std::string& message, const std::string& slot_dir);

}  // namespace pdb
