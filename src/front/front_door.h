// Internal to the front door (front.cpp: HTTP and the request's path; layout_probe.cpp: learning the decoder's
// cache; bridge_attempt.cpp: one bridge's steps): the Front class they share.
#pragma once
#include "front/front.h"
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include "formats/gguf.h"
#include "formats/state_file.h"
#include "common/http_stream.h"
#include "common/http_util.h"
#include "common/metrics.h"
#include "cache/decoder_cache.h"
#include "front/decoder_client.h"
#include "front/decoder_setup.h"
#include "front/prefill_router.h"
#include "front/slot_table.h"
#include "front/state_store.h"
#include "front/verdict.h"
#include "recipes/recipe.h"
#include "wire/protocol.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;


inline double secs(Clock::time_point a, Clock::time_point b = Clock::now()) { return std::chrono::duration<double>(b - a).count(); }

inline void openai_error(httplib::Response& res, int status, const std::string& msg, const std::string& type = "invalid_request_error") {
  res.status = status;
  res.set_content(json{{"error", {{"message", msg}, {"type", type}, {"code", status}}}}.dump(-1, ' ', false, json::error_handler_t::replace),
                  "application/json");
}

struct BadRequest : std::runtime_error { using std::runtime_error::runtime_error; };

class Front {
 public:
  explicit Front(const FrontOptions& o)
      : o_(o), dec_(o.decoder_url), router_(o.prefill_url, metrics_), kept_(uint64_t(std::max(0.0, o.keep_states_gb) * double(1ull << 30)), remover_) {
    auto g = GgufFile::open(o.decoder_gguf);
    info_ = read_recipe_info(*g);
    fingerprint_ = recipe_fingerprint(info_);
    info_vocab_ = int64_t(g->get("tokenizer.ggml.tokens").arr.size());
    if (!fs::is_directory(o.slot_dir)) throw std::runtime_error("--slot-dir " + o.slot_dir + " is not a directory");
    remove_stale_files();
    declare_metrics();
  }

  void connect_decoder() {
    const json props = dec_.props();
    const int n = props.value("total_slots", 1);
    // A slot's context, as llama-server reports it: its -c divided among the slots and capped at the
    // model's training context. A longer prompt fits neither a restored cache nor a native prefill.
    const json& gen = props.contains("default_generation_settings") ? props["default_generation_settings"] : json::object();
    slot_ctx_ = gen.is_object() ? gen.value("n_ctx", int64_t(0)) : 0;
    {
      std::lock_guard<std::mutex> l(layout_m_);
      props_ = props;
      setup_ = assess_decoder(props, 0, 0, o_.min_tokens);
    }
    std::lock_guard<std::mutex> l(slots_.m);
    slots_.slots.assign(size_t(n), {});
    spdlog::info("front: decoder has {} slots of {} tokens; recipe {} fingerprint {}", n, slot_ctx_.load(), info_.arch, fingerprint_);
  }

  void serve(httplib::Server& srv);

  // Learns the layout (and calibrates) before the first request needs it: on an 8B CPU decoder the
  // probe prefill takes 11-14 s, which the first bridged request would otherwise wait for. A failure
  // here only logs: the first request probes again and reports why in its verdict.
  void warm_layout();

 private:
  // Learns the decoder's cache (its kind's layout) with a probe on a slot we hold, and (unless disabled) checks
  // that the running decoder computes layer 0 exactly as its GGUF says.
  std::shared_ptr<const DecoderCache> decoder_cache(int slot);
  // What the running server's flags mean for the bridge, now that a state it saved shows its streams. Caller holds
  // layout_m_.
  void note_setup(int streams, uint32_t state_version);
  void forget_layout();
  // A front door that was killed leaves its kept files (GBs each) in the slot dir; this one never reads them.
  void remove_stale_files();

