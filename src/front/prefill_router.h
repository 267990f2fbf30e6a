// The prefill servers of a front door (--prefill A,B): which one a capture asks first (for a tail, the one that
// bridged the slot's last turn; then by load from their /health; the ones that do not answer last), what each
// attempt came to (metrics), and their health for /health.
#pragma once
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/metrics.h"
#include "front/decoder_client.h"

namespace pdb {

class PrefillRouter {
 public:
  struct Server { std::string url; HttpTarget target; };
  // Throws std::invalid_argument for an empty list or a URL named twice. `metrics` is used after construction only.
  PrefillRouter(const std::string& url_list, Metrics& metrics);
  const std::vector<Server>& servers() const { return servers_; }
  const Server& server(size_t i) const { return servers_.at(i); }
  void declare_metrics();  // every server's series at 0
  std::vector<size_t> order(int slot, bool tail);
  void outcome(size_t server, const char* outcome);  // "ok" or "failed"
  void served(int slot, const std::string& url);     // the server that bridged the slot's last turn
  nlohmann::json health();                          // one entry per server, asked in parallel

 private:
  Metrics& metrics_;
  std::vector<Server> servers_;
  std::mutex affinity_m_;
  std::unordered_map<int, std::string> affinity_;  // slot -> the prefill server that bridged its last turn
};

}  // namespace pdb
