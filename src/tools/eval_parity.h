// `pdbridge eval parity`: output parity of the bridge. Over N prompts (fresh seeds), the decoder's
// next-token distributions (top-K `n_probs`) natively vs through the bridge: mean KL divergence,
// top-1 agreement and greedy-continuation match; optionally the same figures between the decoder and
// a reference decoder (another quantization of the same weights), to put the bridge's divergence in
// the context of quantization's own.
#pragma once
#include <string>

namespace pdb {

struct EvalParityOptions {
  std::string front_url, decoder_url, ref_decoder_url, corpus_dir, out, api_key;
  int prompts = 50, n_probs = 20, n_predict = 16;
  int64_t chars = 12000;
  uint64_t seed = 0;
};

int run_eval_parity(const EvalParityOptions& o);

}  // namespace pdb
