#include "tools/doctor.h"

#include "formats/weight_source.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <filesystem>
#include <chrono>
#include <fstream>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/process.h"
#include "formats/gguf.h"
#include "cache/calibration.h"
#include "tools/eval_parity.h"
#include "decoder/launcher.h"
#include "front/decoder_client.h"
#include "front/decoder_setup.h"
#if !defined(PDBRIDGE_DECODE_SIDE_ONLY)
#include "prefill/server.h"
#endif
#include "recipes/recipe.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct Report {
  int failed = 0, warned = 0;
  void ok(const std::string& name, const std::string& detail) { fmt::print("[ ok ] {:<22} {}\n", name, detail); }
  void fail(const std::string& name, const std::string& detail, const std::string& fix) {
    ++failed;
    fmt::print("[FAIL] {:<22} {}\n       fix: {}\n", name, detail, fix);
  }
  void warn(const std::string& name, const std::string& detail) { ++warned; fmt::print("[warn] {:<22} {}\n", name, detail); }
};

std::optional<json> get_json(const std::string& url, const std::string& path, const std::string& key, std::string* err) {
  try {
    auto t = parse_http_url(url);
    httplib::Client c(t.host, t.port);
    c.set_connection_timeout(3, 0);
    c.set_read_timeout(30, 0);
    httplib::Headers h;
    if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
    auto r = c.Get(path.c_str(), h);
    if (!r) { *err = httplib::to_string(r.error()); return std::nullopt; }
    if (r->status != 200) { *err = fmt::format("HTTP {}: {}", r->status, r->body.substr(0, 200)); return std::nullopt; }
    return json::parse(r->body);
  } catch (const std::exception& e) {
    *err = e.what();
    return std::nullopt;
  }
}

std::string canonical(const std::string& p) {
  std::error_code ec;
  auto c = fs::canonical(p, ec);
  return ec ? p : c.string();
}

}  // namespace

