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

namespace {

double secs(Clock::time_point a, Clock::time_point b = Clock::now()) { return std::chrono::duration<double>(b - a).count(); }

void openai_error(httplib::Response& res, int status, const std::string& msg, const std::string& type = "invalid_request_error") {
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
  void warm_layout() {
    size_t cached = 0;
    const int slot = slots_.acquire({}, &cached);
    try {
      const auto t0 = Clock::now();
      decoder_cache(slot);
      spdlog::info("front: decoder layout learned at startup in {:.2f}s", secs(t0));
    } catch (const std::exception& e) {
      // Not sticky: traffic sent straight to the decoder's slots can disturb a probe; the first
      // request probes again (and a real mismatch, a wrong --rope-* say, is found again there).
      spdlog::warn("front: startup layout probe: {} (the first request probes again)", e.what());
      std::lock_guard<std::mutex> l(layout_m_);
      // a flag the bridge cannot work without is said where the operator looks (/health, doctor), not only in the log
      if (std::string(e.what()).find("--slot-save-path") != std::string::npos) setup_.problems.push_back(e.what());
      cache_.reset();
      calibration_.clear();
      calibration_error_.clear();  // fidelity_ keeps the numbers measured, for /health and doctor
    }
    slots_.release(slot, std::vector<int32_t>{});  // the slot now holds the probe prompt: no prefix to offer
  }

 private:
  // Learns the decoder's cache (its kind's layout) with a probe on a slot we hold, and (unless disabled) checks
  // that the running decoder computes layer 0 exactly as its GGUF says.
  std::shared_ptr<const DecoderCache> decoder_cache(int slot) {
    std::lock_guard<std::mutex> l(layout_m_);
    if (cache_) {
      if (!calibration_error_.empty()) throw std::runtime_error(calibration_error_);
      return cache_;
    }
    CacheProbe probe;
    probe.decoder_gguf = o_.decoder_gguf;
    probe.info = info_;
    probe.tokens = o_.calibrate ? calibration_tokens(info_vocab_) : calibration_tokens(info_vocab_, 4);
    probe.calibrate = o_.calibrate;
    if (o_.decoder_simd >= 0) { probe.calibration.widths = {o_.decoder_simd}; probe.calibration.width_from_operator = true; }
    probe.attn_rot = o_.attn_rot;
    LearnedCache learned = learn_decoder_cache(dec_.probe_state(slot, o_.slot_dir, probe.tokens), probe);
    spdlog::info("front: decoder state layout: {}", learned.cache->describe());
    note_setup(learned.streams, learned.state_version);
    calibration_error_ = learned.refusal;
    fidelity_ = learned.fidelity;
    if (fidelity_) {
      calibration_ = fidelity_->note;
      spdlog::info("front: calibration {}; decoder ISA {} ({})", fidelity_->note, fidelity_->isa, fidelity_->isa_source);
    }
    if (!learned.refusal.empty()) spdlog::warn("front: {}", learned.refusal);
    cache_ = std::move(learned.cache);
    if (!calibration_error_.empty()) throw std::runtime_error(calibration_error_);
    return cache_;
  }
  // What the running server's flags mean for the bridge, now that a state it saved shows its streams. Caller holds
  // layout_m_.
  void note_setup(int streams, uint32_t state_version) {
    setup_ = assess_decoder(props_, streams, state_version, o_.min_tokens);
    spdlog::info("front: decoder build '{}' ({}), state version {}, {} slots of {} tokens", setup_.build,
                 setup_.release.empty() ? "not a release pdbridge was measured against" : setup_.release, state_version, setup_.slots,
                 setup_.slot_ctx);
    for (const auto& p : setup_.problems) spdlog::warn("front: decoder setup: {}", p);
  }
  void forget_layout() {
    std::lock_guard<std::mutex> l(layout_m_);
    cache_.reset();
    kept_.clear();  // computed for the decoder before its restart: its arithmetic may have changed with it
  }
  // A front door that was killed leaves its kept files (GBs each) in the slot dir; this one never reads them.
  void remove_stale_files() {
    size_t n = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(o_.slot_dir, ec)) {
      const std::string f = e.path().filename().string();
      if (e.is_regular_file() && f.rfind("pdbridge-", 0) == 0 && f.size() > 4 && f.compare(f.size() - 4, 4, ".bin") == 0) {
        remover_.remove(e.path().string());
        ++n;
      }
    }
    if (n) spdlog::info("front: removing {} state files an earlier front door left in {}", n, o_.slot_dir);
  }

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

void Front::bridge(int slot, const std::vector<int32_t>& prompt, int64_t slot_cached, Verdict& v) {
  const auto t0 = Clock::now();
  const auto cache = decoder_cache(slot);
  v.t_probe = secs(t0);
  CacheSpec spec;
  {
    std::lock_guard<std::mutex> l(layout_m_);
    spec = cache->spec(decoder_simd_width());
    v.fidelity = fidelity_summary();
  }
  // the capture and the file are of the tokens the decoder's cache kind mounts (the rest it computes itself)
  const std::vector<int32_t> tokens(prompt.begin(), prompt.begin() + cache->file_tokens(int64_t(prompt.size())));
  const int64_t T = int64_t(tokens.size());
  std::string name, held_name;
  {
    std::lock_guard<std::mutex> l(rng_m_);
    const uint64_t id = rng_();
    name = fmt::format("pdbridge-{}-{:016x}.bin", slot, id);
    held_name = fmt::format("pdbridge-{}-{:016x}.held.bin", slot, id);
  }
  const std::string path = o_.slot_dir + "/" + name, held_path = o_.slot_dir + "/" + held_name;
  struct Cleanup { BackgroundRemover& r; std::string p; ~Cleanup() { r.remove(p); } } cleanup{remover_, path}, held_cleanup{remover_, held_path};

  HeldPrefix held = held_prefix(slot, *cache, tokens, slot_cached, held_name, v);
  const int64_t P = held.tokens;
  wire::PrefillRequest pr;
  pr.tokens = tokens;
  pr.fingerprint = fingerprint_;
  pr.k_type = spec.k_type;
  pr.v_type = spec.v_type;
  pr.rot_k = spec.rot_k;
  pr.rot_v = spec.rot_v;
  pr.simd_width = spec.simd_width;
  pr.tail_from = P;
  int64_t mounted = 0;
  const auto assembler = fetch_capture(slot, *cache, pr, held, path, v, &mounted);
  if (const auto& tr = assembler->trailer()) {
    v.prefix_reused = tr->value("prefix_reused", int64_t(0));
    v.computed_tokens = tr->value("computed_tokens", int64_t(-1));
  }
  held = {};  // unmapped before the decoder's restore (a kept source file goes once its reference goes)
  mount(slot, name, mounted, v);
  router_.served(slot, v.prefill_server);
  if (P > 0) v.tail_from = P;
  v.bridged_tokens = mounted - P;
  v.mounted_tokens = mounted;
  if (cache->carries_turns() && keep_for_next_turn(path, tokens, mounted)) cleanup.p.clear();
  v.complete = mounted == T;
  v.t_bridge = secs(t0);
}

// An earlier turn of this conversation gives the first P tokens, the capture only [P, T): best the front door's own
// file of it (ready at once), else the slot's own state (llama-server saves the whole slot first: seconds at long
// context), which also holds the decoder's rows of the answer it generated.
Front::HeldPrefix Front::held_prefix(int slot, const DecoderCache& dc, const std::vector<int32_t>& tokens, int64_t slot_cached,
                                     const std::string& held_name, Verdict& v) {
  const DecoderCache* cache = &dc;
  const std::string held_path = o_.slot_dir + "/" + held_name;
  std::optional<ParsedState> held;
  std::shared_ptr<const KeptStates::File> kept;
  int64_t P = 0;
  const auto th = Clock::now();
  if (cache->carries_turns() && o_.tail_bridge && kept_.enabled()) {
    int64_t common = 0;
    kept = kept_.best(tokens, &common);
    // worth it while it covers at least half of what the slot holds (the rest is computed with the tail)
    if (kept && 2 * common >= slot_cached) {
      try {
        held = parse_state_file_mapped(kept->path);
        P = cache->usable_prefix(*held, tokens);
      } catch (const std::exception& e) {
        spdlog::warn("front: kept state {} gives no tail ({}): dropped", kept->path, e.what());
        kept_.drop(kept->path);
        held.reset();
        P = 0;
      }
      if (P > 0) v.held_from = "kept";
    }
    if (P == 0) {
      held.reset();
      kept.reset();
    }
  }
  if (P == 0 && cache->carries_turns() && o_.tail_bridge && slot_cached > 0) {
    try {
      dec_.slot_action(slot, "save", held_name);
      held = parse_state_file_mapped(held_path);
      P = cache->usable_prefix(*held, tokens);
    } catch (const std::exception& e) {
      spdlog::warn("front: slot {}: its saved state gives no tail ({}): bridging the whole prompt", slot, e.what());
      held.reset();
      P = 0;
    }
    if (P == 0) held.reset();
    else v.held_from = "slot";
  }
  if (P > 0 || slot_cached > 0) v.t_hold = secs(th);
  return {std::move(held), std::move(kept), P};

}

// One attempt per prefill server, in routing order, until one delivers a capture the assembler accepts; the
// held prefix is copied into the new file while the prefill server computes the tail. Returns the assembler of
// the committed file; throws with the last server's reason.
std::unique_ptr<StateAssembler> Front::fetch_capture(int slot, const DecoderCache& dc, const wire::PrefillRequest& pr, const HeldPrefix& hp,
                                                     const std::string& path, Verdict& v, int64_t* mounted_out) {
  const DecoderCache* cache = &dc;
  const int64_t P = pr.tail_from;
  const std::vector<int32_t>& tokens = pr.tokens;
  const std::optional<ParsedState>& held = hp.held;
  const std::string body = pr.to_json().dump();
  const std::string pkey = o_.prefill_api_key.empty() ? o_.api_key : o_.prefill_api_key;
  std::unique_ptr<StateAssembler> assembler;
  int64_t mounted = 0;
  std::string last_error;
  const std::vector<size_t> order = router_.order(slot, P > 0);
  for (size_t attempt = 0; attempt < order.size(); ++attempt) {
    const PrefillRouter::Server& server = router_.server(order[attempt]);
    assembler.reset();  // removes the previous attempt's partial file before the next one takes its name
    try {
      assembler = cache->assembler(path, tokens, fingerprint_, P);
      // the held prefix is copied into the new file while the prefill server computes the tail
      std::string copy_error;
      std::thread copier;
      if (P > 0)
        copier = std::thread([&] {
          try {
            const auto tc = Clock::now();
            assembler->copy_prefix(*held);
            v.t_copy = secs(tc);
          } catch (const std::exception& e) { copy_error = e.what(); }
        });
      struct Join { std::thread& t; ~Join() { if (t.joinable()) t.join(); } } join{copier};
      std::string frame_error, error_body;
      StreamPost req;
      req.host = server.target.host;
      req.port = server.target.port;
      req.path = "/v1/bridge/prefill";
      req.body = body;
      req.headers = {{"Content-Type", "application/json"}};
      req.connect_timeout_s = 5;
      req.idle_timeout_s = o_.bridge_timeout_s;
      if (!pkey.empty()) req.headers.emplace_back("Authorization", "Bearer " + pkey);
      const auto tw = Clock::now();
      const StreamResult result = post_streaming(req, [&](int status, const char* data, size_t n) {
        if (status != 200) { error_body.append(data, n); return error_body.size() < 65536; }
        try {
          assembler->feed(reinterpret_cast<const uint8_t*>(data), n);
        } catch (const std::exception& e) {
          frame_error = e.what();
          return false;
        }
        return true;
      });
      v.t_wire = secs(tw);
      if (copier.joinable()) copier.join();
      if (!frame_error.empty()) throw std::runtime_error("bad frame: " + frame_error);
      if (result.status != 0 && result.status != 200) {
        std::string msg = error_body;
        try { msg = json::parse(error_body).at("error").at("message").get<std::string>(); } catch (...) {}
        throw std::runtime_error(fmt::format("prefill server HTTP {}: {}", result.status, msg));
      }
      if (!result.transferred) throw std::runtime_error(fmt::format("prefill server {}:{}: {}", server.target.host, server.target.port, result.error));
      if (!copy_error.empty()) throw std::runtime_error("copying the slot's held prefix: " + copy_error);
      v.bytes = assembler->wire_bytes();
      v.t_engine = assembler->engine_s();
      mounted = assembler->commit();  // a sealed capture: its valid prefix
      v.prefill_server = server.url;
      router_.outcome(order[attempt], "ok");
      break;
    } catch (const std::exception& e) {
      last_error = e.what();
      router_.outcome(order[attempt], "failed");
      if (attempt + 1 < order.size()) {
        v.prefill_skipped.push_back(server.url + ": " + last_error);
        spdlog::warn("front: prefill server {} failed ({}); trying {}", server.url, last_error, router_.server(order[attempt + 1]).url);
        continue;
      }
      if (!v.prefill_skipped.empty()) last_error += fmt::format(" (and {} other prefill servers failed)", v.prefill_skipped.size());
      throw std::runtime_error(last_error);
    }
  }
  *mounted_out = mounted;
  return assembler;
}

// Restores the committed file into the slot and checks the decoder's word twice: the restore's reply, its /slots.
void Front::mount(int slot, const std::string& name, int64_t mounted, Verdict& v) {
  const auto tr = Clock::now();
  json r;
  try {
    r = dec_.slot_action(slot, "restore", name);
  } catch (...) {
    forget_layout();  // the decoder may have restarted with another layout: probe again next time
    throw;
  }
  v.t_restore = secs(tr);
  if (r.value("n_restored", int64_t(-1)) != mounted) throw std::runtime_error("decoder restored " + r.dump());
  // The restore's reply is the server's word; its slot table is a second one (the answer's timings, the last).
  if (const auto held = dec_.slot_tokens(slot); held && *held != mounted)
    throw std::runtime_error(fmt::format("the decoder's restore reported {} tokens, but its /slots says slot {} holds {}", mounted, slot, *held));
}

// Keeps a mounted file for the conversation's next turn (the decoder has its own copy now). False: not kept (it
// goes with the request).
bool Front::keep_for_next_turn(const std::string& path, const std::vector<int32_t>& tokens, int64_t mounted) {
  if (!o_.tail_bridge || !kept_.enabled() || mounted <= 0) return false;
  std::error_code ec;
  const uint64_t bytes = fs::file_size(path, ec);
  if (ec) return false;
  // the next turn writes a file about this large beside it: a kept file that leaves no room for it would only
  // turn that bridge into a decline
  std::error_code sec;
  const auto space = fs::space(o_.slot_dir, sec);
  if (!sec && space.available < bytes + bytes / 8) {
    spdlog::warn("front: {} has {:.1f} GB free: not keeping a {:.1f} GB state for the next turn", o_.slot_dir, double(space.available) / 1e9,
                 double(bytes) / 1e9);
    return false;
  }
  kept_.keep(path, std::vector<int32_t>(tokens.begin(), tokens.begin() + mounted), bytes);
  return true;
}

std::vector<int32_t> Front::tokenize_request(const std::string& path, const json& body) {
  if (path == "/v1/chat/completions") {
    if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
      throw BadRequest("'messages' must be a non-empty array");
    for (const auto& m : body["messages"])
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) throw BadRequest("each message needs a string 'role'");
    return dec_.tokenize(dec_.apply_template(body));
  }
  if (!body.contains("prompt")) throw BadRequest("'prompt' is required");
  const json& p = body["prompt"];
  if (p.is_string()) return dec_.tokenize(p.get<std::string>());
  if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    std::vector<int32_t> t;
    for (const auto& x : p) {
      if (!x.is_number_integer()) throw BadRequest("'prompt' token arrays must hold integers");
      t.push_back(x.get<int32_t>());
    }
    return t;
  }
  if (p.is_array() && p.size() == 1 && p[0].is_string()) return dec_.tokenize(p[0].get<std::string>());
  throw BadRequest("'prompt' must be a string, a one-string array or an array of token ids");
}

