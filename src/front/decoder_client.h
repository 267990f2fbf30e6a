// What the front door asks of the running llama-server: its tokenizer and template, its slots, and
// the layout of its sequence-state files (learned by saving a probe slot and parsing it).
#pragma once
#include <optional>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/state_file.h"

namespace pdb {

struct HttpTarget { std::string host; int port = 0; };
HttpTarget parse_http_url(const std::string& url);  // http://host:port
// "URL[,URL...]" (the front door's --prefill): the URLs, trimmed, empty ones left out.
std::vector<std::string> split_url_list(const std::string& list);

class DecoderClient {
 public:
  explicit DecoderClient(const std::string& url);
  const HttpTarget& target() const { return t_; }
  nlohmann::json props();                        // GET /props
  std::string apply_template(const nlohmann::json& chat_body);  // POST /apply-template -> prompt
  std::vector<int32_t> tokenize(const std::string& text);       // POST /tokenize, as the server tokenizes prompts
  // POST /slots/{id}?action=...; returns the JSON reply or throws with the server's message
  nlohmann::json slot_action(int slot, const std::string& action, const std::string& filename = "");
  // The tokens GET /slots says `slot` holds (n_prompt_tokens), where the server says it (--slots on, and the slot
  // has run a task since start); nullopt otherwise.
  std::optional<int64_t> slot_tokens(int slot);
  // Completes `tokens` on `slot` natively (n_predict 0), saves it under `filename`, parses and returns
  // the state; erases the slot afterwards. The file is removed from slot_dir.
  ParsedState probe_layout(int slot, const std::string& slot_dir, const std::vector<int32_t>& tokens);
  // The same, the file's bytes unparsed (a DeepSeek-V4 decoder's state is read by formats/state_file_dsv4).
  std::vector<uint8_t> probe_state(int slot, const std::string& slot_dir, const std::vector<int32_t>& tokens);

 private:
  HttpTarget t_;
};

}  // namespace pdb
