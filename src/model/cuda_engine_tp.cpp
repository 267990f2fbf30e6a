#include "model/cuda_engine_tp.h"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/tp_comm.cuh"

namespace pdb {

namespace {

// The ranks' states of one prompt (each its own kv heads' K/V, on its own device).
struct TpEngineState final : EngineState {
  std::vector<std::shared_ptr<EngineState>> ranks;
  size_t bytes() const override {
    size_t b = 0;
    for (const auto& r : ranks) b += r ? r->bytes() : 0;
    return b;
  }
};

// Every rank polls `cancelled` at the same points (the forward's control flow is the same on every rank): rank 0
// asks the caller's predicate and publishes the answer, the others take it, so all stop at the same layer.
class CancelAgreement {
 public:
  bool decide(uint64_t k, bool v) {
    std::lock_guard<std::mutex> l(m_);
    if (decisions_.size() <= k) decisions_.resize(k + 1, -1);
    decisions_[k] = v ? 1 : 0;
    cv_.notify_all();
    return v;
  }
  bool wait(uint64_t k) {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return aborted_ || (k < decisions_.size() && decisions_[k] >= 0); });
    if (aborted_) throw std::runtime_error("tensor parallel group aborted");
    return decisions_[k] == 1;
  }
  void abort() {
    std::lock_guard<std::mutex> l(m_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::vector<int> decisions_;
  bool aborted_ = false;
};

struct DeviceScope {
  int prev = 0;
  explicit DeviceScope(int d) {
    PDB_CUDA_CHECK(cudaGetDevice(&prev));
    PDB_CUDA_CHECK(cudaSetDevice(d));
  }
  ~DeviceScope() { cudaSetDevice(prev); }
};

}  // namespace

CudaTpEngine::CudaTpEngine(const std::string& hf_dir, int threads, bool kv_fp8, int world, bool shared_device, ProductNumerics numerics)
    : shared_device_(shared_device) {
  if (world < 1) throw std::invalid_argument("--tp must be at least 1");
  int dev0 = 0;
  PDB_CUDA_CHECK(cudaGetDevice(&dev0));
  if (world == 1) {
    ranks_.push_back(std::make_unique<CudaEngine>(hf_dir, threads, kv_fp8, nullptr, numerics));
    devices_ = {dev0};
    return;
  }
  if (numerics != ProductNumerics::bf16) throw std::invalid_argument("--numerics: tensor parallel runs a checkpoint's bf16 products");
  if (shared_device) {
    devices_.assign(size_t(world), dev0);
  } else {
    const int n = cuda::device_count();
    if (n < world) throw std::runtime_error(fmt::format("--tp {} needs {} GPUs; this machine has {} ({})", world, world, n, cuda::device_summary()));
    for (int r = 0; r < world; ++r) devices_.push_back(r);
  }
  make_group();
  for (int r = 0; r < world; ++r) {
    DeviceScope on(devices_[size_t(r)]);
    ranks_.push_back(std::make_unique<CudaEngine>(hf_dir, threads, kv_fp8, comms_[size_t(r)].get()));
  }
  spdlog::info("cuda engine: tensor parallel {} ({})", world, comms_[0]->describe());
}

CudaTpEngine::~CudaTpEngine() {
  for (size_t r = ranks_.size(); r-- > 0;) {
    DeviceScope on(devices_[r]);
    ranks_[r].reset();
  }
  comms_.clear();
}

void CudaTpEngine::make_group() {
  comms_ = shared_device_ ? cuda::make_shared_device_group(int(devices_.size()), devices_[0]) : cuda::make_nccl_group(devices_);
  for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->set_tp_comm(comms_[r].get());
  broken_ = false;
}

std::string CudaTpEngine::weights_note() const {
  std::string n = ranks_[0]->weights_note();
  if (world() > 1) n += fmt::format("; {}", comms_[0]->describe());
  return n;
}

void CudaTpEngine::set_memory_cap(size_t bytes) {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    DeviceScope on(devices_[r]);
    ranks_[r]->set_memory_cap(bytes);
  }
}

