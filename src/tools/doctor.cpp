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

// The checks in the order a bridge meets them; each step reports and leaves what later steps need.
class Doctor {
 public:
  explicit Doctor(const DoctorOptions& in) : o_(in) {}

  int run() {
    if (!o_.front_url.empty()) check_front();
    if (o_.decoder_url.empty() || o_.decoder_gguf.empty() || o_.slot_dir.empty()) {
      rep_.fail("configuration", "need --front, or --decoder, --decoder-gguf and --slot-dir", "pass the endpoints and files to check");
      return rep_.failed;
    }
    if (!read_decoder_gguf()) return rep_.failed;
    check_decoder();
    for (const std::string& url : split_url_list(o_.prefill_url)) check_prefill_server(url);
    if (!o_.front_url.empty() && props_ && !o_.prefill_url.empty()) check_bridge();
    check_hf_config();
    if (!o_.fidelity_json.empty()) write_fidelity();
    fmt::print("{} checks failed, {} warnings\n", rep_.failed, rep_.warned);
    return rep_.failed;
  }

 private:
  int64_t min_tokens() const { return front_min_tokens_ > 0 ? front_min_tokens_ : 4096; }

  // 0. the front door: reachable; the endpoints and files it names fill what was not passed
  void check_front() {
    auto h = get_json(o_.front_url, "/health", "", &err_);
    if (!h) {
      rep_.fail("front door", o_.front_url + " unreachable: " + err_, "start `pdbridge front` or pass the right --front URL");
      return;
    }
    rep_.ok("front door", o_.front_url + " answers");
    if (o_.decoder_url.empty()) o_.decoder_url = h->value("decoder_url", "");
    if (o_.prefill_url.empty()) o_.prefill_url = h->value("prefill_url", "");
    if (o_.decoder_gguf.empty()) o_.decoder_gguf = h->value("decoder_gguf", "");
    if (o_.slot_dir.empty()) o_.slot_dir = h->value("slot_dir", "");
    front_min_tokens_ = h->value("min_tokens", int64_t(0));
    const json fid = h->value("fidelity", json());
    if (fid.is_object() && fid.contains("class"))
      rep_.ok("front fidelity class", fmt::format("{} (decoder ISA {}): {}", fid.value("class", "?"), fid.value("decoder_isa", "?"), fid.value("note", "")));
    if (!h->value("calibration_error", json()).is_null())
      rep_.fail("front calibration", (*h)["calibration_error"].get<std::string>(),
                "restart llama-server without overrides, or point the front at the GGUF it runs");
  }

  bool read_decoder_gguf() {
    try {
      auto g = GgufFile::open(o_.decoder_gguf);
      info_ = read_recipe_info(*g);
      fingerprint_ = recipe_fingerprint(info_);
      rep_.ok("decoder GGUF", fmt::format("{} ({} {} layers, fingerprint {})", o_.decoder_gguf, info_.arch, info_.n_layer, fingerprint_));
      return true;
    } catch (const std::exception& e) {
      rep_.fail("decoder GGUF", e.what(), "pass the GGUF llama-server was started with (--decoder-gguf)");
      return false;
    }
  }

  // 1. decoder: reachable, pinned build, the right model, slots, save/restore, layout, calibration
  void check_decoder() {
    props_ = get_json(o_.decoder_url, "/props", "", &err_);
    if (!props_) {
      rep_.fail("decoder", o_.decoder_url + " unreachable: " + err_, "start it with `pdbridge decoder --gguf ... --slot-dir ...`");
      // Is it down, or does llama-server die loading this model on this host? Loading it once tells.
      const LoadCheck lc = check_decoder_loads(o_.decoder_gguf, o_.server_bin, 300);
      if (lc.loaded) rep_.ok("decoder load check", lc.detail + " (so the decoder is just not running at " + o_.decoder_url + ")");
      else rep_.fail("decoder load check", lc.detail, "see the cause above; `pdbridge decoder` prints the same when it starts llama-server");
      return;
    }
    rep_.ok("decoder", o_.decoder_url + " answers");
    check_decoder_build();
    const std::string model = props_->value("model_path", "");
    if (canonical(model) != canonical(o_.decoder_gguf))
      rep_.fail("decoder model", fmt::format("llama-server runs {}, the bridge follows {}", model, o_.decoder_gguf),
                "give the front door (--decoder-gguf) the GGUF the decoder runs");
    else rep_.ok("decoder model", model);
    const int slots = props_->value("total_slots", 0);
    if (slots < 1) rep_.fail("decoder slots", "no slots", "start llama-server with --parallel N");
    else rep_.ok("decoder slots", fmt::format("{} slots", slots));
    try {
      DecoderClient dec(o_.decoder_url);
      probe_tokens_ = calibration_tokens(int64_t(GgufFile::open(o_.decoder_gguf)->get("tokenizer.ggml.tokens").arr.size()));
      probe_ = dec.probe_layout(slots - 1, o_.slot_dir, probe_tokens_);
      rep_.ok("slot save/restore", fmt::format("saved a probe into {}: {}, state version {}", o_.slot_dir, probe_->layout.describe(),
                                               probe_->layout.file_version));
    } catch (const std::exception& e) {
      rep_.fail("slot save/restore", e.what(), "start llama-server with --slot-save-path <the front's --slot-dir> (pdbridge decoder does)");
    }
    const DecoderSetup setup = assess_decoder(*props_, probe_ ? int(probe_->layout.n_stream) : 0, probe_ ? probe_->layout.file_version : 0, min_tokens());
    if (setup.problems.empty()) rep_.ok("decoder flags", fmt::format("{} slots of {} tokens, {} KV streams", setup.slots, setup.slot_ctx, setup.streams));
    for (const auto& p : setup.problems) rep_.warn("decoder flags", p);
    if (probe_) {
      check_calibration();
      check_slot_directory();
    }
  }

