#include "prefill/server.h"

#include <malloc.h>
#include <sys/sysinfo.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "arch/architectures.h"
#include "cache/cache_kind.h"
#include "common/http_util.h"
#include "common/metrics.h"
#include "common/parallel.h"
#include "cuda/device.h"
#include "formats/gguf.h"
#include "formats/hf_config.h"
#include "prefill/capture.h"
#include "prefill/prefix_cache.h"

namespace pdb {
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// Frames travel from the engine thread to the HTTP writer through this bounded queue.
struct FrameQueue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<wire::Bytes> q;
  size_t bytes = 0, limit;
  bool closed = false, receiver_gone = false;
  explicit FrameQueue(size_t l) : limit(l) {}
  // Never blocks on memory: past the limit the capture seals instead (the engine must not stall or
  // grow without bound behind a slow link); forced frames (the trailer) always go in.
  Emit push(wire::Bytes&& f, bool force) {
    std::lock_guard<std::mutex> l(m);
    if (receiver_gone) return Emit::Gone;
    if (!force && !q.empty() && bytes + f.size() > limit) return Emit::Seal;
    bytes += f.size();
    peak = std::max(peak, bytes);
    q.push_back(std::move(f));
    cv.notify_all();
    return Emit::Ok;
  }
  size_t peak = 0;
  void close() { std::lock_guard<std::mutex> l(m); closed = true; cv.notify_all(); }
  void gone() { std::lock_guard<std::mutex> l(m); receiver_gone = true; cv.notify_all(); }
  bool pop(wire::Bytes& out) {  // false when closed and drained
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return closed || !q.empty(); });
    if (q.empty()) return false;
    out = std::move(q.front());
    q.pop_front();
    bytes -= out.size();
    cv.notify_all();
    return true;
  }
};

// Up to `max_running` captures run at once; the rest wait in arrival order, bounded in number and in time.
class FifoGate {
 public:
  FifoGate(int max_waiting, double max_wait_s, int max_running)
      : max_waiting_(max_waiting), max_wait_(max_wait_s), max_running_(std::max(1, max_running)) {}
  // Returns "" once admitted, else the reason it was refused.
  std::string enter(double* waited_s) {
    std::unique_lock<std::mutex> l(m_);
    const auto t0 = Clock::now();
    if (running_ >= max_running_ && int64_t(next_ - serving_) >= max_waiting_)
      return fmt::format("queue full ({} waiting, {} running)", next_ - serving_, running_);
    const uint64_t ticket = next_++;
    const bool ok = cv_.wait_for(l, std::chrono::duration<double>(max_wait_), [&] { return serving_ == ticket && running_ < max_running_; });
    *waited_s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!ok) {
      abandoned_.push_back(ticket);
      skip_abandoned();
      cv_.notify_all();
      return fmt::format("waited {:.1f}s in the queue", *waited_s);
    }
    ++serving_;
    ++running_;
    peak_ = std::max(peak_, running_);
    skip_abandoned();
    cv_.notify_all();
    return "";
  }
  void leave() {
    std::lock_guard<std::mutex> l(m_);
    --running_;
    cv_.notify_all();
  }
  int64_t depth() { std::lock_guard<std::mutex> l(m_); return int64_t(next_ - serving_); }
  int peak() { std::lock_guard<std::mutex> l(m_); return peak_; }

 private:
  void skip_abandoned() {
    for (bool again = true; again;) {
      again = false;
      for (auto it = abandoned_.begin(); it != abandoned_.end(); ++it)
        if (*it == serving_) { ++serving_; abandoned_.erase(it); again = true; break; }
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  uint64_t next_ = 0, serving_ = 0;
  int running_ = 0, peak_ = 0;
  std::vector<uint64_t> abandoned_;
  int max_waiting_;
  double max_wait_;
  int max_running_;
};

int64_t mem_available_mb() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return -1;
  char line[256];
  int64_t kb = -1;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "MemAvailable: %ld kB", &kb) == 1) break;
  std::fclose(f);
  return kb < 0 ? -1 : kb / 1024;
}

}  // namespace

std::vector<std::string> config_mismatches(const std::string& hf_dir, const std::string& gguf) {
  auto g = GgufFile::open(gguf);
  const RecipeInfo ri = read_recipe_info(*g);
  return architecture(ri.arch).config_mismatches(hf_dir, *g, ri);
}

