// `pdbridge front`: the OpenAI-compatible front door beside the decoder. It tokenizes with the
// decoder's own tokenizer, decides native vs bridge, pulls the decoder's cache from the prefill
// engine into a state file, restores it into a slot it owns, and forwards the request there.
#pragma once
#include <string>

namespace pdb {

struct FrontOptions {
  std::string decoder_url, decoder_gguf, slot_dir, host = "127.0.0.1";
  std::string prefill_url;  // one URL, or several separated by commas (routed by prefix affinity, then load)
  int port = 8000;
  int64_t min_tokens = 4096, min_tail = 2048;
  int bridge_timeout_s = 600;
  std::string attn_rot = "auto";
  int decoder_simd = -1;  // -1: this host's (the front runs beside the decoder)
  std::string api_key;          // clients must send Authorization: Bearer <key>
  std::string prefill_api_key;  // sent to the prefill server (default: api_key)
  int64_t max_prompt_tokens = 0;  // 0: the decoder's slot context
  size_t max_body_mb = 32;
  bool tail_bridge = true;        // a slot's next turn bridges only its new tail (false: the whole prompt again)
  double keep_states_gb = 16;     // the front door's bridged files kept for the next turns (0: save the slot instead)
  bool calibrate = true;          // verify the decoder against its GGUF (layer 0) before the first bridge  // decoder's Hadamard rotation: auto (llama.cpp's default rule) | on | off
};

int run_front(const FrontOptions& o);

}  // namespace pdb
