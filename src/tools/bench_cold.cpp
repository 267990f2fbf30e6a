#include "tools/bench_cold.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "common/process.h"
#include "front/decoder_client.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<std::string> python_sources(const std::string& dir_hint) {
  std::vector<std::string> roots;
  if (!dir_hint.empty()) roots.push_back(dir_hint);
  else
    for (const char* d : {"/usr/lib/python3.11", "/usr/lib/python3.12", "/usr/lib/python3.13", "/usr/lib/python3"})
      if (fs::is_directory(d)) { roots.push_back(d); break; }
  std::vector<std::string> files;
  for (const auto& r : roots)
    for (auto it = fs::recursive_directory_iterator(r, fs::directory_options::skip_permission_denied); it != fs::recursive_directory_iterator(); ++it)
      if (it->is_regular_file() && it->path().extension() == ".py" && it->file_size() < 400000) files.push_back(it->path().string());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw std::runtime_error("no Python sources found for the haystack (pass --corpus DIR)");
  return files;
}

struct Doc { std::string text, marker; };

Doc make_document(const std::vector<std::string>& files, int64_t chars, uint64_t seed, int n) {
  std::mt19937_64 g(seed);
  std::vector<size_t> order(files.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), g);
  std::string hay;
  for (size_t i = 0; hay.size() < size_t(chars); i = (i + 1) % order.size()) {
    std::ifstream in(files[order[i]]);
    std::stringstream ss;
    ss << in.rdbuf();
    hay += "# file: " + fs::path(files[order[i]]).filename().string() + "\n" + ss.str() + "\n";
  }
  hay.resize(size_t(chars));
  Doc d;
  d.marker = fmt::format("ZEBRA-{}-{}", seed % 10000, 1000 + (g() % 9000));
  const size_t mid = hay.find('\n', hay.size() / 2);
  hay.insert(mid == std::string::npos ? hay.size() / 2 : mid + 1, "\nThe secret marker is " + d.marker + ".\n");
  d.text = hay + "\n\nWhat is the secret marker mentioned in the text above? Answer with the marker only.";
  (void)n;
  return d;
}

struct Leg { json row; };

// stop_after > 0: read that many streamed pieces, then hang up (the decoder cancels the rest). For very
// long prompts on a CPU decoder, where 300 tokens at a long context take many minutes but the TTFT
// is what is measured; the request still carries the full token budget.
json run_leg(const std::string& url, const std::string& key, const std::string& prompt, int max_tokens, bool native, int stop_after) {
  auto t = parse_http_url(url);
  httplib::Client c(t.host, t.port);
  c.set_read_timeout(7200, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  json body = {{"messages", {{{"role", "user"}, {"content", prompt}}}}, {"stream", true}, {"max_tokens", max_tokens},
               {"temperature", 0}, {"stream_options", {{"include_usage", true}}}};
  if (native) body["cache_prompt"] = false;
  if (stop_after > 0) body["timings_per_token"] = true;  // the counts must arrive before we hang up
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  if (!key.empty()) req.set_header("Authorization", "Bearer " + key);
  const auto t0 = Clock::now();
  double ttft = -1;
  std::string text, buf, header, raw;
  json timings = json::object();
  int status = 0, pieces = 0;
  req.response_handler = [&](const httplib::Response& r) { status = r.status; header = r.get_header_value("X-PD-Bridge"); return true; };
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    if (raw.size() < 2000) raw.append(d, std::min(n, 2000 - raw.size()));  // an error reply's message
    buf.append(d, n);
    size_t pos;
    while ((pos = buf.find('\n')) != std::string::npos) {
      std::string line = buf.substr(0, pos);
      buf.erase(0, pos + 1);
      if (line.rfind("data: ", 0) != 0 || line == "data: [DONE]") continue;
      auto ev = json::parse(line.substr(6), nullptr, false);
      if (ev.is_discarded()) continue;
      if (ev.contains("choices") && !ev["choices"].empty()) {
        const json delta = ev["choices"][0].contains("delta") && ev["choices"][0]["delta"].is_object() ? ev["choices"][0]["delta"] : json::object();
        auto str = [&](const char* k) { return delta.contains(k) && delta[k].is_string() ? delta[k].get<std::string>() : std::string(); };
        const std::string piece = str("content").empty() ? str("reasoning_content") : str("content");
        if (!piece.empty() && ttft < 0) ttft = std::chrono::duration<double>(Clock::now() - t0).count();
        text += piece;
        if (!piece.empty()) ++pieces;
      }
      if (ev.contains("timings") && ev["timings"].is_object()) timings = ev["timings"];
    }
    return stop_after <= 0 || pieces < stop_after;
  };
  auto r = c.send(req);
  const double total = std::chrono::duration<double>(Clock::now() - t0).count();
  const bool hung_up = stop_after > 0 && pieces >= stop_after;
  json row = {{"leg", native ? "native" : "bridged"}, {"http_status", r || hung_up ? status : 0}, {"ttft_s", ttft}, {"total_s", total}, {"answer", text}};
  if (stop_after > 0) row["stopped_after"] = pieces;
  if (!r && !hung_up) row["error"] = httplib::to_string(r.error());
  else if (status != 200) row["error"] = raw;
  row["prompt_tokens"] = timings.value("prompt_n", 0) + timings.value("cache_n", 0);
  row["cached_tokens"] = timings.value("cache_n", 0);
  row["decode_tok_s"] = timings.value("predicted_per_second", 0.0);
  row["generated_tokens"] = timings.value("predicted_n", 0);
  if (!header.empty()) {
    auto v = json::parse(header, nullptr, false);
    if (!v.is_discarded()) {
      row["verdict"] = v.value("verdict", "");
      for (const char* k : {"t_tokenize_s", "t_probe_s", "t_engine_s", "t_wire_s", "t_restore_s", "t_bridge_s", "bytes", "bridged_tokens"})
        if (v.contains(k)) row[k] = v[k];
    }
  } else {
    row["verdict"] = "native (direct to the decoder)";
  }
  row["transport"] = native ? "none" : "http";
  return row;
}