// Prometheus convention: every series exists at 0 from the start, so rate() and alerts work on a
// fresh front door. The label values are the ones record() uses.
void Front::declare_metrics() {
  for (const char* cls : {"complete", "partial", "unused", "native_short", "native_warm", "declined"})
    metrics_.counter("pdbridge_front_requests_total", "Generation requests by verdict", {{"verdict", cls}});
  for (const char* r : {"fingerprint", "calibration", "state_format", "bad_capture", "prefill_busy", "timeout", "prefill_unavailable", "restore", "other"})
    metrics_.counter("pdbridge_front_declines_total", "Bridges declined, by reason", {{"reason", r}});
  metrics_.counter("pdbridge_front_bridged_tokens_total", "Tokens mounted from bridged captures");
  metrics_.counter("pdbridge_front_tail_bridges_total", "Bridges of a tail only (the slot held the conversation's prefix)");
  metrics_.counter("pdbridge_front_held_tokens_total", "Tokens of tail bridges taken from the slot's own state");
  for (const char* src : {"kept", "slot"})
    metrics_.counter("pdbridge_front_tail_prefix_source_total", "Tail bridges by where their prefix came from (kept: the front door's own file; slot: the slot saved)", {{"source", src}});
  metrics_.gauge("pdbridge_front_kept_state_bytes", "Bytes of state files kept for conversations' next turns");
  metrics_.gauge("pdbridge_front_kept_state_files", "State files kept for conversations' next turns");
  router_.declare_metrics();
  metrics_.counter("pdbridge_front_wire_bytes_total", "Capture bytes received from the prefill server");
  metrics_.gauge("pdbridge_front_active_requests", "Generation requests in flight");
  for (const char* st : {"probe", "engine", "wire", "restore", "bridge", "total"})
    metrics_.histogram("pdbridge_front_stage_seconds", "Time per stage", Metrics::seconds_buckets(), {{"stage", st}});
}

