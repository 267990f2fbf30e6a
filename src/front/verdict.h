// What the front door says of each generation request (the X-PD-Bridge header, the streamed verdict event, the
// metrics), and the check that a bridge the decoder did not use is never called `complete`: a restore can report
// success while the next request computes the whole prompt again (llama.cpp issue 26676; an idle slot cleared by
// --cache-idle-slots on a unified KV cache), so the verdict is settled from the answer's own timings.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace pdb {

struct Verdict {
  std::string verdict;
  int64_t tokens = 0, bridged_tokens = 0;
  int64_t mounted_tokens = 0;            // tokens the restored file holds (a tail bridge's prefix included)
  std::optional<int64_t> cached_tokens;  // the decoder's timings.cache_n for the answer
  std::optional<bool> decoder_used;      // set once the answer's timings are read (bridges only)
  bool complete = false;  // every token the decoder's state needs was mounted (DeepSeek-V4: T-1 of T)
  uint64_t bytes = 0;
  // t_probe: learning the decoder's state layout (a probe prefill + calibration; once per decoder, again
  // after a failed restore); t_wire: from the capture request to its last byte (the engine runs inside it).
  // t_hold: saving and mapping the slot's own state (a tail bridge); t_copy: copying its prefix into the new
  // file (beside the capture).
  double t_tokenize = 0, t_probe = 0, t_engine = 0, t_wire = 0, t_restore = 0, t_bridge = 0, t_hold = 0, t_copy = 0;
  std::string held_from;  // a tail bridge's prefix: "kept" (the front door's own file of an earlier turn) or "slot" (the slot saved)
  nlohmann::json fidelity;  // the decoder's fidelity class and numbers, for bridged and declined requests
  // A tail bridge: the decoder's slot gave the first tail_from tokens, the capture the rest (bridged_tokens).
  std::optional<int64_t> tail_from;
  int64_t prefix_reused = 0, computed_tokens = -1;  // the prefill server's: resumed after / computed
  std::string prefill_server;                      // the one whose capture was mounted
  std::vector<std::string> prefill_skipped;        // "url: why" of each server tried before it
  nlohmann::json to_json() const;
  std::string header() const;  // to_json() as one line, invalid UTF-8 replaced
};

// A mounted bridge's answer computed at least min(mounted, T-1) tokens from the cache: llama-server evaluates the
// last prompt token again for its logits, and a DeepSeek-V4 file holds T-1 tokens. Below that, the decoder did not
// use (all of) what was restored: the verdict becomes `unused: ...` and the answer is the native one. Nothing
// changes for native and declined requests, nor when the decoder gave no timings (decoder_used stays unset).
void settle_verdict(Verdict& v, std::optional<int64_t> cache_n);

// "complete", "partial", "unused", "native_short", "native_warm" or "declined": the metrics' label.
std::string verdict_class(const std::string& verdict);
std::string decline_reason(const std::string& verdict);

// Reads timings.cache_n from a decoder's server-sent events as they pass (llama-server puts the timings in the
// last chunk of /completion and of the OpenAI streams); bytes may split lines anywhere.
class SseTimingsScanner {
 public:
  void feed(const char* data, size_t n);
  std::optional<int64_t> cache_n() const { return cache_n_; }

 private:
  void line(const std::string& l);
  std::string partial_;
  std::optional<int64_t> cache_n_;
};

// The server-sent event `pdbridge.verdict` that ends a streamed answer with its settled verdict. On the OpenAI
// streams it follows `data: [DONE]`, where their clients stop reading; on /completion its data also carries
// `"content": ""` and `"stop": true`, so a reader of plain `data:` chunks sees one more empty last chunk.
std::string verdict_event(const Verdict& v, bool openai_stream);

}  // namespace pdb