void CudaTpEngine::check_fits(int64_t tokens, int64_t chunk, size_t extra) const {
  for (size_t r = 0; r < ranks_.size(); ++r) {
    DeviceScope on(devices_[r]);
    ranks_[r]->check_fits(tokens, chunk, extra);
  }
}

int64_t CudaTpEngine::prefill(const std::vector<int32_t>& tokens, int64_t chunk, const CudaEngine::DeviceHook& hook,
                              const std::function<bool()>& cancelled, bool full_last_layer, bool skip_attention, ResumePoint resume,
                              std::shared_ptr<EngineState>* keep, size_t keep_max_bytes) {
  const int W = world();
  if (W == 1) return ranks_[0]->prefill(tokens, chunk, hook, cancelled, full_last_layer, skip_attention, resume, keep, keep_max_bytes);
  if (broken_) make_group();
  if (tokens.empty()) return 0;
  check_fits(int64_t(tokens.size()), std::min<int64_t>(chunk <= 0 ? 2048 : chunk, int64_t(tokens.size())));  // before any rank starts: a rank refused mid-forward would only abort the group
  const auto* rs = dynamic_cast<const TpEngineState*>(resume.state);
  if (resume.tokens > 0 && (!rs || int(rs->ranks.size()) != W)) throw std::invalid_argument("the resume state is not this tensor-parallel engine's");
  CancelAgreement agree;
  std::vector<std::shared_ptr<EngineState>> kept(static_cast<size_t>(W));
  std::vector<int64_t> done(static_cast<size_t>(W), 0);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(W));
  std::mutex abort_m;
  bool aborted = false;
  auto abort_all = [&] {
    std::lock_guard<std::mutex> l(abort_m);
    if (aborted) return;
    aborted = true;
    agree.abort();
    for (auto& c : comms_) c->abort();
  };
  auto run_rank = [&](int r) {
    try {
      DeviceScope on(devices_[size_t(r)]);
      uint64_t polls = 0;
      std::function<bool()> poll = r == 0 ? std::function<bool()>([&] { return agree.decide(polls++, cancelled && cancelled()); })
                                          : std::function<bool()>([&] { return agree.wait(polls++); });
      ResumePoint rp;
      rp.tokens = resume.tokens;
      rp.state = resume.tokens > 0 ? rs->ranks[size_t(r)].get() : nullptr;
      done[size_t(r)] = ranks_[size_t(r)]->prefill(tokens, chunk, r == 0 ? hook : CudaEngine::DeviceHook{}, poll, full_last_layer, skip_attention,
                                                   rp, keep ? &kept[size_t(r)] : nullptr, keep_max_bytes / size_t(W));
    } catch (...) {
      errors[size_t(r)] = std::current_exception();
      abort_all();
    }
  };
  std::vector<std::thread> others;
  for (int r = 1; r < W; ++r) others.emplace_back(run_rank, r);
  run_rank(0);
  for (auto& t : others) t.join();
  if (aborted) {
    broken_ = true;
    // the first real error, not the "group aborted" the others saw because of it
    for (int r = 0; r < W; ++r)
      if (errors[size_t(r)]) {
        try { std::rethrow_exception(errors[size_t(r)]); } catch (const std::exception& e) {
          if (std::string(e.what()).find("group aborted") == std::string::npos) throw;
        }
      }
    for (const auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  for (int r = 1; r < W; ++r)
    if (done[size_t(r)] != done[0]) throw std::runtime_error(fmt::format("tensor parallel ranks stopped apart ({} vs {} tokens)", done[0], done[size_t(r)]));
  if (keep) {
    bool all = true;
    for (const auto& k : kept) all = all && k;
    if (all) {
      auto st = std::make_shared<TpEngineState>();
      st->tokens = kept[0]->tokens;
      st->ranks = std::move(kept);
      *keep = std::move(st);
    }
  }
  return done[0];
}

}  // namespace pdb