void Front::record(const Verdict& v, double total_s, int status) {
  const std::string cls = verdict_class(v.verdict);
  metrics_.counter("pdbridge_front_requests_total", "Generation requests by verdict", {{"verdict", cls}}).Increment();
  if (cls == "declined")
    metrics_.counter("pdbridge_front_declines_total", "Bridges declined, by reason", {{"reason", decline_reason(v.verdict)}}).Increment();
  metrics_.counter("pdbridge_front_bridged_tokens_total", "Tokens mounted from bridged captures").Increment(double(v.bridged_tokens));
  if (v.tail_from && v.bridged_tokens > 0) {
    metrics_.counter("pdbridge_front_tail_bridges_total", "Bridges of a tail only (the slot held the conversation's prefix)").Increment();
    metrics_.counter("pdbridge_front_held_tokens_total", "Tokens of tail bridges taken from the slot's own state").Increment(double(*v.tail_from));
    metrics_.counter("pdbridge_front_tail_prefix_source_total", "Tail bridges by where their prefix came from (kept: the front door's own file; slot: the slot saved)", {{"source", v.held_from}}).Increment();
  }
  metrics_.counter("pdbridge_front_wire_bytes_total", "Capture bytes received from the prefill server").Increment(double(v.bytes));
  auto stage = [&](const char* st, double x) {
    metrics_.histogram("pdbridge_front_stage_seconds", "Time per stage", Metrics::seconds_buckets(), {{"stage", st}}).Observe(x);
  };
  if (v.bridged_tokens > 0) {
    stage("probe", v.t_probe);
    stage("engine", v.t_engine);
    stage("wire", v.t_wire);
    stage("restore", v.t_restore);
    stage("bridge", v.t_bridge);
  }
  stage("total", total_s);
  spdlog::info("front: request verdict=\"{}\" status={} tokens={} tail_from={} bridged={} cached={} bytes={} t_tokenize={:.3f} t_probe={:.3f} t_engine={:.3f} t_wire={:.3f} t_restore={:.3f} t_bridge={:.3f} t_total={:.3f}",
               v.verdict, status, v.tokens, v.tail_from ? *v.tail_from : 0, v.bridged_tokens, v.cached_tokens ? *v.cached_tokens : -1, v.bytes, v.t_tokenize, v.t_probe,
               v.t_engine, v.t_wire, v.t_restore, v.t_bridge, total_s);
}

