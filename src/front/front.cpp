#include "front/front.h"
#include "front/front_door.h"

namespace pdb {

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
