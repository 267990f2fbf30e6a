#include "common/metrics.h"

#include <prometheus/text_serializer.h>

namespace pdb {

prometheus::Counter& Metrics::counter(const std::string& name, const std::string& help, const std::map<std::string, std::string>& labels) {
  std::lock_guard<std::mutex> l(m_);
  auto& f = counters_[name];
  if (!f) f = &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
  return f->Add(labels);
}

prometheus::Gauge& Metrics::gauge(const std::string& name, const std::string& help, const std::map<std::string, std::string>& labels) {
  std::lock_guard<std::mutex> l(m_);
  auto& f = gauges_[name];
  if (!f) f = &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
  return f->Add(labels);
}

prometheus::Histogram& Metrics::histogram(const std::string& name, const std::string& help, const std::vector<double>& buckets,
                                          const std::map<std::string, std::string>& labels) {
  std::lock_guard<std::mutex> l(m_);
  auto& f = histograms_[name];
  if (!f) f = &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
  return f->Add(labels, prometheus::Histogram::BucketBoundaries(buckets.begin(), buckets.end()));
}

std::string Metrics::render() const {
  prometheus::TextSerializer s;
  return s.Serialize(registry_->Collect());
}

std::vector<double> Metrics::seconds_buckets() {
  return {0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200};
}

}  // namespace pdb