void Front::handle_generation(const std::string& path, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = Clock::now();
  if (!check_bearer(o_.api_key, req, res)) return;
  struct Active {
    prometheus::Gauge& g;
    explicit Active(prometheus::Gauge& x) : g(x) { g.Increment(); }
    ~Active() { g.Decrement(); }
  } active(metrics_.gauge("pdbridge_front_active_requests", "Generation requests in flight"));
  json body;
  try {
    body = json::parse(req.body);
  } catch (const json::exception& e) {
    return openai_error(res, 400, json_body_error(e));
  }
  if (!body.is_object()) return openai_error(res, 400, "request body must be a JSON object");
  if (body.contains("stream") && !body["stream"].is_boolean()) return openai_error(res, 400, "'stream' must be a boolean");
  if (body.contains("id_slot")) return openai_error(res, 400, "'id_slot' is managed by the front door");
  Verdict v;
  std::vector<int32_t> tokens;
  try {
    tokens = tokenize_request(path, body);
  } catch (const BadRequest& e) {
    return openai_error(res, 400, e.what());
  } catch (const std::exception& e) {
    return openai_error(res, 502, std::string("decoder unavailable for tokenization: ") + e.what(), "upstream_error");
  }
  v.t_tokenize = secs(t0);
  v.tokens = int64_t(tokens.size());
  if (tokens.empty()) return openai_error(res, 400, "the prompt is empty");
  if (o_.max_prompt_tokens > 0 && v.tokens > o_.max_prompt_tokens)
    return openai_error(res, 400, fmt::format("the prompt has {} tokens; this front door accepts at most {}", v.tokens, o_.max_prompt_tokens));
  if (const int64_t ctx = slot_ctx_.load(); ctx > 0 && v.tokens >= ctx)
    return openai_error(res, 400, fmt::format("the prompt has {} tokens; the decoder's slots hold {} (llama-server's -c per slot, capped at the "
                                              "model's training context): it fits neither a bridged cache nor a native prefill",
                                              v.tokens, ctx));
  size_t cached = 0;
  const int slot = slots_.acquire(tokens, &cached);
  decide(slot, tokens, cached, t0, v);
  body["id_slot"] = slot;
  body["cache_prompt"] = true;
  spdlog::info("front: {} tokens slot {} verdict '{}' bridge {:.2f}s", v.tokens, slot, v.verdict, v.t_bridge);
  // each answer releases the slot (the stream's releaser once the stream ends)
  if (!body.value("stream", false)) return answer_plain(path, body, slot, tokens, t0, v, res);
  answer_streamed(path, body, slot, tokens, t0, std::move(v), res);
}