int run_doctor(const DoctorOptions& in) {
  DoctorOptions o = in;
  Report rep;
  int64_t front_min_tokens = 0;
  std::string err;
  if (!o.front_url.empty()) {
    auto h = get_json(o.front_url, "/health", "", &err);
    if (!h) {
      rep.fail("front door", o.front_url + " unreachable: " + err, "start `pdbridge front` or pass the right --front URL");
    } else {
      rep.ok("front door", o.front_url + " answers");
      if (o.decoder_url.empty()) o.decoder_url = h->value("decoder_url", "");
      if (o.prefill_url.empty()) o.prefill_url = h->value("prefill_url", "");
      if (o.decoder_gguf.empty()) o.decoder_gguf = h->value("decoder_gguf", "");
      if (o.slot_dir.empty()) o.slot_dir = h->value("slot_dir", "");
      front_min_tokens = h->value("min_tokens", int64_t(0));
      const json fid = h->value("fidelity", json());
      if (fid.is_object() && fid.contains("class"))
        rep.ok("front fidelity class", fmt::format("{} (decoder ISA {}): {}", fid.value("class", "?"), fid.value("decoder_isa", "?"), fid.value("note", "")));
      if (!h->value("calibration_error", json()).is_null()) rep.fail("front calibration", (*h)["calibration_error"].get<std::string>(), "restart llama-server without overrides, or point the front at the GGUF it runs");
    }
  }
  if (o.decoder_url.empty() || o.decoder_gguf.empty() || o.slot_dir.empty()) {
    rep.fail("configuration", "need --front, or --decoder, --decoder-gguf and --slot-dir", "pass the endpoints and files to check");
    return rep.failed;
  }
  std::string fingerprint;
  RecipeInfo info;
  try {
    auto g = GgufFile::open(o.decoder_gguf);
    info = read_recipe_info(*g);
    fingerprint = recipe_fingerprint(info);
    rep.ok("decoder GGUF", fmt::format("{} ({} {} layers, fingerprint {})", o.decoder_gguf, info.arch, info.n_layer, fingerprint));
  } catch (const std::exception& e) {
    rep.fail("decoder GGUF", e.what(), "pass the GGUF llama-server was started with (--decoder-gguf)");
    return rep.failed;
  }
  // 1. decoder: reachable, pinned build, the right model, slots, save/restore, layout, calibration
  auto props = get_json(o.decoder_url, "/props", "", &err);
  std::optional<ParsedState> probe;
  std::vector<int32_t> probe_tokens;
  json fidelity;
  if (!props) {
    rep.fail("decoder", o.decoder_url + " unreachable: " + err, "start it with `pdbridge decoder --gguf ... --slot-dir ...`");
    // Is it down, or does llama-server die loading this model on this host? Loading it once tells.
    const LoadCheck lc = check_decoder_loads(o.decoder_gguf, o.server_bin, 300);
    if (lc.loaded) rep.ok("decoder load check", lc.detail + " (so the decoder is just not running at " + o.decoder_url + ")");
    else rep.fail("decoder load check", lc.detail, "see the cause above; `pdbridge decoder` prints the same when it starts llama-server");
  } else {
    rep.ok("decoder", o.decoder_url + " answers");
    const std::string build = props->value("build_info", "");
    if (const MeasuredRelease* m = find_measured_release(build))
      rep.ok("decoder build", fmt::format("{}: node-llama-cpp {}'s llama.cpp{}, state version {}, measured (docs/RESULTS.md, \"Releases\")", build,
                                          m->node_llama_cpp, m->pinned ? " (the pinned build)" : "", m->state_version));
    else
      rep.warn("decoder build", fmt::format("{}: not a llama.cpp release pdbridge was measured against; its state files are read only in a "
                                            "format pdbridge knows (versions {}-{}), else bridges are declined with the reason",
                                            build.empty() ? "(no build_info)" : build, kStateVersionMin, kStateVersion));
    const std::string model = props->value("model_path", "");
    if (canonical(model) != canonical(o.decoder_gguf))
      rep.fail("decoder model", fmt::format("llama-server runs {}, the bridge follows {}", model, o.decoder_gguf),
               "give the front door (--decoder-gguf) the GGUF the decoder runs");
    else rep.ok("decoder model", model);
    const int slots = props->value("total_slots", 0);
    if (slots < 1) rep.fail("decoder slots", "no slots", "start llama-server with --parallel N");
    else rep.ok("decoder slots", fmt::format("{} slots", slots));
    try {
      DecoderClient dec(o.decoder_url);
      probe_tokens = calibration_tokens(int64_t(GgufFile::open(o.decoder_gguf)->get("tokenizer.ggml.tokens").arr.size()));
      probe = dec.probe_layout(slots - 1, o.slot_dir, probe_tokens);
      rep.ok("slot save/restore", fmt::format("saved a probe into {}: {}, state version {}", o.slot_dir, probe->layout.describe(),
                                              probe->layout.file_version));
    } catch (const std::exception& e) {
      rep.fail("slot save/restore", e.what(), "start llama-server with --slot-save-path <the front's --slot-dir> (pdbridge decoder does)");
    }
    const DecoderSetup setup = assess_decoder(*props, probe ? int(probe->layout.n_stream) : 0, probe ? probe->layout.file_version : 0,
                                              front_min_tokens > 0 ? front_min_tokens : 4096);
    if (setup.problems.empty()) rep.ok("decoder flags", fmt::format("{} slots of {} tokens, {} KV streams", setup.slots, setup.slot_ctx, setup.streams));
    for (const auto& p : setup.problems) rep.warn("decoder flags", p);
    if (probe) {
      CacheSpec spec = CacheSpec::decoder_default(probe->layout.layers[0].k_type, probe->layout.layers[0].v_type, info.head_dim);
      auto c = calibrate_layer0(o.decoder_gguf, *probe, probe_tokens, spec);
      if (c.cls == FidelityClass::mismatch)
        rep.fail("decoder calibration", c.note, "llama-server computes something else than its GGUF says: remove --rope-* / --yarn-* overrides, or use the GGUF it runs");
      else rep.ok("decoder calibration", c.note);
      rep.ok("decoder fidelity class", fmt::format("{}: decoder ISA {} ({})", to_string(c.cls), c.isa, c.isa_source));
      fidelity = c.to_json();
      // room for the largest state file at the decoder's context
      auto slots_j = get_json(o.decoder_url, "/slots", "", &err);
      const int64_t n_ctx = slots_j && slots_j->is_array() && !slots_j->empty() ? (*slots_j)[0].value("n_ctx", int64_t(0)) : 0;
      const uint64_t need = probe->layout.kv_bytes_per_cell() * uint64_t(n_ctx) + (uint64_t(n_ctx) * 16);
      struct statvfs sv{};
      if (statvfs(o.slot_dir.c_str(), &sv) != 0 || access(o.slot_dir.c_str(), W_OK) != 0)
        rep.fail("slot directory", o.slot_dir + " is not writable", "create it and make it writable for the front door");
      else {
        const uint64_t free_b = uint64_t(sv.f_bavail) * sv.f_frsize;
        if (free_b < need)
          rep.fail("slot directory", fmt::format("{:.1f} GiB free, a full-context state file needs {:.1f} GiB", double(free_b) / (1 << 30), double(need) / (1 << 30)),
                   "free space, move --slot-save-path, or use a smaller --ctx / quantized cache");
        else rep.ok("slot directory", fmt::format("writable, {:.1f} GiB free (full context needs {:.2f} GiB)", double(free_b) / (1 << 30), double(need) / (1 << 30)));
      }
    }
  }
  // 2. prefill: every server the front door names (--prefill A,B): reachable, same fingerprint, config.json agrees
  // with the GGUF, memory headroom
  for (const std::string& url : split_url_list(o.prefill_url)) {
    auto ph = get_json(url, "/health", "", &err);
    if (!ph) rep.fail("prefill server", url + " unreachable: " + err, "start `pdbridge prefill --model ... --recipe <decoder GGUF>`");
    else {
      const json pc = ph->value("prefix_cache", json::object());
      rep.ok("prefill server", fmt::format("{} answers ({}; prefix cache {})", url, ph->value("device", "?"),
                                           pc.value("enabled", false) ? fmt::format("{:.2f} of {:.2f} GiB, {} entries", pc.value("bytes", 0.0) / (1 << 30),
                                                                                    pc.value("max_bytes", 0.0) / (1 << 30), pc.value("entries", 0))
                                                                      : std::string("off")));
      const std::string pf = ph->value("fingerprint", "");
      if (pf != fingerprint) {
        std::string diff;
        const json mine = recipe_geometry(info), theirs = ph->value("geometry", json::object());
        for (auto& [k, v] : mine.items())
          if (!theirs.contains(k) || theirs[k] != v) diff += fmt::format(" {}: decoder {} vs prefill {};", k, v.dump(), theirs.contains(k) ? theirs[k].dump() : "?");
        rep.fail("fingerprints", fmt::format("{}: prefill recipe {} != decoder {}:{}", url, pf, fingerprint, diff),
                 "start the prefill server with --recipe <the exact GGUF the decoder runs>");
      } else rep.ok("fingerprints", "prefill recipe and decoder agree (" + fingerprint + ")");
      for (const auto& m : ph->value("config_mismatches", json::array()))
        rep.fail("prefill config", "config.json vs its recipe: " + m.get<std::string>(), "make the HF config.json and the GGUF agree (RoPE, window, shapes)");
      if (o.model_dir.empty()) o.model_dir = ph->value("model", "");
      const int64_t mem = ph->value("mem_available_mb", int64_t(-1));
      if (mem >= 0 && mem < o.memory_limit_mb)
        rep.fail("prefill memory", fmt::format("{} MiB available, the capture limit needs {} MiB", mem, o.memory_limit_mb), "free memory on the prefill box or lower --memory-limit-mb");
      else if (mem >= 0) rep.ok("prefill memory", fmt::format("{} MiB available", mem));
    }
  }
  // 3. one bridge end to end through the front door: its verdict, and the first token's distribution
  // after the bridged restore against the decoder's own prefill of the same prompt.
  if (!o.front_url.empty() && props && !o.prefill_url.empty()) {
    try {
      const int64_t min_tokens = front_min_tokens > 0 ? front_min_tokens : 4096;
      const auto p = probe_output_parity(o.front_url, o.decoder_url, o.api_key, std::max<int64_t>(4000, min_tokens * 6),
                                         uint64_t(std::chrono::system_clock::now().time_since_epoch().count()));
      const std::string what = fmt::format("{}, {} of {} tokens cached; first token {} the decoder's own, KL {:.3g}; fidelity class {}", p.verdict,
                                           p.tokens_cached, p.prompt_tokens, p.same_first_token ? "same as" : "differs from", p.kl_first_token,
                                           p.fidelity.is_object() ? p.fidelity.value("class", "?") : "?");
      if (p.verdict != "complete") rep.fail("bridge probe", what, "see the verdict: the checks above say which link refuses");
      else rep.ok("bridge probe", what);
      fidelity["bridge_probe"] = {{"verdict", p.verdict}, {"kl_first_token", p.kl_first_token}, {"same_first_token", p.same_first_token},
                                  {"tokens_cached", p.tokens_cached}, {"prompt_tokens", p.prompt_tokens}};
    } catch (const std::exception& e) {
      rep.fail("bridge probe", e.what(), "the front door or the decoder did not answer a completion");
    }
  }
  // 4. the HF config the engine runs vs the decoder's GGUF (the "four places" of RoPE/window settings); the prefill
  // server also reports its own check on /health (step 2)
#if defined(PDBRIDGE_DECODE_SIDE_ONLY)
  if (!o.model_dir.empty()) rep.warn("HF config vs GGUF", "not checked here: the decode-side build has no checkpoint reader (the prefill server's /health has it)");
#else
  const bool model_gguf = is_gguf_path(o.model_dir) && fs::exists(o.model_dir);  // the prefill's model is a GGUF
  if (!o.model_dir.empty() && (model_gguf || fs::exists(o.model_dir + "/config.json"))) {
    try {
      auto mism = config_mismatches(o.model_dir, o.decoder_gguf);
      if (mism.empty() && model_gguf) rep.ok("HF config vs GGUF", o.model_dir + " (the prefill's model) holds the decoder GGUF's weights and keys");
      else if (mism.empty()) rep.ok("HF config vs GGUF", o.model_dir + "/config.json agrees with the decoder GGUF");
      for (const auto& m : mism) rep.fail("HF config vs GGUF", m, "fix config.json (or the GGUF) so both engines use the same RoPE/window");
    } catch (const std::exception& e) {
      rep.fail("HF config vs GGUF", e.what(), "point --model at the prefill engine's checkpoint");
    }
  } else {
    rep.warn("HF config vs GGUF", "no HF checkpoint to compare (pass --model)");
  }
#endif
  if (!o.fidelity_json.empty()) {
    std::ofstream out(o.fidelity_json);
    out << fidelity.dump(2) << "\n";
    if (!out) rep.fail("fidelity report", "cannot write " + o.fidelity_json, "pass a writable --fidelity-json path");
  }
  fmt::print("{} checks failed, {} warnings\n", rep.failed, rep.warned);
  return rep.failed;
}

}  // namespace pdb
