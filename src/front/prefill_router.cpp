#include "front/prefill_router.h"

#include <algorithm>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>

namespace pdb {

PrefillRouter::PrefillRouter(const std::string& url_list, Metrics& metrics) : metrics_(metrics) {
  for (const std::string& url : split_url_list(url_list)) {
    for (const auto& p : servers_)
      if (p.url == url) throw std::invalid_argument("--prefill names " + url + " twice");
    servers_.push_back({url, parse_http_url(url)});
  }
  if (servers_.empty()) throw std::invalid_argument("--prefill needs at least one URL");
}

void PrefillRouter::declare_metrics() {
  for (const auto& p : servers_) {
    for (const char* oc : {"ok", "failed"})
      metrics_.counter("pdbridge_front_prefill_attempts_total", "Capture attempts per prefill server", {{"server", p.url}, {"outcome", oc}});
    metrics_.gauge("pdbridge_front_prefill_up", "Whether the prefill server answered /health at the last scrape", {{"server", p.url}});
  }
}

void PrefillRouter::served(int slot, const std::string& url) {
  std::lock_guard<std::mutex> l(affinity_m_);
  affinity_[slot] = url;
}

// Which prefill server to ask first: for a tail, the one that served this slot's earlier turn (it holds the
// conversation's prefix); then the others by load (running + waiting captures, from their /health); the ones
// that do not answer last (they are still tried: a refused connection fails at once).
std::vector<size_t> PrefillRouter::order(int slot, bool tail) {
  std::vector<size_t> order(servers_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (servers_.size() == 1) return order;
  std::vector<double> load(servers_.size(), 1e18);
  const nlohmann::json h = health();
  for (size_t i = 0; i < servers_.size(); ++i)
    if (h[i].value("ok", false)) load[i] = h[i].value("active", 0.0) + h[i].value("queue", 0.0);
  std::string affine;
  if (tail) {
    std::lock_guard<std::mutex> l(affinity_m_);
    if (auto it = affinity_.find(slot); it != affinity_.end()) affine = it->second;
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const bool ua = load[a] < 1e18, ub = load[b] < 1e18;
    if (ua != ub) return ua;
    const bool fa = !affine.empty() && servers_[a].url == affine, fb = !affine.empty() && servers_[b].url == affine;
    if (fa != fb) return fa;
    return load[a] < load[b];
  });
  return order;
}

void PrefillRouter::outcome(size_t server, const char* outcome) {
  metrics_.counter("pdbridge_front_prefill_attempts_total", "Capture attempts per prefill server", {{"server", servers_[server].url}, {"outcome", outcome}})
      .Increment();
}

nlohmann::json PrefillRouter::health() {
  std::vector<nlohmann::json> out(servers_.size());
  std::vector<std::thread> ts;
  for (size_t i = 0; i < servers_.size(); ++i)
    ts.emplace_back([&, i] {
      nlohmann::json e = {{"url", servers_[i].url}, {"ok", false}};
      httplib::Client c(servers_[i].target.host, servers_[i].target.port);
      c.set_connection_timeout(1, 0);
      c.set_read_timeout(2, 0);
      auto r = c.Get("/health");
      if (r && r->status == 200) {
        try {
          const nlohmann::json h = nlohmann::json::parse(r->body);
          e["ok"] = true;
          for (const char* k : {"device", "arch", "fingerprint", "active", "queue", "prefix_cache"})
            if (h.contains(k)) e[k] = h[k];
        } catch (...) { e["error"] = "health is not JSON"; }
      } else {
        e["error"] = r ? fmt::format("HTTP {}", r->status) : httplib::to_string(r.error());
      }
      out[i] = std::move(e);
    });
  for (auto& t : ts) t.join();
  for (size_t i = 0; i < servers_.size(); ++i)
    metrics_.gauge("pdbridge_front_prefill_up", "Whether the prefill server answered /health at the last scrape", {{"server", servers_[i].url}})
        .Set(out[i].value("ok", false) ? 1 : 0);
  return nlohmann::json(out);
}

}  // namespace pdb