// Native (short, warm) or a bridge; a bridge that fails is declined, the slot erased, the request served natively.
void Front::decide(int slot, const std::vector<int32_t>& tokens, size_t cached, Clock::time_point t0, Verdict& v) {
  if (v.tokens < o_.min_tokens || v.tokens < min_bridge_prompt(info_)) {
    v.verdict = "native: short";
    return;
  }
  if (cached > 0 && int64_t(tokens.size() - cached) < o_.min_tail) {
    v.verdict = "native: warm";
    return;
  }
  try {
    bridge(slot, tokens, int64_t(cached), v);
    v.verdict = v.complete ? "complete" : fmt::format("partial {}/{}", v.bridged_tokens, v.tokens);
  } catch (const std::exception& e) {
    v.verdict = std::string("declined: ") + e.what();
    v.bridged_tokens = 0;
    if (v.fidelity.is_null()) {
      std::lock_guard<std::mutex> l(layout_m_);
      v.fidelity = fidelity_summary();
    }
    v.t_bridge = secs(t0) - v.t_tokenize;
    spdlog::warn("front: bridge declined on slot {}: {}", slot, e.what());
    try { dec_.slot_action(slot, "erase"); } catch (...) {}
  }
}

// The decoder's whole answer, its verdict settled from the answer's timings.
void Front::answer_plain(const std::string& path, const json& body, int slot, const std::vector<int32_t>& tokens, Clock::time_point t0, Verdict& v,
                         httplib::Response& res) {
  const auto upstream = dec_.target();
  auto release = [&](std::optional<std::vector<int32_t>> holds) { slots_.release(slot, std::move(holds)); };
  httplib::Client c(upstream.host, upstream.port);
  c.set_read_timeout(3600, 0);
  auto r = c.Post(path.c_str(), body.dump(), "application/json");
  if (!r || r->status == 503) {
    // The decoder is restarting: wait for it (bounded) and send the request once more.
    if (wait_for_decoder(120)) r = c.Post(path.c_str(), body.dump(), "application/json");
  }
  if (!r) {
    release(std::vector<int32_t>{});
    res.set_header("X-PD-Bridge", v.header());
    return openai_error(res, 502, "decoder unreachable: " + httplib::to_string(r.error()), "upstream_error");
  }
  std::optional<int64_t> cache_n;
  try {
    auto j = json::parse(r->body);
    if (j.contains("timings") && j["timings"].contains("cache_n")) cache_n = j["timings"]["cache_n"].get<int64_t>();
  } catch (...) {}
  if (r->status == 200) settle_verdict(v, cache_n);
  if (v.decoder_used == false) spdlog::warn("front: slot {}: {}", slot, v.verdict);
  release(r->status == 200 ? std::optional(tokens) : std::optional(std::vector<int32_t>{}));
  record(v, secs(t0), r->status);
  res.status = r->status;
  res.set_header("X-PD-Bridge", v.header());
  res.set_content(r->body, r->get_header_value("Content-Type").empty() ? "application/json" : r->get_header_value("Content-Type"));
}

