#include "tools/eval_parity.h"

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <random>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "front/decoder_client.h"

namespace pdb {
using json = nlohmann::json;

namespace {

struct Completion {
  std::vector<int32_t> ids;
  std::vector<std::map<int32_t, double>> top;  // per generated position: id -> logprob
  std::string verdict;
  int64_t cached = 0, prompt_n = 0;
};

Completion complete(const std::string& url, const std::string& key, const std::string& prompt, int n_predict, int n_probs, bool native) {
  auto t = parse_http_url(url);
  httplib::Client c(t.host, t.port);
  c.set_read_timeout(3600, 0);
  json body = {{"prompt", prompt}, {"n_predict", n_predict}, {"n_probs", n_probs}, {"temperature", 0}};
  if (native) body["cache_prompt"] = false;
  httplib::Headers h;
  if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
  auto r = c.Post("/completion", h, body.dump(), "application/json");
  if (!r || r->status != 200) throw std::runtime_error(fmt::format("{}: {}", url, r ? r->body.substr(0, 300) : httplib::to_string(r.error())));
  auto j = json::parse(r->body);
  Completion out;
  for (const auto& p : j.value("completion_probabilities", json::array())) {
    out.ids.push_back(p["id"].get<int32_t>());
    std::map<int32_t, double> m;
    for (const auto& tp : p["top_logprobs"]) m[tp["id"].get<int32_t>()] = tp["logprob"].get<double>();
    out.top.push_back(std::move(m));
  }
  out.verdict = r->get_header_value("X-PD-Bridge");
  if (j.contains("timings")) {
    out.cached = j["timings"].value("cache_n", int64_t(0));
    out.prompt_n = j["timings"].value("prompt_n", int64_t(0));
  }
  return out;
}

// KL(P || Q) restricted to P's top-K support, both renormalized there (a token Q does not list gets
// half of Q's smallest listed probability): the standard top-K approximation.
double kl_topk(const std::map<int32_t, double>& p, const std::map<int32_t, double>& q) {
  if (p.empty() || q.empty()) return 0;
  double qmin = 0;
  for (auto& [id, lp] : q) qmin = std::min(qmin, lp);
  double pz = 0, qz = 0;
  std::vector<std::pair<double, double>> pq;
  for (auto& [id, lp] : p) {
    auto it = q.find(id);
    const double qp = std::exp(it != q.end() ? it->second : qmin - std::log(2.0));
    pq.emplace_back(std::exp(lp), qp);
    pz += std::exp(lp);
    qz += qp;
  }
  double kl = 0;
  for (auto& [pp, qq] : pq) kl += (pp / pz) * (std::log(pp / pz) - std::log(qq / qz));
  return std::max(0.0, kl);
}

struct Agg {
  double kl = 0;
  int top1 = 0, greedy = 0, n = 0;
  double prefix = 0;
  void add(const Completion& a, const Completion& b) {
    ++n;
    if (!a.top.empty() && !b.top.empty()) kl += kl_topk(a.top[0], b.top[0]);
    top1 += !a.ids.empty() && !b.ids.empty() && a.ids[0] == b.ids[0];
    greedy += a.ids == b.ids;
    size_t k = 0;
    while (k < a.ids.size() && k < b.ids.size() && a.ids[k] == b.ids[k]) ++k;
    prefix += double(k);
  }
  json to_json() const {
    return {{"prompts", n}, {"mean_kl_first_token", n ? kl / n : 0}, {"top1_agreement", n ? double(top1) / n : 0},
            {"greedy_match_rate", n ? double(greedy) / n : 0}, {"mean_matching_prefix_tokens", n ? prefix / n : 0}};
  }
};

std::string haystack(uint64_t seed, int64_t chars) {
  static const char* words[] = {"def", "return", "self", "import", "class", "for", "in", "if", "else", "None", "value", "data", "list",
                                "index", "path", "open", "read", "write", "error", "True", "False", "(", ")", ":", "=", "\n    "};
  std::mt19937_64 g(seed);
  std::string s;
  while (int64_t(s.size()) < chars) { s += words[g() % (sizeof words / sizeof *words)]; s += ' '; }
  return s;
}

}  // namespace

ParityProbe probe_output_parity(const std::string& front_url, const std::string& decoder_url, const std::string& api_key, int64_t chars,
                                uint64_t seed) {
  const std::string prompt = haystack(seed, chars);
  Completion nat = complete(decoder_url, "", prompt, 1, 20, true);
  Completion bri = complete(front_url, api_key, prompt, 1, 20, false);
  ParityProbe p;
  auto vj = json::parse(bri.verdict, nullptr, false);
  if (!vj.is_discarded()) {
    p.verdict = vj.value("verdict", "?");
    p.fidelity = vj.value("fidelity", json());
    p.prompt_tokens = vj.value("tokens", int64_t(0));
  }
  p.tokens_cached = bri.cached;
  if (!nat.top.empty() && !bri.top.empty()) p.kl_first_token = kl_topk(nat.top[0], bri.top[0]);
  p.same_first_token = !nat.ids.empty() && !bri.ids.empty() && nat.ids[0] == bri.ids[0];
  return p;
}

int run_eval_parity(const EvalParityOptions& o) {
  uint64_t seed = o.seed ? o.seed : uint64_t(std::chrono::system_clock::now().time_since_epoch().count());
  Agg bridge, quant;
  std::map<std::string, int> verdicts;
  std::ofstream out;
  if (!o.out.empty()) out.open(o.out, std::ios::app);
  for (int i = 0; i < o.prompts; ++i) {
    const std::string prompt = haystack(++seed, o.chars);
    fmt::print(stderr, "\r[eval parity] prompt {}/{} ...   ", i + 1, o.prompts);
    // native first on a fresh prompt, then bridged (the front's slot holds nothing of it)
    Completion nat = complete(o.decoder_url, "", prompt, o.n_predict, o.n_probs, true);
    Completion bri = complete(o.front_url, o.api_key, prompt, o.n_predict, o.n_probs, false);
    std::string v = "?";
    auto vj = json::parse(bri.verdict, nullptr, false);
    if (!vj.is_discarded()) v = vj.value("verdict", "?");
    verdicts[v.rfind("declined", 0) == 0 ? "declined" : v.rfind("partial", 0) == 0 ? "partial" : v]++;
    bridge.add(nat, bri);
    json row = {{"seed", seed}, {"verdict", v}, {"native_ids", nat.ids}, {"bridged_ids", bri.ids}, {"cached", bri.cached}};
    if (!nat.top.empty() && !bri.top.empty()) row["kl_first_token"] = kl_topk(nat.top[0], bri.top[0]);
    if (!o.ref_decoder_url.empty()) {
      Completion ref = complete(o.ref_decoder_url, "", prompt, o.n_predict, o.n_probs, true);
      quant.add(nat, ref);
      row["ref_ids"] = ref.ids;
    }
    if (out) out << row.dump() << "\n";
  }
  fmt::print(stderr, "\n");
  json report = {{"bridged_vs_native", bridge.to_json()}};
  if (!o.ref_decoder_url.empty()) report["reference_vs_native"] = quant.to_json();
  json vs = json::object();
  for (auto& [k, n] : verdicts) vs[k] = n;
  report["verdicts"] = vs;
  fmt::print("{}\n", report.dump(2));
  return 0;
}

}  // namespace pdb