  void check_decoder_build() {
    const std::string build = props_->value("build_info", "");
    if (const MeasuredRelease* m = find_measured_release(build))
      rep_.ok("decoder build", fmt::format("{}: node-llama-cpp {}'s llama.cpp{}, state version {}, measured (docs/RESULTS.md, \"Releases\")", build,
                                           m->node_llama_cpp, m->pinned ? " (the pinned build)" : "", m->state_version));
    else
      rep_.warn("decoder build", fmt::format("{}: not a llama.cpp release pdbridge was measured against; its state files are read only in a "
                                             "format pdbridge knows (versions {}-{}), else bridges are declined with the reason",
                                             build.empty() ? "(no build_info)" : build, kStateVersionMin, kStateVersion));
  }

  void check_calibration() {
    CacheSpec spec = CacheSpec::decoder_default(probe_->layout.layers[0].k_type, probe_->layout.layers[0].v_type, info_.head_dim);
    auto c = calibrate_layer0(o_.decoder_gguf, *probe_, probe_tokens_, spec);
    if (c.cls == FidelityClass::mismatch)
      rep_.fail("decoder calibration", c.note,
                "llama-server computes something else than its GGUF says: remove --rope-* / --yarn-* overrides, or use the GGUF it runs");
    else rep_.ok("decoder calibration", c.note);
    rep_.ok("decoder fidelity class", fmt::format("{}: decoder ISA {} ({})", to_string(c.cls), c.isa, c.isa_source));
    fidelity_ = c.to_json();
  }

  // room for the largest state file at the decoder's context
  void check_slot_directory() {
    auto slots_j = get_json(o_.decoder_url, "/slots", "", &err_);
    const int64_t n_ctx = slots_j && slots_j->is_array() && !slots_j->empty() ? (*slots_j)[0].value("n_ctx", int64_t(0)) : 0;
    const uint64_t need = probe_->layout.kv_bytes_per_cell() * uint64_t(n_ctx) + (uint64_t(n_ctx) * 16);
    struct statvfs sv{};
    if (statvfs(o_.slot_dir.c_str(), &sv) != 0 || access(o_.slot_dir.c_str(), W_OK) != 0) {
      rep_.fail("slot directory", o_.slot_dir + " is not writable", "create it and make it writable for the front door");
      return;
    }
    const uint64_t free_b = uint64_t(sv.f_bavail) * sv.f_frsize;
    if (free_b < need)
      rep_.fail("slot directory", fmt::format("{:.1f} GiB free, a full-context state file needs {:.1f} GiB", double(free_b) / (1 << 30), double(need) / (1 << 30)),
                "free space, move --slot-save-path, or use a smaller --ctx / quantized cache");
    else
      rep_.ok("slot directory", fmt::format("writable, {:.1f} GiB free (full context needs {:.2f} GiB)", double(free_b) / (1 << 30), double(need) / (1 << 30)));
  }