void Front::answer_streamed(const std::string& path, const json& body, int slot, const std::vector<int32_t>& tokens, Clock::time_point t0, Verdict v,
                            httplib::Response& res) {
  const auto upstream = dec_.target();
  // Streaming: the verdict header goes out first (as decided before the answer), then the decoder's bytes as they
  // arrive, then the `pdbridge.verdict` event with the verdict settled from the answer's timings; the request is
  // recorded in the metrics then.
  res.set_header("X-PD-Bridge", v.header());
  auto shared_body = std::make_shared<std::string>(body.dump());
  auto done = std::make_shared<bool>(false);
  auto verdict = std::make_shared<Verdict>(std::move(v));
  auto self_release = std::make_shared<std::function<void(bool)>>([this, slot, tokens, verdict, t0](bool ok) {
    slots_.release(slot, ok ? std::optional(tokens) : std::optional(std::vector<int32_t>{}));
    record(*verdict, secs(t0), ok ? 200 : 499);
  });
  const bool openai_stream = path.rfind("/v1/", 0) == 0;
  res.set_chunked_content_provider(
      "text/event-stream",
      [upstream, path, shared_body, done, self_release, verdict, openai_stream, slot](size_t, httplib::DataSink& sink) {
        if (*done) { sink.done(); return true; }
        httplib::Client c(upstream.host, upstream.port);
        c.set_read_timeout(3600, 0);
        httplib::Request ur;
        ur.method = "POST";
        ur.path = path;
        ur.body = *shared_body;
        ur.set_header("Content-Type", "application/json");
        SseTimingsScanner scan;
        ur.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
          scan.feed(d, n);
          return sink.write(d, n);
        };
        auto r = c.send(ur);
        *done = true;
        const bool ok = bool(r) && r->status == 200;
        if (ok) {
          settle_verdict(*verdict, scan.cache_n());
          if (verdict->decoder_used == false) spdlog::warn("front: slot {}: {}", slot, verdict->verdict);
          const std::string ev = verdict_event(*verdict, openai_stream);
          sink.write(ev.data(), ev.size());
        }
        (*self_release)(ok);
        *self_release = [](bool) {};
        sink.done();
        return true;
      },
      [self_release](bool) { (*self_release)(false); });
}

