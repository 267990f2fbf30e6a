#include "cuda/tp_comm.cuh"

#include <dlfcn.h>
#ifdef PDBRIDGE_HAVE_NCCL
#include <nccl.h>
#endif

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include <fmt/format.h>

#include "cuda/common.cuh"

namespace pdb::cuda {

namespace {

#ifdef PDBRIDGE_HAVE_NCCL
// ---- NCCL, loaded at run time ----
struct Nccl {
  decltype(&ncclCommInitAll) comm_init_all = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetVersion) get_version = nullptr;
  int version = 0;
  static const Nccl& get() {
    static Nccl n = load();
    return n;
  }
  static Nccl load() {
    void* h = nullptr;
    std::string tried;
    for (const char* name : {"libnccl.so.2", "libnccl.so"}) {
      if ((h = dlopen(name, RTLD_NOW | RTLD_GLOBAL))) break;
      tried += fmt::format("{}: {}; ", name, dlerror());
    }
    if (!h) throw std::runtime_error("tensor parallel across GPUs needs NCCL (the CUDA toolkit's libnccl.so.2 on the library path): " + tried);
    Nccl n;
    auto sym = [&](auto& f, const char* s) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, s));
      if (!f) throw std::runtime_error(fmt::format("libnccl.so.2 lacks {}", s));
    };
    sym(n.comm_init_all, "ncclCommInitAll");
    sym(n.all_reduce, "ncclAllReduce");
    sym(n.comm_destroy, "ncclCommDestroy");
    sym(n.comm_abort, "ncclCommAbort");
    sym(n.error_string, "ncclGetErrorString");
    sym(n.get_version, "ncclGetVersion");
    n.get_version(&n.version);
    return n;
  }
};

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(fmt::format("NCCL {}: {}", what, Nccl::get().error_string(r)));
}

class NcclComm final : public TpComm {
 public:
  NcclComm(ncclComm_t c, int rank, int world, int device) : c_(c), rank_(rank), world_(world), device_(device) {}
  ~NcclComm() override {
    if (c_ && !aborted_) Nccl::get().comm_destroy(c_);
  }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  int device() const override { return device_; }
  void all_reduce_sum(float* buf, size_t n, cudaStream_t s) override {
    if (aborted_) throw std::runtime_error("tensor parallel group aborted");
    nccl_check(Nccl::get().all_reduce(buf, buf, n, ncclFloat32, ncclSum, c_, s), "all-reduce");
  }
  void abort() override {
    if (!aborted_.exchange(true)) Nccl::get().comm_abort(c_);
  }
  std::string describe() const override {
    const int v = Nccl::get().version;
    return fmt::format("NCCL {}.{}.{}, rank {} of {} on GPU {}", v / 10000, v / 100 % 100, v % 100, rank_, world_, device_);
  }

 private:
  ncclComm_t c_;
  int rank_, world_, device_;
  std::atomic<bool> aborted_{false};
};

#endif  // PDBRIDGE_HAVE_NCCL

// ---- ranks sharing one device ----
constexpr int kMaxSharedRanks = 8;
struct RankPtrs { const float* p[kMaxSharedRanks]; int world; };

__global__ void sum_ranks(RankPtrs r, float* out, size_t n) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int j = 0; j < r.world; ++j) s += r.p[j][i];  // rank order: the same sum on every rank
    out[i] = s;
  }
}

struct SharedGroup {
  int world, device;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<float*> bufs;
  std::vector<cudaEvent_t> ready, done;
  // a reusable barrier that an abort breaks
  void wait() {
    std::unique_lock<std::mutex> l(m);
    if (aborted) throw std::runtime_error("tensor parallel group aborted");
    const uint64_t g = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(l, [&] { return generation != g || aborted; });
    if (aborted) throw std::runtime_error("tensor parallel group aborted");
  }
  void abort() {
    std::lock_guard<std::mutex> l(m);
    aborted = true;
    cv.notify_all();
  }
  ~SharedGroup() {
    for (auto e : ready) cudaEventDestroy(e);
    for (auto e : done) cudaEventDestroy(e);
  }
};