namespace {

// The prefill server's state (its backend, admission gate, prefix cache, metrics), one method per endpoint.
class PrefillService {
 public:
  PrefillService(const PrefillServerOptions& o, std::shared_ptr<PrefillBackend> engine, std::vector<std::string> mismatches, int64_t default_chunk);
  void health(httplib::Response& res);
  void render_metrics(httplib::Response& res);
  void prefill(const httplib::Request& req, httplib::Response& res);

 private:
  bool refused(const wire::PrefillRequest& pr, httplib::Response& res);  // answered with the 4xx already
  void stream(const wire::PrefillRequest& pr, httplib::Response& res);
  PrefixCacheStats sync_prefix_metrics();  // counters mirror the cache's own totals (it counts under its lock)
  prometheus::Counter& result(const std::string& status) {
    return metrics_.counter("pdbridge_prefill_requests_total", "Capture requests by outcome", {{"status", status}});
  }
  prometheus::Counter& reject(const std::string& reason) {
    return metrics_.counter("pdbridge_prefill_rejected_total", "Requests refused before capture", {{"reason", reason}});
  }

  const PrefillServerOptions& o_;
  std::shared_ptr<PrefillBackend> engine_;
  const RecipeInfo& ri_;
  const HfConfig& hc_;
  const std::string fingerprint_;
  const std::vector<std::string> mismatches_;
  const int64_t default_chunk_;
  Metrics metrics_;
  prometheus::Gauge& m_active_ = metrics_.gauge("pdbridge_prefill_active_requests", "Captures running");
  prometheus::Gauge& m_queue_ = metrics_.gauge("pdbridge_prefill_queue_depth", "Captures waiting");
  prometheus::Histogram& m_wait_ =
      metrics_.histogram("pdbridge_prefill_queue_wait_seconds", "Time a capture waited for the engine", Metrics::seconds_buckets());
  prometheus::Histogram& m_engine_ = metrics_.histogram("pdbridge_prefill_engine_seconds", "Engine time per capture", Metrics::seconds_buckets());
  prometheus::Counter& m_tokens_ = metrics_.counter("pdbridge_prefill_tokens_total", "Tokens captured");
  prometheus::Counter& m_bytes_ = metrics_.counter("pdbridge_prefill_wire_bytes_total", "Bytes sent on the wire");
  prometheus::Gauge& m_tok_s_ = metrics_.gauge("pdbridge_prefill_tokens_per_second", "Prefill rate of the last capture");
  FifoGate gate_;
  PrefixCache prefix_cache_;
  prometheus::Counter& m_pc_hits_ = metrics_.counter("pdbridge_prefill_prefix_cache_hits_total", "Tail captures that resumed from a cached prefix");
  prometheus::Counter& m_pc_misses_ =
      metrics_.counter("pdbridge_prefill_prefix_cache_misses_total", "Tail captures with no cached prefix to resume from");
  prometheus::Counter& m_pc_evict_ = metrics_.counter("pdbridge_prefill_prefix_cache_evictions_total", "Cached prefixes evicted for room");
  prometheus::Counter& m_pc_reused_ =
      metrics_.counter("pdbridge_prefill_prefix_reused_tokens_total", "Positions the engine resumed after instead of computing");
  prometheus::Gauge& m_pc_bytes_ = metrics_.gauge("pdbridge_prefill_prefix_cache_bytes", "Memory the cached prefixes occupy");
  prometheus::Gauge& m_pc_entries_ = metrics_.gauge("pdbridge_prefill_prefix_cache_entries", "Cached prefixes");
  prometheus::Counter& m_computed_ = metrics_.counter("pdbridge_prefill_computed_tokens_total", "Positions the engine computed");
  prometheus::Counter& m_tail_ = metrics_.counter("pdbridge_prefill_tail_requests_total", "Captures of a tail (the decoder held a prefix)");
  std::mutex prefix_metrics_mu_;
  PrefixCacheStats last_prefix_;
  size_t queue_limit_ = 0;
  prometheus::Gauge& m_peak_ = metrics_.gauge("pdbridge_prefill_capture_peak_bytes", "Largest frame backlog of the last capture");
  prometheus::Gauge& m_peak_conc_ = metrics_.gauge("pdbridge_prefill_peak_concurrent_captures", "Most captures that ran at once");
};

PrefillService::PrefillService(const PrefillServerOptions& o, std::shared_ptr<PrefillBackend> engine, std::vector<std::string> mismatches,
                               int64_t default_chunk)
    : o_(o), engine_(std::move(engine)), ri_(engine_->info()), hc_(engine_->config()), fingerprint_(recipe_fingerprint(ri_)),
      mismatches_(std::move(mismatches)), default_chunk_(default_chunk), gate_(o.max_queue, o.max_queue_wait_s, o.max_concurrent),
      prefix_cache_(engine_->resumable() ? size_t(o.prefix_cache_gb * double(1ull << 30)) : 0) {
  spdlog::info("prefill: {} {} layers, recipe fingerprint {}", ri_.arch, ri_.n_layer, fingerprint_);
  if (engine_->resumable())
    spdlog::info("prefill: prefix cache {:.2f} GiB{}", o.prefix_cache_gb, prefix_cache_.enabled() ? "" : " (off)");
  else
    spdlog::info("prefill: no prefix cache: the {} engine for {} always computes every token (a tail capture sends only the tail)", engine_->device(),
                 ri_.arch);
  int64_t limit_mb = o.memory_limit_mb;
  if (limit_mb <= 0) limit_mb = std::max<int64_t>(256, mem_available_mb() / 4);
  queue_limit_ = size_t(limit_mb) << 20;
  spdlog::info("prefill: capture memory limit {} MiB{}", limit_mb, o.link_gbps > 0 ? fmt::format(", sender paced to {} Gbit/s", o.link_gbps) : "");
}

PrefixCacheStats PrefillService::sync_prefix_metrics() {
  const PrefixCacheStats s = prefix_cache_.stats();
  std::lock_guard<std::mutex> l(prefix_metrics_mu_);
  m_pc_hits_.Increment(double(s.hits - last_prefix_.hits));
  m_pc_misses_.Increment(double(s.misses - last_prefix_.misses));
  m_pc_evict_.Increment(double(s.evictions - last_prefix_.evictions));
  m_pc_reused_.Increment(double(s.reused_tokens - last_prefix_.reused_tokens));
  m_pc_bytes_.Set(double(s.bytes));
  m_pc_entries_.Set(double(s.entries));
  last_prefix_ = s;
  return s;
}

void PrefillService::health(httplib::Response& res) {
  res.set_content(json{{"ok", true}, {"role", "prefill"}, {"device", engine_->device()}, {"arch", ri_.arch}, {"fingerprint", fingerprint_},
                       {"geometry", recipe_geometry(ri_)}, {"model", o_.model}, {"recipe", o_.recipe}, {"weights", engine_->weights()},
                       {"attention", o_.device == "cuda" ? cuda::attention_kernel_summary() : "cpu"}, {"active", m_active_.Value()}, {"queue", gate_.depth()}, {"mem_available_mb", mem_available_mb()},
                       {"config_mismatches", mismatches_}, {"prefix_cache", [&] {
                          const auto s = sync_prefix_metrics();
                          return json{{"enabled", prefix_cache_.enabled()}, {"max_bytes", s.max_bytes}, {"bytes", s.bytes}, {"entries", s.entries},
                                      {"hits", s.hits}, {"misses", s.misses}, {"evictions", s.evictions}, {"superseded", s.superseded},
                                      {"reused_tokens", s.reused_tokens}};
                        }()}}.dump(),
                  "application/json");
}

void PrefillService::render_metrics(httplib::Response& res) {
  m_queue_.Set(double(gate_.depth()));
  m_peak_conc_.Set(double(gate_.peak()));
  sync_prefix_metrics();
  res.set_content(metrics_.render(), "text/plain; version=0.0.4");
}

void PrefillService::prefill(const httplib::Request& req, httplib::Response& res) {
  if (!check_bearer(o_.api_key, req, res)) { reject("auth").Increment(); return; }
  wire::PrefillRequest pr;
  try {
    pr = wire::PrefillRequest::parse(json::parse(req.body));
  } catch (const json::exception& e) {
    reject("bad_request").Increment();
    return json_error(res, 400, json_body_error(e), "invalid_request_error");
  } catch (const std::invalid_argument& e) {
    reject("bad_request").Increment();
    return json_error(res, 400, e.what(), "invalid_request_error");
  }
  if (refused(pr, res)) return;
  double waited = 0;
  m_queue_.Increment();
  const std::string busy = gate_.enter(&waited);
  m_queue_.Decrement();
  m_wait_.Observe(waited);
  if (!busy.empty()) {
    reject("queue").Increment();
    return json_error(res, 503, "prefill busy: " + busy, "queue_full");
  }
  stream(pr, res);
}

bool PrefillService::refused(const wire::PrefillRequest& pr, httplib::Response& res) {
  if (pr.fingerprint != fingerprint_) {
    reject("fingerprint").Increment();
    json_error(res, 409, fmt::format("fingerprint mismatch: front expects {}, this server's recipe is {}", pr.fingerprint, fingerprint_),
               "fingerprint_mismatch");
    return true;
  }
  if (int64_t(pr.tokens.size()) > o_.max_tokens) {
    reject("too_long").Increment();
    json_error(res, 413, fmt::format("{} tokens exceed this server's limit of {}", pr.tokens.size(), o_.max_tokens), "invalid_request_error");
    return true;
  }
  if (pr.tail_from > 0 && !cache_kind_traits(ri_.cache_kind).per_token_rows) {
    reject("bad_request").Increment();
    json_error(res, 400, fmt::format("tail_from: a pooled cache ({}) is captured whole; send tail_from 0", ri_.arch), "invalid_request_error");
    return true;
  }
  for (int32_t t : pr.tokens)
    if (t >= hc_.vocab_size) {
      reject("bad_request").Increment();
      json_error(res, 400, fmt::format("token id {} outside the vocabulary ({})", t, hc_.vocab_size), "invalid_request_error");
      return true;
    }
  return false;
}

// The capture on a worker thread of its own, its frames through a bounded queue to the response (paced where
// --link-gbps says); the gate is left when the capture ends or the receiver goes.
void PrefillService::stream(const wire::PrefillRequest& pr, httplib::Response& res) {
  const int64_t chunk = pr.chunk > 0 ? pr.chunk : default_chunk_;
  auto queue = std::make_shared<FrameQueue>(queue_limit_);
  auto pace_start = std::make_shared<Clock::time_point>();
  auto paced_bytes = std::make_shared<double>(0);
  auto worker = std::make_shared<std::thread>();
  auto started = std::make_shared<bool>(false);
  auto left = std::make_shared<std::atomic<bool>>(false);
  auto leave_gate = [this, left] { if (!left->exchange(true)) gate_.leave(); };
  res.set_header("X-PD-Wire-Version", std::to_string(wire::kWireVersion));
  res.set_chunked_content_provider(
      "application/x-pdbridge-frames",
      [=, this](size_t, httplib::DataSink& sink) {
        if (!*started) {
          *started = true;
          *pace_start = Clock::now();
          *worker = std::thread([=, this] {
            m_active_.Increment();
            auto r = run_capture(*engine_, pr, chunk, EmitFn([&](wire::Bytes&& f, bool force) { return queue->push(std::move(f), force); }),
                                 &prefix_cache_);
            m_computed_.Increment(double(r.computed));
            if (r.tail_from > 0) m_tail_.Increment();
            m_peak_.Set(double(queue->peak));
            m_active_.Decrement();
            m_engine_.Observe(r.engine_s);
            m_tokens_.Increment(double(r.tokens));
            if (r.engine_s > 0) m_tok_s_.Set(double(r.tokens) / r.engine_s);
            result(r.status).Increment();
            spdlog::info("prefill: capture tokens={} tail_from={} reused={} computed={} status={} sent={} engine_s={:.3f} tok_s={:.0f} backlog_peak_mb={:.1f}{}",
                         pr.tokens.size(), r.tail_from, r.prefix_reused, r.computed, r.status, r.tokens, r.engine_s, r.engine_s > 0 ? double(r.tokens) / r.engine_s : 0.0, double(queue->peak) / (1 << 20),
                         r.reason.empty() ? "" : " reason=\"" + r.reason + "\"");
            queue->close();
            leave_gate();
          });
        }
        wire::Bytes f;
        if (!queue->pop(f)) {
          sink.done();
          return true;
        }
        if (o_.link_gbps > 0) {  // link emulation: hold the frame until the link would have carried it
          *paced_bytes += double(f.size());
          const auto due = *pace_start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*paced_bytes * 8 / (o_.link_gbps * 1e9)));
          std::this_thread::sleep_until(due);
        }
        if (!write_in_pieces(sink, f.data(), f.size())) {
          queue->gone();
          return false;
        }
        m_bytes_.Increment(double(f.size()));
        return true;
      },
      [=](bool) {
        queue->gone();
        if (worker->joinable()) worker->join();
        leave_gate();
        // Frames are megabytes each; glibc keeps freed ones in its heaps (its mmap threshold rises past
        // their size), so without this the server's RSS stays at its largest backlog after a capture.
        malloc_trim(0);
      });
}

}  // namespace

