// Prometheus metrics (prometheus-cpp core) rendered in the text exposition format for /metrics.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

namespace pdb {

class Metrics {
 public:
  Metrics() : registry_(std::make_shared<prometheus::Registry>()) {}
  prometheus::Counter& counter(const std::string& name, const std::string& help, const std::map<std::string, std::string>& labels = {});
  prometheus::Gauge& gauge(const std::string& name, const std::string& help, const std::map<std::string, std::string>& labels = {});
  prometheus::Histogram& histogram(const std::string& name, const std::string& help, const std::vector<double>& buckets,
                                   const std::map<std::string, std::string>& labels = {});
  std::string render() const;
  static std::vector<double> seconds_buckets();  // 1 ms .. 20 min

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::map<std::string, prometheus::Family<prometheus::Counter>*> counters_;
  std::map<std::string, prometheus::Family<prometheus::Gauge>*> gauges_;
  std::map<std::string, prometheus::Family<prometheus::Histogram>*> histograms_;
  mutable std::mutex m_;
};

}  // namespace pdb