class SharedDeviceComm final : public TpComm {
 public:
  SharedDeviceComm(std::shared_ptr<SharedGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world() const override { return g_->world; }
  int device() const override { return g_->device; }
  void all_reduce_sum(float* buf, size_t n, cudaStream_t s) override {
    SharedGroup& g = *g_;
    tmp_.resize(n * 4);
    g.bufs[size_t(rank_)] = buf;
    PDB_CUDA_CHECK(cudaEventRecord(g.ready[size_t(rank_)], s));
    g.wait();  // every rank's buffer is named and its event recorded
    RankPtrs p{};
    p.world = g.world;
    for (int j = 0; j < g.world; ++j) {
      p.p[j] = g.bufs[size_t(j)];
      if (j != rank_) PDB_CUDA_CHECK(cudaStreamWaitEvent(s, g.ready[size_t(j)], 0));
    }
    sum_ranks<<<264, 256, 0, s>>>(p, tmp_.as<float>(), n);
    PDB_CUDA_LAUNCHED();
    PDB_CUDA_CHECK(cudaEventRecord(g.done[size_t(rank_)], s));
    g.wait();  // every rank has enqueued its sum: nobody overwrites a buffer another still reads
    for (int j = 0; j < g.world; ++j)
      if (j != rank_) PDB_CUDA_CHECK(cudaStreamWaitEvent(s, g.done[size_t(j)], 0));
    PDB_CUDA_CHECK(cudaMemcpyAsync(buf, tmp_.get(), n * 4, cudaMemcpyDeviceToDevice, s));
  }
  void abort() override { g_->abort(); }
  std::string describe() const override { return fmt::format("ranks sharing GPU {}, rank {} of {}", g_->device, rank_, g_->world); }

 private:
  std::shared_ptr<SharedGroup> g_;
  int rank_;
  DeviceBuffer tmp_;
};

}  // namespace

std::vector<std::unique_ptr<TpComm>> make_nccl_group(const std::vector<int>& devices) {
#ifndef PDBRIDGE_HAVE_NCCL
  (void)devices;
  throw std::runtime_error("tensor parallel across GPUs: this build found no nccl.h (the CUDA toolkit's NCCL) at configure time");
#else
  const int n = int(devices.size());
  if (n < 1) throw std::invalid_argument("tensor parallel: no devices");
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < i; ++j)
      if (devices[size_t(i)] == devices[size_t(j)]) throw std::invalid_argument(fmt::format("tensor parallel: GPU {} named twice (NCCL takes one rank per GPU)", devices[size_t(i)]));
  // NVLink SHARP multicast can take a shared host's GPUs out of service: never on in our processes.
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  const Nccl& nc = Nccl::get();
  std::vector<ncclComm_t> comms(size_t(n), nullptr);
  nccl_check(nc.comm_init_all(comms.data(), n, devices.data()), "init");
  std::vector<std::unique_ptr<TpComm>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<NcclComm>(comms[size_t(r)], r, n, devices[size_t(r)]));
  return out;
#endif
}

std::vector<std::unique_ptr<TpComm>> make_shared_device_group(int world, int device) {
  if (world < 1 || world > kMaxSharedRanks) throw std::invalid_argument(fmt::format("tensor parallel on one GPU: 1 to {} ranks", kMaxSharedRanks));
  auto g = std::make_shared<SharedGroup>();
  g->world = world;
  g->device = device;
  g->bufs.assign(size_t(world), nullptr);
  int prev = 0;
  PDB_CUDA_CHECK(cudaGetDevice(&prev));
  PDB_CUDA_CHECK(cudaSetDevice(device));
  for (int r = 0; r < world; ++r) {
    cudaEvent_t a, b;
    PDB_CUDA_CHECK(cudaEventCreateWithFlags(&a, cudaEventDisableTiming));
    PDB_CUDA_CHECK(cudaEventCreateWithFlags(&b, cudaEventDisableTiming));
    g->ready.push_back(a);
    g->done.push_back(b);
  }
  PDB_CUDA_CHECK(cudaSetDevice(prev));
  std::vector<std::unique_ptr<TpComm>> out;
  for (int r = 0; r < world; ++r) out.push_back(std::make_unique<SharedDeviceComm>(g, r));
  return out;
}

}  // namespace pdb::cuda