// The protocol measures warm engines: a fresh front door learns the decoder's state layout in the background
// (a probe prefill: 11-14 s on an 8B CPU decoder), and a request that arrives meanwhile waits for it, which
// on the H200 box put 13.5 s of startup into the first bridged TTFT. Waits while /health says "probing", or
// for up to 30 s while it reports no layout yet (a failed probe leaves none; the first request probes again).
void wait_for_warm_front(const std::string& url) {
  const auto t = parse_http_url(url);
  httplib::Client c(t.host, t.port);
  c.set_read_timeout(10, 0);
  const auto t0 = Clock::now();
  bool said = false;
  for (;;) {
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    auto r = c.Get("/health");
    if (!r || r->status != 200) return;  // not a pdbridge front door, or down: the runs report it
    auto j = json::parse(r->body, nullptr, false);
    if (j.is_discarded() || !j.contains("layout")) return;
    const json& layout = j["layout"];
    const bool probing = layout.is_string() && layout.get<std::string>() == "probing";
    if (!probing && (!layout.is_null() || waited > 30)) return;
    if (waited > 600) return;
    if (!said) fmt::print(stderr, "[bench cold] waiting for the front door to learn the decoder's layout ...\n");
    said = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
}

// A cold prompt should meet an idle decoder: after a run that hung up early (--stop-after) or timed out, the
// decoder finishes its current step (or prompt batch) before it cancels, and the next prompt's restore or
// prefill waited behind it (on the H200 box: 0.4 s at 32K, and 28 s behind a cancelled native prefill). Waits
// (up to 120 s) until llama-server's /slots, read directly or through the front door, shows no slot processing.
void wait_until_decoder_idle(const std::string& url, const std::string& key) {
  const auto t = parse_http_url(url);
  httplib::Client c(t.host, t.port);
  c.set_read_timeout(120, 0);
  httplib::Headers h;
  if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
  const auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < 120) {
    auto r = c.Get("/slots", h);
    if (!r || r->status != 200) return;  // no slots endpoint (--no-slots): nothing to wait on
    auto j = json::parse(r->body, nullptr, false);
    if (!j.is_array()) return;
    bool busy = false;
    for (const auto& slot : j) busy = busy || (slot.is_object() && slot.value("is_processing", false));
    if (!busy) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

NeedleDocument make_needle_document(int64_t chars, uint64_t seed, const std::string& corpus_dir) {
  const auto d = make_document(python_sources(corpus_dir), chars, seed, 0);
  return {d.text, d.marker};
}

int run_bench_cold(const BenchColdOptions& o) {
  if (o.front_url.empty()) throw std::invalid_argument("--front is required");
  if (o.native_url.empty() && !o.skip_native) throw std::invalid_argument("--native-url is required (or --skip-native)");
  if (o.skip_native && o.skip_bridged) throw std::invalid_argument("--skip-native and --skip-bridged leave nothing to run");
  const auto files = python_sources(o.corpus_dir);
  uint64_t seed = o.seed ? o.seed : uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  std::ofstream out(o.out, std::ios::app);
  if (!out) throw std::runtime_error("cannot write " + o.out);
  std::map<std::pair<int64_t, std::string>, std::vector<json>> rows;
  const int first_leg = o.skip_bridged ? 1 : 0, last_leg = o.skip_native ? 0 : 1;
  const int legs = last_leg - first_leg + 1;
  if (first_leg == 0) wait_for_warm_front(o.front_url);
  int done = 0, total = int(o.chars.size()) * o.runs * legs;
  for (int64_t chars : o.chars)
    for (int run = 0; run < o.runs; ++run)
      for (int leg = first_leg; leg <= last_leg; ++leg) {
        const bool native = leg == 1;
        const uint64_t s = ++seed;  // a fresh seed for every prompt: nothing is shared with an earlier one
        const Doc d = make_document(files, chars, s, run);
        fmt::print(stderr, "\r[bench cold] {}/{}: {} chars, run {}, {} ...            ", done + 1, total, chars, run + 1, native ? "native" : "bridged");
        wait_until_decoder_idle(native ? o.native_url : o.front_url, o.api_key);
        json row = run_leg(native ? o.native_url : o.front_url, o.api_key, d.text, o.max_tokens, native, o.stop_after);
        row["chars"] = chars;
        row["seed"] = s;
        row["marker"] = d.marker;
        row["marker_found"] = row["answer"].get<std::string>().find(d.marker) != std::string::npos;
        row["max_tokens"] = o.max_tokens;
        out << row.dump() << "\n";
        out.flush();
        rows[{chars, native ? "native" : "bridged"}].push_back(row);
        ++done;
      }
  fmt::print(stderr, "\n");
  fmt::print("{:>9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>10} {:>7}  verdicts\n", "chars", "leg", "tokens", "TTFT s", "total s", "cached", "decode t/s", "marker");
  for (const auto& [k, v] : rows) {
    std::vector<double> ttft, tot, dec;
    int found = 0;
    std::map<std::string, int> verdicts;
    int64_t tokens = 0, cached = 0;
    for (const auto& r : v) {
      ttft.push_back(r["ttft_s"].get<double>());
      tot.push_back(r["total_s"].get<double>());
      dec.push_back(r["decode_tok_s"].get<double>());
      found += r["marker_found"].get<bool>();
      verdicts[r.contains("error") ? fmt::format("error (HTTP {})", r.value("http_status", 0)) : r.value("verdict", "")]++;
      tokens = r["prompt_tokens"].get<int64_t>();
      cached = r["cached_tokens"].get<int64_t>();
    }
    std::string vs;
    for (auto& [name, n] : verdicts) vs += fmt::format("{}x {}; ", n, name);
    fmt::print("{:>9} {:>8} {:>8} {:>9.2f} {:>9.2f} {:>8} {:>10.1f} {:>4}/{:<2}  {}\n", k.first, k.second, tokens, median(ttft), median(tot), cached,
               median(dec), found, v.size(), vs);
  }
  fmt::print("(medians over runs; every run in {})\n", o.out);
  return 0;
}

int run_bench_plot(const std::string& jsonl, const std::string& png) {
  std::ifstream in(jsonl);
  if (!in) throw std::runtime_error("cannot read " + jsonl);
  const std::string base = png.substr(0, png.rfind('.'));
  std::ofstream nat(base + ".native.dat"), bri(base + ".bridged.dat"), stages(base + ".stages.dat");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto r = json::parse(line, nullptr, false);
    if (r.is_discarded()) continue;
    ++n;
    const bool native = r.value("leg", "") == "native";
    (native ? nat : bri) << r.value("prompt_tokens", 0) << " " << r.value("ttft_s", 0.0) << "\n";
    if (!native)
      stages << r.value("prompt_tokens", 0) << " " << r.value("t_tokenize_s", 0.0) + r.value("t_probe_s", 0.0) << " " << r.value("t_engine_s", 0.0) << " "
             << std::max(0.0, r.value("t_wire_s", 0.0) - r.value("t_engine_s", 0.0)) << " " << r.value("t_restore_s", 0.0) << " "
             << std::max(0.0, r.value("ttft_s", 0.0) - r.value("t_bridge_s", 0.0) - r.value("t_tokenize_s", 0.0)) << "\n";
  }
  nat.close(); bri.close(); stages.close();
  if (n == 0) throw std::runtime_error(jsonl + " holds no runs");
  const std::string script = fmt::format(R"GP(set terminal pngcairo size 1200,500 font ",10"
set output "{0}"
set multiplot layout 1,2
set title "TTFT vs prompt length (cold prompts, fresh seeds)"
set xlabel "prompt tokens"; set ylabel "TTFT (s)"; set key left top; set grid
plot "{1}.native.dat" using 1:2 with points pt 7 title "native (decoder alone)", "{1}.bridged.dat" using 1:2 with points pt 5 title "bridged (pdbridge)"
set title "bridged TTFT breakdown"
set style data histograms; set style histogram rowstacked; set style fill solid 0.8; set boxwidth 0.7
set xlabel "run (prompt tokens)"; set ylabel "seconds"; set xtics rotate by -45
plot "{1}.stages.dat" using 2:xtic(1) title "tokenize + layout probe", "" using 3 title "engine", "" using 4 title "wire beyond engine", "" using 5 title "restore", "" using 6 title "first decode"
unset multiplot
)GP", png, base);
  std::ofstream(base + ".gnuplot") << script;
  auto r = run_capture({"gnuplot", base + ".gnuplot"});
  if (r.exit_code != 0) throw std::runtime_error("gnuplot failed (apt-get install gnuplot-nox): " + r.output);
  fmt::print("wrote {} ({} runs)\n", png, n);
  return 0;
}

}  // namespace pdb
