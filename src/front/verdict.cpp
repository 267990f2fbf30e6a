#include "front/verdict.h"

#include <algorithm>

#include <fmt/format.h>

namespace pdb {
using json = nlohmann::json;

json Verdict::to_json() const {
  json j = {{"verdict", verdict}, {"tokens", tokens}, {"bridged_tokens", bridged_tokens}, {"bytes", bytes},
            {"t_tokenize_s", t_tokenize}, {"t_probe_s", t_probe}, {"t_engine_s", t_engine}, {"t_wire_s", t_wire},
            {"t_restore_s", t_restore}, {"t_bridge_s", t_bridge}};
  j["cached_tokens"] = cached_tokens ? json(*cached_tokens) : json(nullptr);
  if (mounted_tokens > 0) j["mounted_tokens"] = mounted_tokens;
  if (decoder_used) j["decoder_used"] = *decoder_used;
  if (tail_from) {
    j["tail_from"] = *tail_from;
    j["t_hold_s"] = t_hold;
    j["held_from"] = held_from;
    j["t_copy_s"] = t_copy;
  }
  if (!prefill_server.empty()) {
    j["prefill_server"] = prefill_server;
    j["prefill_reused_tokens"] = prefix_reused;
    j["prefill_computed_tokens"] = computed_tokens;
  }
  if (!prefill_skipped.empty()) j["prefill_skipped"] = prefill_skipped;
  if (!fidelity.is_null()) j["fidelity"] = fidelity;
  return j;
}

std::string Verdict::header() const { return to_json().dump(-1, ' ', false, json::error_handler_t::replace); }

void settle_verdict(Verdict& v, std::optional<int64_t> cache_n) {
  if (cache_n) v.cached_tokens = cache_n;
  if (v.mounted_tokens <= 0 || !cache_n) return;
  const int64_t expected = std::min(v.mounted_tokens, v.tokens - 1);
  v.decoder_used = *cache_n >= expected;
  if (*v.decoder_used) return;
  v.verdict = fmt::format("unused: the decoder restored {} tokens but its answer took {} of {} from its cache (computed {} again): "
                          "served as natively",
                          v.mounted_tokens, *cache_n, v.tokens, v.tokens - *cache_n);
  v.complete = false;
}

std::string verdict_class(const std::string& v) {
  if (v == "complete") return "complete";
  if (v.rfind("partial", 0) == 0) return "partial";
  if (v.rfind("unused", 0) == 0) return "unused";
  if (v == "native: short") return "native_short";
  if (v == "native: warm") return "native_warm";
  return "declined";
}

std::string decline_reason(const std::string& v) {
  if (v.find("state version") != std::string::npos) return "state_format";
  if (v.find("fingerprint") != std::string::npos) return "fingerprint";
  if (v.find("calibration") != std::string::npos) return "calibration";
  if (v.find("bad frame") != std::string::npos || v.find("trailer") != std::string::npos || v.find("incomplete") != std::string::npos) return "bad_capture";
  if (v.find("busy") != std::string::npos || v.find("queue") != std::string::npos) return "prefill_busy";
  if (v.find("Read") != std::string::npos || v.find("Timeout") != std::string::npos) return "timeout";
  if (v.find("prefill server") != std::string::npos) return "prefill_unavailable";
  if (v.find("restore") != std::string::npos || v.find("/slots") != std::string::npos) return "restore";
  return "other";
}

void SseTimingsScanner::feed(const char* data, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (data[i] != '\n') {
      // only lines that can hold the timings are kept whole; the others are dropped as they pass
      if (partial_.size() < (1u << 20)) partial_.push_back(data[i]);
      continue;
    }
    line(partial_);
    partial_.clear();
  }
}

void SseTimingsScanner::line(const std::string& l) {
  if (l.rfind("data:", 0) != 0 || l.find("\"timings\"") == std::string::npos) return;
  try {
    const json j = json::parse(l.substr(5));
    if (j.is_object() && j.contains("timings") && j["timings"].is_object() && j["timings"].contains("cache_n"))
      cache_n_ = j["timings"]["cache_n"].get<int64_t>();
  } catch (const std::exception&) {
  }
}

std::string verdict_event(const Verdict& v, bool openai_stream) {
  json d = {{"pdbridge_verdict", v.to_json()}};
  if (!openai_stream) {
    d["content"] = "";
    d["stop"] = true;
  }
  return "event: pdbridge.verdict\ndata: " + d.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

}  // namespace pdb