  // The width the prefill engine mirrors: the operator's, else the one calibration found, else this host's.
  int decoder_simd_width() const {
    int w = o_.decoder_simd >= 0 ? o_.decoder_simd : host_simd_width();
    if (o_.decoder_simd < 0 && fidelity_ && fidelity_->simd_width) w = fidelity_->simd_width;
    return w;
  }
  // What the verdict header and /health say of the decoder's arithmetic (caller holds layout_m_ or a copy).
  json fidelity_summary() const {
    if (!o_.calibrate) return json{{"class", "unchecked"}, {"note", "--no-calibrate"}};
    if (!fidelity_) return json(nullptr);
    return json{{"class", to_string(fidelity_->cls)}, {"decoder_isa", fidelity_->isa}, {"simd_width", fidelity_->simd_width},
                {"k_rel_rms", fidelity_->k.rel_rms()}, {"v_rel_rms", fidelity_->v.rel_rms()}, {"pct_identical", fidelity_->pct_identical}};
  }

  // Pulls the capture for `tokens` into a state file in the slot dir and restores it into `slot`.
  // Throws with the reason on any failure; leaves no file behind (the restored file is kept for the next turn
  // in kept_, or goes to remover_).
  // slot_cached: the tokens the front knows the slot holds of this prompt (> 0: try a tail bridge).
  void bridge(int slot, const std::vector<int32_t>& tokens, int64_t slot_cached, Verdict& v);
  // What an earlier turn gives a tail capture: a state of it (mapped), the kept file it came from, its tokens P.
  struct HeldPrefix {
    std::optional<ParsedState> held;
    std::shared_ptr<const KeptStates::File> kept;
    int64_t tokens = 0;
  };
  HeldPrefix held_prefix(int slot, const DecoderCache& cache, const std::vector<int32_t>& tokens, int64_t slot_cached,
                         const std::string& held_name, Verdict& v);
  std::unique_ptr<StateAssembler> fetch_capture(int slot, const DecoderCache& cache, const wire::PrefillRequest& pr, const HeldPrefix& held,
                                                const std::string& path, Verdict& v, int64_t* mounted);
  void mount(int slot, const std::string& name, int64_t mounted, Verdict& v);
  bool keep_for_next_turn(const std::string& path, const std::vector<int32_t>& tokens, int64_t mounted);

  std::vector<int32_t> tokenize_request(const std::string& path, const json& body);
  void handle_generation(const std::string& path, const httplib::Request& req, httplib::Response& res);
  void decide(int slot, const std::vector<int32_t>& tokens, size_t cached, Clock::time_point t0, Verdict& v);
  void answer_plain(const std::string& path, const json& body, int slot, const std::vector<int32_t>& tokens, Clock::time_point t0, Verdict& v,
                    httplib::Response& res);
  void answer_streamed(const std::string& path, const json& body, int slot, const std::vector<int32_t>& tokens, Clock::time_point t0, Verdict v,
                       httplib::Response& res);
  void proxy(const httplib::Request& req, httplib::Response& res);
  void record(const Verdict& v, double total_s, int status);
  void declare_metrics();
  bool wait_for_decoder(double timeout_s) {
    const auto end = Clock::now() + std::chrono::duration<double>(timeout_s);
    httplib::Client c(dec_.target().host, dec_.target().port);
    c.set_connection_timeout(1, 0);
    while (Clock::now() < end) {
      auto r = c.Get("/health");
      if (r && r->status == 200) { forget_layout(); return true; }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return false;
  }

  FrontOptions o_;
  DecoderClient dec_;
  PrefillRouter router_;
  RecipeInfo info_;
  std::string fingerprint_;
  SlotTable slots_;
  std::mutex layout_m_;
  std::shared_ptr<const DecoderCache> cache_;  // learned from the decoder's probe state
  std::string calibration_, calibration_error_;
  std::optional<CalibrationResult> fidelity_;
  json props_ = json::object();  // the decoder's /props at connect
  DecoderSetup setup_;
  int64_t info_vocab_ = 0;
  BackgroundRemover remover_;
  KeptStates kept_;  // after remover_: a kept file's removal goes through it
  std::atomic<int64_t> slot_ctx_{0};  // tokens one decoder slot holds (0: unknown)
 public:
  Metrics metrics_;
 private:
  std::mt19937_64 rng_{std::random_device{}()};
  std::mutex rng_m_;
};

}  // namespace pdb
