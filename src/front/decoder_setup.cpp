#include "front/decoder_setup.h"

#include <fmt/format.h>

namespace pdb {
using json = nlohmann::json;

const std::vector<MeasuredRelease>& measured_releases() {
  static const std::vector<MeasuredRelease> r = {
      {"3.19.1", "964a1a5ddcf0", 2, false},
      {"3.21.1", "80fb11ac73e6", 3, true},
      {"3.22.1", "de3ff815ea7d", 3, false},
  };
  return r;
}

const MeasuredRelease* find_measured_release(const std::string& build_info) {
  // llama.cpp prints its commit abbreviated (7 or more hex digits) after the build number
  for (const auto& r : measured_releases())
    for (size_t n = 12; n >= 7; --n)
      if (build_info.find(std::string(r.commit, n)) != std::string::npos) return &r;
  return nullptr;
}

json DecoderSetup::to_json() const {
  return {{"build", build}, {"release", release.empty() ? json(nullptr) : json(release)}, {"slots", slots}, {"slot_ctx", slot_ctx},
          {"kv_streams", streams}, {"state_version", state_version}, {"slots_endpoint", slots_endpoint}, {"problems", problems}};
}

DecoderSetup assess_decoder(const json& props, int streams, uint32_t state_version, int64_t min_tokens) {
  DecoderSetup d;
  d.build = props.value("build_info", "");
  if (const MeasuredRelease* r = find_measured_release(d.build))
    d.release = fmt::format("node-llama-cpp {}{}", r->node_llama_cpp, r->pinned ? " (pinned)" : "");
  d.slots = props.value("total_slots", 0);
  const json gen = props.value("default_generation_settings", json::object());
  d.slot_ctx = gen.is_object() ? gen.value("n_ctx", int64_t(0)) : 0;
  d.streams = streams;
  d.state_version = state_version;
  d.slots_endpoint = props.value("endpoint_slots", true);
  if (d.slots < 1) d.problems.push_back("the decoder reports no slots: start llama-server with --parallel N");
  if (d.slot_ctx > 0 && d.slot_ctx <= min_tokens)
    d.problems.push_back(fmt::format("each slot holds {} tokens (llama-server's -c divided among its {} slots), no more than the shortest "
                                     "prompt the front door bridges ({}, --min-tokens): nothing would be bridged; start llama-server "
                                     "with a larger --ctx-size",
                                     d.slot_ctx, d.slots, min_tokens));
  if (streams == 1 && d.slots > 1)
    d.problems.push_back(fmt::format(
        "its {} slots share one KV cache (--kv-unified, llama-server's default when --parallel is not given), and with "
        "--cache-idle-slots (its default) an idle slot is cleared whenever another slot starts a task: a restored slot can be "
        "emptied before its request runs (the verdict then says `unused`) and a long restore can find no room while other slots "
        "are busy; start llama-server with --parallel {} --no-kv-unified, or --no-cache-idle-slots (pdbridge decoder does both)",
        d.slots, d.slots));
  if (!d.slots_endpoint)
    d.problems.push_back("GET /slots is off (--no-slots): the front door cannot read back what a restore left in the slot and relies on the "
                         "answer's timings alone; start llama-server with --slots");
  return d;
}

std::string explain_slot_error(const std::string& message, const std::string& slot_dir) {
  if (message.find("slot-save-path") != std::string::npos || message.find("does not support slots action") != std::string::npos)
    return fmt::format("llama-server was started without --slot-save-path, so it cannot save or restore a slot: start it with "
                       "--slot-save-path {} (the front door's --slot-dir)",
                       slot_dir);
  return message;
}

}  // namespace pdb
