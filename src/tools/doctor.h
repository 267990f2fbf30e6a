// `pdbridge doctor`: checks every link of a deployment and prints one line per check with a fix.
#pragma once
#include <string>

namespace pdb {

struct DoctorOptions {
  std::string front_url, decoder_url, prefill_url, decoder_gguf, slot_dir, model_dir, api_key;
  int64_t memory_limit_mb = 1024;  // headroom the prefill box must have
  std::string fidelity_json;       // where to write the calibration's numbers (JSON), if set
  std::string server_bin;          // llama-server for the load check (default: the pinned build beside pdbridge)
};

// Returns the number of failed checks (0: healthy).
int run_doctor(const DoctorOptions& o);

}  // namespace pdb