void Front::proxy(const httplib::Request& req, httplib::Response& res) {
  const auto t = dec_.target();
  httplib::Client c(t.host, t.port);
  c.set_read_timeout(600, 0);
  httplib::Request ur;
  ur.method = req.method;
  ur.path = req.target.empty() ? req.path : req.target;
  ur.body = req.body;
  if (req.has_header("Content-Type")) ur.set_header("Content-Type", req.get_header_value("Content-Type"));
  auto r = c.send(ur);
  if (!r) return openai_error(res, 502, "decoder unreachable: " + httplib::to_string(r.error()), "upstream_error");
  res.status = r->status;
  res.set_content(r->body, r->get_header_value("Content-Type").empty() ? "application/json" : r->get_header_value("Content-Type"));
}

// Every prefill server's /health (up, device, load, prefix cache), asked in parallel with short timeouts.
void Front::serve(httplib::Server& srv) {
  srv.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    json j = {{"ok", true}, {"front", "pdbridge"}, {"fingerprint", fingerprint_}, {"geometry", recipe_geometry(info_)},
              {"decoder_url", o_.decoder_url}, {"prefill_url", o_.prefill_url}, {"decoder_gguf", o_.decoder_gguf},
              {"slot_dir", o_.slot_dir}, {"min_tokens", o_.min_tokens}, {"min_tail", o_.min_tail}};
    // A probe holds the layout lock for seconds on a large CPU decoder: health answers meanwhile.
    if (std::unique_lock<std::mutex> l(layout_m_, std::try_to_lock); l.owns_lock()) {
      j["layout"] = cache_ ? json(cache_->describe()) : json(nullptr);
      j["calibration"] = calibration_.empty() ? json(nullptr) : json(calibration_);
      j["calibration_error"] = calibration_error_.empty() ? json(nullptr) : json(calibration_error_);
      j["fidelity"] = fidelity_ ? fidelity_->to_json() : fidelity_summary();
      j["decoder_setup"] = setup_.to_json();
    } else {
      j["layout"] = "probing";
    }
    httplib::Client c(dec_.target().host, dec_.target().port);
    c.set_connection_timeout(2, 0);
    auto r = c.Get("/health");
    j["decoder"] = r && r->status == 200;
    j["prefill"] = router_.health();
    const auto ks = kept_.stats();
    j["kept_states"] = {{"files", ks.files}, {"bytes", ks.bytes}, {"max_bytes", ks.max_bytes}, {"kept", ks.kept},
                        {"evictions", ks.evictions}, {"superseded", ks.superseded}, {"refused", ks.refused}};
    res.set_content(j.dump(), "application/json");
  });
  for (const char* p : {"/v1/chat/completions", "/v1/completions", "/completion"}) {
    const std::string path = p;
    srv.Post(p, [this, path](const httplib::Request& req, httplib::Response& res) { handle_generation(path, req, res); });
  }
  srv.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    router_.health();  // refreshes pdbridge_front_prefill_up
    const auto ks = kept_.stats();
    metrics_.gauge("pdbridge_front_kept_state_bytes", "Bytes of state files kept for conversations' next turns").Set(double(ks.bytes));
    metrics_.gauge("pdbridge_front_kept_state_files", "State files kept for conversations' next turns").Set(double(ks.files));
    res.set_content(metrics_.render(), "text/plain; version=0.0.4");
  });
  srv.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) { if (check_bearer(o_.api_key, req, res)) proxy(req, res); });
  srv.Get(".*", [this](const httplib::Request& req, httplib::Response& res) { if (check_bearer(o_.api_key, req, res)) proxy(req, res); });
  srv.Post(".*", [this](const httplib::Request& req, httplib::Response& res) {
    if (!check_bearer(o_.api_key, req, res)) return;
    if (req.path.rfind("/slots", 0) == 0) return openai_error(res, 403, "slots are managed by the front door");
    proxy(req, res);
  });
  srv.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string msg = "internal error";
    try { std::rethrow_exception(ep); } catch (const std::exception& e) { msg = e.what(); } catch (...) {}
    openai_error(res, 500, msg, "server_error");
  });
}

}  // namespace

int run_front(const FrontOptions& o) {
  if (o.attn_rot != "auto" && o.attn_rot != "on" && o.attn_rot != "off") throw std::invalid_argument("--attn-rot must be auto, on or off");
  Front f(o);
  for (int i = 0;; ++i) {
    try { f.connect_decoder(); break; } catch (const std::exception& e) {
      if (i >= 600) throw;
      if (i % 20 == 0) spdlog::info("front: waiting for the decoder at {} ({})", o.decoder_url, e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
  httplib::Server srv;
  install_json_error_handler(srv);
  f.serve(srv);
  srv.set_payload_max_length(o.max_body_mb << 20);
  srv.new_task_queue = [] { return new httplib::ThreadPool(16); };
  std::thread warm;  // started once the port is ours: a taken port fails at once, without a probe
  spdlog::info("front: listening on {}:{}", o.host, o.port);
  const bool listened = listen_with_backlog(srv, o.host, o.port, 1024, [&] { warm = std::thread([&f] { f.warm_layout(); }); });
  if (warm.joinable()) warm.join();
  if (!listened) throw std::runtime_error(fmt::format("cannot listen on {}:{}", o.host, o.port));
  return 0;
}

}  // namespace pdb