int run_prefill_server(const PrefillServerOptions& o) {
  if (o.device != "cpu" && o.device != "cuda") throw std::invalid_argument("--device must be cpu or cuda");
  check_kv_dtype(o.device, o.kv_dtype);
  const RecipeInfo decoder_info = read_recipe_info(*GgufFile::open(o.recipe));
  const Architecture& arch = architecture(decoder_info.arch);
  if (o.tp < 1) throw std::invalid_argument("--tp must be at least 1");
  if (o.tp > 1 && (o.device != "cuda" || !arch.tensor_parallel))
    throw std::invalid_argument(fmt::format("--tp > 1 needs --device cuda and a model the CUDA engine splits ({}); {} is not split yet",
                                            tensor_parallel_architectures(), arch.name));
  const auto mism = config_mismatches(o.model, o.recipe);
  for (const auto& m : mism) spdlog::error("prefill: config mismatch: {}", m);
  if (!mism.empty() && !o.allow_config_mismatch)
    throw std::runtime_error(fmt::format("{} differences between {}/config.json and {} (first: {}); fix one side or pass --allow-config-mismatch",
                                         mism.size(), o.model, o.recipe, mism[0]));
  const int threads = o.threads > 0 ? o.threads : default_threads();
  spdlog::info("prefill: loading model {} and recipe {}", o.model, o.recipe);
  const int64_t default_chunk = o.chunk > 0 ? o.chunk : o.device == "cuda" ? 4096 : 512;
  // --chunk not given on the GPU: the engine's own choice (0), its preferred_chunk below
  std::shared_ptr<PrefillBackend> engine = arch.make_backend({.model = o.model, .recipe = o.recipe, .device = o.device, .kv_dtype = o.kv_dtype,
                                                               .threads = threads, .chunk = o.chunk > 0 || o.device != "cuda" ? default_chunk : 0, .tp = o.tp, .tp_one_gpu = o.tp_one_gpu,
                                                               .max_gpu_mem_gib = o.max_gpu_mem_gib, .faithful = !o.cpu_fast, .kv_rows = o.kv_rows,
                                                               .numerics = o.numerics});
  spdlog::info("prefill: engine on {} ({})", engine->device(), engine->weights().empty() ? "weights as loaded" : engine->weights());

  // where --chunk is not given, the engine's own choice (DeepSeek-V4 on the GPU: the largest that fits; a MoE model's
  // experts: ~512 rows each, CudaEngine::default_chunk) over the device's default
  const int64_t service_chunk = o.chunk > 0 ? o.chunk : engine->preferred_chunk() > 0 ? engine->preferred_chunk() : default_chunk;
  if (service_chunk != default_chunk) spdlog::info("prefill: chunks of {} tokens (the engine's choice; --chunk sets one)", service_chunk);
  PrefillService service(o, engine, mism, service_chunk);
  httplib::Server srv;
  install_json_error_handler(srv);
  srv.Get("/health", [&](const httplib::Request&, httplib::Response& res) { service.health(res); });
  srv.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) { service.render_metrics(res); });
  srv.Post("/v1/bridge/prefill", [&](const httplib::Request& req, httplib::Response& res) { service.prefill(req, res); });
  srv.set_payload_max_length(o.max_body_mb << 20);
  srv.new_task_queue = [] { return new httplib::ThreadPool(16); };
  spdlog::info("prefill: listening on {}:{}{}", o.host, o.port, o.api_key.empty() ? "" : " (api key required)");
  if (!listen_with_backlog(srv, o.host, o.port)) throw std::runtime_error(fmt::format("cannot listen on {}:{}", o.host, o.port));
  return 0;
}

}  // namespace pdb