  // 2. prefill: every server the front door names (--prefill A,B): reachable, same fingerprint, config.json agrees
  // with the GGUF, memory headroom
  void check_prefill_server(const std::string& url) {
    auto ph = get_json(url, "/health", "", &err_);
    if (!ph) {
      rep_.fail("prefill server", url + " unreachable: " + err_, "start `pdbridge prefill --model ... --recipe <decoder GGUF>`");
      return;
    }
    const json pc = ph->value("prefix_cache", json::object());
    rep_.ok("prefill server", fmt::format("{} answers ({}; prefix cache {})", url, ph->value("device", "?"),
                                          pc.value("enabled", false) ? fmt::format("{:.2f} of {:.2f} GiB, {} entries", pc.value("bytes", 0.0) / (1 << 30),
                                                                                   pc.value("max_bytes", 0.0) / (1 << 30), pc.value("entries", 0))
                                                                     : std::string("off")));
    const std::string pf = ph->value("fingerprint", "");
    if (pf != fingerprint_) {
      std::string diff;
      const json mine = recipe_geometry(info_), theirs = ph->value("geometry", json::object());
      for (auto& [k, v] : mine.items())
        if (!theirs.contains(k) || theirs[k] != v) diff += fmt::format(" {}: decoder {} vs prefill {};", k, v.dump(), theirs.contains(k) ? theirs[k].dump() : "?");
      rep_.fail("fingerprints", fmt::format("{}: prefill recipe {} != decoder {}:{}", url, pf, fingerprint_, diff),
                "start the prefill server with --recipe <the exact GGUF the decoder runs>");
    } else {
      rep_.ok("fingerprints", "prefill recipe and decoder agree (" + fingerprint_ + ")");
    }
    for (const auto& m : ph->value("config_mismatches", json::array()))
      rep_.fail("prefill config", "config.json vs its recipe: " + m.get<std::string>(), "make the HF config.json and the GGUF agree (RoPE, window, shapes)");
    if (o_.model_dir.empty()) o_.model_dir = ph->value("model", "");
    const int64_t mem = ph->value("mem_available_mb", int64_t(-1));
    if (mem >= 0 && mem < o_.memory_limit_mb)
      rep_.fail("prefill memory", fmt::format("{} MiB available, the capture limit needs {} MiB", mem, o_.memory_limit_mb),
                "free memory on the prefill box or lower --memory-limit-mb");
    else if (mem >= 0) rep_.ok("prefill memory", fmt::format("{} MiB available", mem));
  }

  // 3. one bridge end to end through the front door: its verdict, and the first token's distribution
  // after the bridged restore against the decoder's own prefill of the same prompt.
  void check_bridge() {
    try {
      const auto p = probe_output_parity(o_.front_url, o_.decoder_url, o_.api_key, std::max<int64_t>(4000, min_tokens() * 6),
                                         uint64_t(std::chrono::system_clock::now().time_since_epoch().count()));
      const std::string what = fmt::format("{}, {} of {} tokens cached; first token {} the decoder's own, KL {:.3g}; fidelity class {}", p.verdict,
                                           p.tokens_cached, p.prompt_tokens, p.same_first_token ? "same as" : "differs from", p.kl_first_token,
                                           p.fidelity.is_object() ? p.fidelity.value("class", "?") : "?");
      if (p.verdict != "complete") rep_.fail("bridge probe", what, "see the verdict: the checks above say which link refuses");
      else rep_.ok("bridge probe", what);
      fidelity_["bridge_probe"] = {{"verdict", p.verdict}, {"kl_first_token", p.kl_first_token}, {"same_first_token", p.same_first_token},
                                   {"tokens_cached", p.tokens_cached}, {"prompt_tokens", p.prompt_tokens}};
    } catch (const std::exception& e) {
      rep_.fail("bridge probe", e.what(), "the front door or the decoder did not answer a completion");
    }
  }

  // 4. the HF config the engine runs vs the decoder's GGUF (the "four places" of RoPE/window settings); the prefill
  // server also reports its own check on /health (step 2)
  void check_hf_config() {
#if defined(PDBRIDGE_DECODE_SIDE_ONLY)
    if (!o_.model_dir.empty())
      rep_.warn("HF config vs GGUF", "not checked here: the decode-side build has no checkpoint reader (the prefill server's /health has it)");
#else
    const bool model_gguf = is_gguf_path(o_.model_dir) && fs::exists(o_.model_dir);  // the prefill's model is a GGUF
    if (o_.model_dir.empty() || !(model_gguf || fs::exists(o_.model_dir + "/config.json"))) {
      rep_.warn("HF config vs GGUF", "no HF checkpoint to compare (pass --model)");
      return;
    }
    try {
      auto mism = config_mismatches(o_.model_dir, o_.decoder_gguf);
      if (mism.empty() && model_gguf) rep_.ok("HF config vs GGUF", o_.model_dir + " (the prefill's model) holds the decoder GGUF's weights and keys");
      else if (mism.empty()) rep_.ok("HF config vs GGUF", o_.model_dir + "/config.json agrees with the decoder GGUF");
      for (const auto& m : mism) rep_.fail("HF config vs GGUF", m, "fix config.json (or the GGUF) so both engines use the same RoPE/window");
    } catch (const std::exception& e) {
      rep_.fail("HF config vs GGUF", e.what(), "point --model at the prefill engine's checkpoint");
    }
#endif
  }

  void write_fidelity() {
    std::ofstream out(o_.fidelity_json);
    out << fidelity_.dump(2) << "\n";
    if (!out) rep_.fail("fidelity report", "cannot write " + o_.fidelity_json, "pass a writable --fidelity-json path");
  }

  DoctorOptions o_;  // the front door's /health fills in what was not passed
  Report rep_;
  int64_t front_min_tokens_ = 0;
  std::string err_;
  std::string fingerprint_;
  RecipeInfo info_;
  std::optional<json> props_;  // the decoder's /props, where it answered
  std::optional<ParsedState> probe_;
  std::vector<int32_t> probe_tokens_;
  json fidelity_;
};

}  // namespace

int run_doctor(const DoctorOptions& in) { return Doctor(in).run(); }

}  // namespace pdb
