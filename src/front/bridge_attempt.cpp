// One bridge attempt, in its steps: the prefix a slot already holds, the capture fetched from a prefill server into a
// validated state file, its restore into the slot, and the file kept for the next turn.
#include "front/front_door.h"

namespace pdb {

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

}  // namespace pdb
