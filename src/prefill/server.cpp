#include "prefill/server.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <httplib.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "common/parallel.h"
#include "cuda/device.h"
#include "prefill/capture.h"

namespace pdb {
using json = nlohmann::json;

namespace {

void json_error(httplib::Response& res, int status, const std::string& msg, const std::string& type) {
  res.status = status;
  res.set_content(json{{"error", {{"message", msg}, {"type", type}}}}.dump(), "application/json");
}

// Frames travel from the engine thread to the HTTP writer through this bounded queue.
struct FrameQueue {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::vector<uint8_t>> q;
  size_t bytes = 0, limit;
  bool closed = false, receiver_gone = false;
  explicit FrameQueue(size_t l) : limit(l) {}
  bool push(std::vector<uint8_t>&& f) {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return receiver_gone || bytes < limit; });
    if (receiver_gone) return false;
    bytes += f.size();
    q.push_back(std::move(f));
    cv.notify_all();
    return true;
  }
  void close() { std::lock_guard<std::mutex> l(m); closed = true; cv.notify_all(); }
  void gone() { std::lock_guard<std::mutex> l(m); receiver_gone = true; cv.notify_all(); }
  // false when closed and drained
  bool pop(std::vector<uint8_t>& out) {
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

}  // namespace

int run_prefill_server(const PrefillServerOptions& o) {
  if (o.device == "cuda") {
    if (cuda::device_count() == 0) throw std::runtime_error("--device cuda: " + cuda::device_summary());
    throw std::runtime_error("--device cuda: the CUDA engine is not built yet in this version; use --device cpu");
  }
  if (o.device != "cpu") throw std::invalid_argument("--device must be cpu or cuda");
  const int threads = o.threads > 0 ? o.threads : default_threads();
  spdlog::info("prefill: loading model {} and recipe {}", o.model, o.recipe);
  auto engine = std::make_shared<CpuEngine>(o.model, threads);
  std::shared_ptr<Recipe> recipe = Recipe::load(o.recipe, threads);
  const auto& ri = recipe->info();
  const auto& hc = engine->config();
  if (hc.num_layers != ri.n_layer || hc.hidden_size != ri.n_embd)
    throw std::runtime_error(fmt::format("HF model ({} layers, hidden {}) does not match the decoder recipe ({} layers, hidden {})",
                                         hc.num_layers, hc.hidden_size, ri.n_layer, ri.n_embd));
  const std::string fingerprint = recipe_fingerprint(ri);
  spdlog::info("prefill: {} {} layers, recipe fingerprint {}", ri.arch, ri.n_layer, fingerprint);

  httplib::Server srv;
  std::mutex engine_mutex;  // one capture at a time, in arrival order
  std::atomic<int> active{0};
  srv.Get("/health", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(json{{"ok", true}, {"role", "prefill"}, {"device", o.device}, {"arch", ri.arch},
                         {"fingerprint", fingerprint}, {"geometry", recipe_geometry(ri)}, {"active", active.load()}}.dump(),
                    "application/json");
  });
  srv.Post("/v1/bridge/prefill", [&](const httplib::Request& req, httplib::Response& res) {
    wire::PrefillRequest pr;
    try {
      pr = wire::PrefillRequest::parse(json::parse(req.body));
    } catch (const json::exception& e) {
      return json_error(res, 400, std::string("request body is not valid JSON: ") + e.what(), "invalid_request_error");
    } catch (const std::invalid_argument& e) {
      return json_error(res, 400, e.what(), "invalid_request_error");
    }
    if (pr.fingerprint != fingerprint)
      return json_error(res, 409, fmt::format("fingerprint mismatch: front expects {}, this server's recipe is {}", pr.fingerprint, fingerprint), "fingerprint_mismatch");
    for (int32_t t : pr.tokens)
      if (t >= hc.vocab_size) return json_error(res, 400, fmt::format("token id {} outside the vocabulary ({})", t, hc.vocab_size), "invalid_request_error");
    const int64_t chunk = pr.chunk > 0 ? pr.chunk : o.chunk;
    auto queue = std::make_shared<FrameQueue>(o.max_queue_bytes);
    auto worker = std::make_shared<std::thread>();
    auto started = std::make_shared<bool>(false);
    res.set_header("X-PD-Wire-Version", std::to_string(wire::kWireVersion));
    res.set_chunked_content_provider(
        "application/x-pdbridge-frames",
        [=, &engine_mutex, &active, &engine, &recipe](size_t, httplib::DataSink& sink) {
          if (!*started) {
            *started = true;
            *worker = std::thread([=, &engine_mutex, &active, &engine, &recipe] {
              std::lock_guard<std::mutex> lock(engine_mutex);
              ++active;
              auto r = run_capture(*engine, *recipe, pr, chunk, [&](std::vector<uint8_t>&& f) { return queue->push(std::move(f)); });
              --active;
              spdlog::info("prefill: {} tokens -> {} ({} tokens) in {:.2f}s{}", pr.tokens.size(), r.status, r.tokens, r.engine_s,
                           r.reason.empty() ? "" : " (" + r.reason + ")");
              queue->close();
            });
          }
          std::vector<uint8_t> f;
          if (!queue->pop(f)) {
            sink.done();
            return true;
          }
          if (!sink.write(reinterpret_cast<const char*>(f.data()), f.size())) {
            queue->gone();
            return false;
          }
          return true;
        },
        [=](bool) {
          queue->gone();
          if (worker->joinable()) worker->join();
        });
  });
  srv.set_payload_max_length(size_t(512) << 20);
  srv.new_task_queue = [] { return new httplib::ThreadPool(8); };
  spdlog::info("prefill: listening on {}:{}", o.host, o.port);
  if (!srv.listen(o.host, o.port)) throw std::runtime_error(fmt::format("cannot listen on {}:{}", o.host, o.port));
  return 0;
}

}  // namespace pdb
