// `pdbridge eval parity`: output parity of the bridge. Over N prompts (fresh seeds), the decoder's
// next-token distributions (top-K `n_probs`) natively vs through the bridge: mean KL divergence,
// top-1 agreement and greedy-continuation match; optionally the same figures between the decoder and
// a reference decoder (another quantization of the same weights), to put the bridge's divergence in
// the context of quantization's own.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace pdb {

struct EvalParityOptions {
  std::string front_url, decoder_url, ref_decoder_url, corpus_dir, out, api_key;
  int prompts = 50, n_probs = 20, n_predict = 16;
  int64_t chars = 12000;
  uint64_t seed = 0;
};

int run_eval_parity(const EvalParityOptions& o);

// One prompt of the protocol, as `pdbridge doctor` probes a deployment end to end: the decoder's own
// prefill, then the same prompt through the front door; the bridged verdict and the first token's
// distribution against the native one. Throws if either request fails.
struct ParityProbe {
  std::string verdict;         // the front door's verdict for the bridged leg
  nlohmann::json fidelity;     // the verdict header's fidelity object (class, ISA, layer-0 errors)
  double kl_first_token = 0;   // KL(native || bridged) on the native top-K
  bool same_first_token = false;
  int64_t tokens_cached = 0, prompt_tokens = 0;
};
ParityProbe probe_output_parity(const std::string& front_url, const std::string& decoder_url, const std::string& api_key, int64_t chars,
                                uint64_t seed);

}  // namespace pdb
