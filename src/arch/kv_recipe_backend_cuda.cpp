// The CUDA backend: the GPU engine's forward with the GPU recipe on its hook. Rows leave the GPU
// without stalling the forward: the decoder's norm of the residual runs on the engine's stream (it
// must read the residual before the layer changes it), the rest of the recipe on the same stream or,
// with PDBRIDGE_RECIPE_STREAM=1, on a stream of its own; each layer's rows are computed into one of two
// device stagings and copied to a ring of pinned host slots on a copy stream, and a delivery thread hands
// finished slots to the sink in order. The engine only waits when every slot is still on its way out
// (backpressure from the wire). With --kv-rows engine the rows are the engine's own K/V products (its KvTap)
// and the recipe only ropes and types them. Layer 0's rows start from the decoder's embedding rows, made on the host
// and uploaded on a stream of their own a layer before they are used. Rows of F32, F16, Q8_0
// and Q4_0 caches are rotated and encoded on the GPU and leave in their final bytes; other cache
// types leave as f32 and are rotated and quantized on the host by the CPU recipe's code.
#include <algorithm>
#include <condition_variable>
#include "common/tuning.h"
#include <cstdlib>
#include <cstring>
#include <exception>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <cuda_fp16.h>
#include <fmt/format.h>

#include "common/parallel.h"
#include "cuda/cache_rows.cuh"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/gemm.cuh"
#include "definitions/definition.h"
#include "model/cuda_engine.h"
#include "model/cuda_engine_tp.h"
#include "arch/backends.h"
#include "recipes/recipe_gpu.h"

namespace pdb {
namespace {

constexpr int kSlots = 6;
// A capture's last block in up to this many pieces of at least kTailPieceRows rows (PDBRIDGE_TAIL_PIECES=N). Whole by
// default: on an H100 (session 47, Qwen3-30B-A3B's 8-layer slice) 4 pieces cut the median time after the engine's return
// from 1.50 to 1.14 ms at 8K, and tok/s stayed within the spread (305.5K against 304.5K, means of six runs' medians).
constexpr int kTailPieces = 1;
constexpr int64_t kTailPieceRows = 64;
// Buffers beyond the slots' own: a slot whose buffer left as a block's frames takes one of these, so the frames can
// wait for the wire while the slot fills again. Without a spare (frames piling up behind a slow link) the rows are
// copied into frames of their own, as before.
constexpr int kSpareFrameBuffers = 4;

// The slots' pinned buffers, each laid out as a block's frames: header room, K, header room, V. Shared with the
// frames that left in them: those may outlive a capture (in the prefill server's queue) and give theirs back here.
class FrameBuffers {
 public:
  FrameBuffers(int count, size_t bytes) : bytes_(bytes) {
    bufs_.reserve(size_t(count));
    free_.reserve(size_t(count));
    for (int i = 0; i < count; ++i) bufs_.emplace_back(bytes);
  }
  uint8_t* data(int i) { return bufs_[size_t(i)].as<uint8_t>(); }
  size_t bytes() const { return bytes_; }
  int take_spare() {
    std::lock_guard<std::mutex> l(mu_);
    if (free_.empty()) return -1;
    const int i = free_.back();
    free_.pop_back();
    return i;
  }
  void give_back(int i) noexcept {
    std::lock_guard<std::mutex> l(mu_);
    free_.push_back(i);  // within the capacity reserved: no allocation
  }

 private:
  size_t bytes_;
  std::vector<cuda::PinnedBuffer> bufs_;
  std::mutex mu_;
  std::vector<int> free_;
};

// PDBRIDGE_CAPTURE_STATS=1: where a capture's rows spend their time, part by part (issue 36's "engine + recipe + frames
// within 3% of the engine"): the GPU time of the rows' own work on the engine's stream (CUDA events around it), the
// host's time blocked on a free slot, and the delivery thread's time waiting for copies and handing rows on. Printed
// to stderr once per capture; off, it costs nothing.
struct CaptureStats {
  bool on = false;
  cuda::EventSpans gpu;      // each row block's device work
  cuda::EventSpans staging;  // the engine's stream's waits for a free staging buffer
  double slot_wait_ms = 0, copy_wait_ms = 0, deliver_ms = 0, tail_ms = 0;
  int frames_handed_over = 0, frames_copied = 0;  // blocks whose slot buffer left as their frames, or found no spare (copied)
  int tail_pieces = 1;                            // the last block's pieces
  // the GPU's wait on `copied` (stream s held until a staging buffer's rows have left)
  void wait_staging(cudaStream_t s, cudaEvent_t copied) {
    if (on) staging.begin(s);
    PDB_CUDA_CHECK(cudaStreamWaitEvent(s, copied, 0));
    if (on) staging.end(s);
  }
  void begin(cudaStream_t s) {
    if (on) gpu.begin(s);
  }
  void end(cudaStream_t s) {
    if (on) gpu.end(s);
  }
  // engine: the engine's own share of the rows (CudaEngine::take_kv_rows_stats)
  void report(int64_t tokens, CudaEngine& engine) {
    if (!on) return;
    const size_t blocks = gpu.count();
    const double gpu_ms = gpu.take_ms(), staging_ms = staging.take_ms();
    const CudaEngine::KvRowsStats e = engine.take_kv_rows_stats();
    fmt::print(stderr,
               "capture stats: {} tokens, {} row blocks; rows' GPU work {:.2f} ms ({:.3f} per block), the engine's K/V rows {:.2f} ms of "
               "which the last layer's {:.2f}; the engine's stream held for a free staging buffer {:.2f} ms; host blocked on a free slot "
               "{:.2f} ms; delivery waited on copies {:.2f} ms, converted and handed on {:.2f} ms (slot buffers handed over as frames {}, "
               "none spare {}); after the engine's return {:.2f} ms (the last block in {} pieces)\n",
               tokens, blocks, gpu_ms, blocks ? gpu_ms / double(blocks) : 0.0, e.rows_ms, e.last_layer_ms, staging_ms, slot_wait_ms,
               copy_wait_ms, deliver_ms, frames_handed_over, frames_copied, tail_ms, tail_pieces);
  }
};
using StatsClock = std::chrono::steady_clock;
double ms_since(StatsClock::time_point t0) { return std::chrono::duration<double, std::milli>(StatsClock::now() - t0).count(); }

class CudaBackend final : public PrefillBackend {
 public:
  // max_chunk: the largest chunk a capture runs (its buffers' size); 0: the engine's choice (CudaEngine::default_chunk).
  CudaBackend(const std::string& hf_dir, std::shared_ptr<const Recipe> recipe, int threads, int64_t max_chunk, bool kv_fp8, int tp,
              bool tp_shared_device, bool engine_rows, ProductNumerics numerics)
      : recipe_(std::move(recipe)), engine_(hf_dir, threads, kv_fp8, tp, tp_shared_device, numerics),
        gpu_recipe_(*recipe_, recipe_gemm_, chunk_or_default(max_chunk), !engine_rows), max_chunk_(chunk_or_default(max_chunk)), threads_(threads),
        engine_rows_(engine_rows) {
    if (engine_rows_) engine_.rank0().enable_kv_rows();  // every capture's rows from the engine's own K/V products (CudaEngine::KvTap)
    PDB_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    PDB_CUDA_CHECK(cudaStreamCreateWithFlags(&upload_stream_, cudaStreamNonBlocking));
    PDB_CUDA_CHECK(cudaEventCreateWithFlags(&embed_ready_, cudaEventDisableTiming));
    PDB_CUDA_CHECK(cudaEventCreateWithFlags(&embed_free_, cudaEventDisableTiming));
    if (Tuning::from_env().recipe_stream == "1")
      PDB_CUDA_CHECK(cudaStreamCreateWithFlags(&recipe_stream_, cudaStreamNonBlocking));
    for (int i = 0; i < kNormBuffers; ++i) {
      if (!engine_rows_) normed_[i].resize(size_t(max_chunk_ * recipe_->info().n_embd) * 4);
      PDB_CUDA_CHECK(cudaEventCreateWithFlags(&normed_ready_[i], cudaEventDisableTiming));
      PDB_CUDA_CHECK(cudaEventCreateWithFlags(&normed_free_[i], cudaEventDisableTiming));
    }
    const int64_t C = recipe_->info().n_embd_kv();
    if (!engine_rows_) embed_dev_.resize(size_t(max_chunk_ * recipe_->info().n_embd) * 4);
    for (int b = 0; b < 2; ++b) {
      if (!engine_rows_) embed_pinned_[b].resize(size_t(max_chunk_ * recipe_->info().n_embd) * 4);
      PDB_CUDA_CHECK(cudaEventCreateWithFlags(&embed_uploaded_[b], cudaEventDisableTiming | cudaEventBlockingSync));
    }
    for (auto& g : staging_) {
      g.dk.resize(size_t(max_chunk_ * C) * 4);
      g.dv.resize(size_t(max_chunk_ * C) * 4);
      g.dkq.resize(size_t(max_chunk_ * C) * 2);  // F16, Q8_0, Q4_0 rows: at most 2 bytes per element (F32 leaves from dk/dv)
      g.dvq.resize(size_t(max_chunk_ * C) * 2);
      PDB_CUDA_CHECK(cudaEventCreateWithFlags(&g.copied_out, cudaEventDisableTiming));
    }
    // header room, up to f32 K rows, header room (and alignment for f32 V rows), up to f32 V rows
    // (the spares only where the slot buffers leave as frames, the default: PDBRIDGE_FRAMES=copy copies them instead)
    const int spares = Tuning::from_env().frames != "copy" ? kSpareFrameBuffers : 0;
    frames_ = std::make_shared<FrameBuffers>(kSlots + spares, 2 * (wire::kHeaderBytes + 16) + 2 * size_t(max_chunk_ * C) * 4);
    for (int i = kSlots; i < kSlots + spares; ++i) frames_->give_back(i);
    for (int i = 0; i < kSlots; ++i) {
      Slot& s = slots_[i];
      s.buf = i;
      PDB_CUDA_CHECK(cudaEventCreateWithFlags(&s.computed, cudaEventDisableTiming));
      PDB_CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming | cudaEventBlockingSync));
    }
  }
  ~CudaBackend() override {
    for (auto& s : slots_) {
      cudaEventDestroy(s.computed);
      cudaEventDestroy(s.copied);
    }
    for (auto& g : staging_) cudaEventDestroy(g.copied_out);
    for (auto e : embed_uploaded_) cudaEventDestroy(e);
    cudaEventDestroy(embed_ready_);
    cudaEventDestroy(embed_free_);
    for (int i = 0; i < kNormBuffers; ++i) {
      cudaEventDestroy(normed_ready_[i]);
      cudaEventDestroy(normed_free_[i]);
    }
    if (recipe_stream_) cudaStreamDestroy(recipe_stream_);
    cudaStreamDestroy(copy_stream_);
    cudaStreamDestroy(upload_stream_);
  }

  const HfConfig& config() const override { return engine_.config(); }
  const RecipeInfo& info() const override { return recipe_->info(); }
  std::string device() const override { return "cuda: " + cuda::device_summary(); }
  std::string weights() const override {
    return engine_.weights_note() + (engine_rows_ ? "; cache rows from the engine's K/V products" : "; cache rows recomputed by the decoder's recipe");
  }
  void check_fits(int64_t tokens, int64_t chunk) const override { engine_.check_fits(tokens, std::min(chunk, max_chunk_)); }
  int64_t preferred_chunk() const override { return max_chunk_; }
  // After the recipe's and the slots' buffers: what the device holds then counts against the cap.
  void set_memory_cap(size_t bytes) { engine_.set_memory_cap(bytes); }
  CudaEngine& engine() { return engine_.rank0(); }
  bool resumable() const override { return engine_.resumable(); }

  int64_t capture(const std::vector<int32_t>& tokens, int64_t chunk, const CacheSpec& spec, const KvSink& sink,
                  const std::function<bool()>& stop, CaptureReuse* reuse) override;

  int64_t forward_only(const std::vector<int32_t>& tokens, int64_t chunk, bool full_last_layer, bool skip_attention) override {
    std::lock_guard<std::mutex> one_at_a_time(capture_mu_);
    return engine_.prefill(tokens, std::min(chunk <= 0 ? max_chunk_ : chunk, max_chunk_), {}, {}, full_last_layer, skip_attention);
  }

 private:
  int64_t chunk_or_default(int64_t chunk) const { return chunk > 0 ? chunk : engine_.default_chunk(); }
  class Capture;  // one capture's state and steps
  struct Slot {
    enum State { Free, Enqueued } state = Free;
    int layer = 0;
    int64_t pos0 = 0, rows = 0;
    int buf = 0;  // its buffer in frames_: the rows as they leave (cache-type bytes, or f32 for the host to convert)
    size_t k_at = 0, v_at = 0;  // where K's and V's rows lie in it
    cudaEvent_t computed = nullptr, copied = nullptr;
    std::future<uint64_t> k_hash, v_hash;  // a capture's last block's pieces: their payloads hashed as they land
  };
  // Device rows between their computation and their copy to a slot: two are enough (the copy of one overlaps the
  // computation of the next); the host slots are the ring that absorbs the wire's backpressure.
  struct Staging {
    cuda::DeviceBuffer dk, dv, dkq, dvq;  // f32 rows; their cache-type bytes when the GPU encodes them
    cudaEvent_t copied_out = nullptr;     // its rows have left for their slot
  };

  // On the engine's stream: rotation and encoding of one slot's rows where the GPU encodes the type.
  // Returns the bytes to copy out (the encoded rows, or the f32 rows for the host to convert).
  static size_t encode(GgmlType t, bool rot, int64_t rot_n, cuda::DeviceBuffer& f32, cuda::DeviceBuffer& bytes, int64_t rows, int64_t C,
                       cudaStream_t st) {
    if (!cuda::encodes_on_gpu(t)) return size_t(rows * C) * 4;
    if (rot) cuda::hadamard_rows(f32.as<float>(), rows * C, rot_n, st);
    if (t != GgmlType::F32) cuda::encode_rows(t, f32.as<float>(), rows * C, bytes.as<uint8_t>(), st);
    return ggml_row_bytes(t, C) * size_t(rows);
  }
  // Where a slot's rows of type t leave from: the encoded bytes, or the f32 rows themselves.
  static const void* outgoing(GgmlType t, const cuda::DeviceBuffer& f32, const cuda::DeviceBuffer& bytes) {
    return cuda::encodes_on_gpu(t) && t != GgmlType::F32 ? bytes.get() : f32.get();
  }

  // Rows the GPU encoded arrive as they go on the wire; other types are rotated and quantized here,
  // with the decoder's own conversion (the same code as the CPU recipe).
  void convert(Slot& s, GgmlType t, bool rot, int64_t rot_n, uint8_t* host, std::vector<uint8_t>& scratch, const uint8_t*& out,
               size_t& bytes, int64_t C) const {
    const int64_t rows = s.rows;
    if (cuda::encodes_on_gpu(t)) {
      out = host;
      bytes = ggml_row_bytes(t, C) * size_t(rows);
      return;
    }
    float* x = reinterpret_cast<float*>(host);
    const size_t rb = ggml_row_bytes(t, C);
    scratch.resize(rb * size_t(rows));
    parallel_for(rows, threads_, [&](int64_t b, int64_t e) {
      if (rot) hadamard_rows(x + b * C, (e - b) * C, rot_n);
      rows_to_cache_type(t, x + b * C, e - b, C, scratch.data() + size_t(b) * rb);
    });
    out = scratch.data();
    bytes = scratch.size();
  }

  // A delivered slot's buffer as its block's frames (`bytes` of it, header room included), a spare taking its place
  // in the slot; empty bytes where no spare is free (the sink then copies the rows).
  wire::Bytes hand_over(Slot& s, size_t bytes, CaptureStats& stats) {
    const int spare = frames_->take_spare();
    if (spare < 0) {
      ++stats.frames_copied;
      return wire::Bytes();
    }
    ++stats.frames_handed_over;
    const int mine = std::exchange(s.buf, spare);
    return wire::Bytes::adopt(frames_->data(mine), bytes, frames_->bytes(), [frames = frames_, mine](uint8_t*) { frames->give_back(mine); });
  }

  std::shared_ptr<const Recipe> recipe_;
  CudaTpEngine engine_;  // one rank, or a tensor-parallel group whose rank 0 the recipe runs beside
  cuda::Gemm recipe_gemm_;  // its own workspace: the recipe's products may run beside the engine's
  GpuRecipe gpu_recipe_;
  int64_t max_chunk_;
  int threads_;
  cudaStream_t copy_stream_ = nullptr;
  cudaStream_t recipe_stream_ = nullptr;  // null: the recipe runs on the engine's stream
  cudaStream_t upload_stream_ = nullptr;  // the decoder's embedding rows to embed_dev_
  Slot slots_[kSlots];
  std::shared_ptr<FrameBuffers> frames_;
  static constexpr int kStaging = 2;
  Staging staging_[kStaging];
  static constexpr int kNormBuffers = 3;
  cuda::DeviceBuffer normed_[kNormBuffers];  // the decoder's norm of a layer's input, for the recipe stream
  cudaEvent_t normed_ready_[kNormBuffers] = {}, normed_free_[kNormBuffers] = {};
  cuda::PinnedBuffer embed_pinned_[2];  // the decoder's embedding rows of a chunk, made one chunk ahead
  cudaEvent_t embed_uploaded_[2] = {nullptr, nullptr};
  cudaEvent_t embed_ready_ = nullptr, embed_free_ = nullptr;  // embed_dev_ uploaded; its last rows normed (read)
  cuda::DeviceBuffer embed_dev_;
  bool engine_rows_ = false;  // --kv-rows engine
  std::mutex capture_mu_;
};

// One capture: its delivery thread, the slots' fill and the rows' hooks on the engine's streams. It lives for one call of
// CudaBackend::capture; the backend keeps what outlives a capture (buffers, streams, events). The streams' roles are
// the file's first comment's; a ring of normalized buffers lets the recipe stream lag a layer or two.
class CudaBackend::Capture {
 public:
  Capture(CudaBackend& b, const std::vector<int32_t>& tokens, int64_t chunk, const CacheSpec& spec, const KvSink& sink)
      : b_(b), tokens_(tokens), chunk_(chunk), spec_(spec), sink_(sink), info_(b.recipe_->info()), C_(info_.n_embd_kv()),
        has_v_(info_.n_embd_v() > 0), rot_k_(spec.rot_k && b.recipe_->rotates_k()), layers_(b.engine_.config().num_layers),
        hf_k_order_(model_definition(info_.arch).gguf_permutes_qk) {
    const Tuning t = Tuning::from_env();
    stats_.on = t.capture_stats == "1";
    hand_over_frames_ = t.frames != "copy";
    tail_pieces_ = t.tail_pieces.empty() ? kTailPieces : std::clamp(std::atoi(t.tail_pieces.c_str()), 1, kSlots);
    // an f16 cache without rotation: the rows' bytes in one pass after the products (the same bytes; PDBRIDGE_ROWS_FUSED=0:
    // the passes one by one)
    fused_ = t.rows_fused != "0" && spec.k_type == GgmlType::F16 && spec.v_type == GgmlType::F16 && !rot_k_ && !spec.rot_v;
    for (auto& s : b_.slots_) s.state = Slot::Free;
  }

  int64_t run(const std::function<bool()>& stop, CaptureReuse* reuse) {
    std::thread delivery([this] { deliver(); });
    int64_t done = 0;
    std::exception_ptr engine_error;
    try {
      done = prefill(stop, reuse);
    } catch (...) {
      engine_error = std::current_exception();
    }
    if (b_.engine_rows_) b_.engine_.rank0().set_kv_tap(nullptr);
    const auto engine_done = StatsClock::now();
    {
      std::lock_guard<std::mutex> l(mu_);
      finished_ = true;
      cv_.notify_all();
    }
    delivery.join();
    cudaStreamSynchronize(b_.copy_stream_);
    cudaStreamSynchronize(b_.upload_stream_);
    if (b_.recipe_stream_) cudaStreamSynchronize(b_.recipe_stream_);
    stats_.tail_ms = ms_since(engine_done);
    stats_.report(int64_t(tokens_.size()), b_.engine_.rank0());
    if (engine_error) std::rethrow_exception(engine_error);
    if (delivery_error_) std::rethrow_exception(delivery_error_);
    return done;
  }

 private:
  struct EmbedJob {
    int64_t pos0 = -1, rows = 0;
    int buf = 0;
    std::future<void> ready;
  };

  // The engine's forward with the rows on its hook: the engine's K/V products (--kv-rows engine) or the recipe's.
  int64_t prefill(const std::function<bool()>& stop, CaptureReuse* reuse) {
    const bool resume = reuse && b_.resumable();
    const ResumePoint from = resume ? ResumePoint{reuse->resume_state.get(), reuse->resume_tokens} : ResumePoint{};
    CudaEngine::DeviceHook hook;
    if (b_.engine_rows_) {
      b_.engine_.rank0().set_kv_tap([this](int layer, const float* k, const float* v, int64_t ld, int64_t rows, int64_t pos0, cudaStream_t st) {
        rows_from_engine(layer, k, v, ld, rows, pos0, st);
      });
    } else {
      job_ = start_embedding(from.tokens, 0);
      hook = [this](int layer, const float* d_h, int64_t rows, int64_t pos0, cudaStream_t st) { recipe_hook(layer, d_h, rows, pos0, st); };
    }
    return b_.engine_.prefill(tokens_, chunk_, hook, [&] { return stopped_.load() || (stop && stop()); }, false, false, from,
                              resume && reuse->wants_state() ? &reuse->kept : nullptr, resume ? reuse->keep_max_bytes : SIZE_MAX);
  }

  // The delivery thread: filled slots to the sink in the order they were filled.
  void deliver() {
    std::vector<uint8_t> kq, vq;
    for (uint64_t seq = 0;; ++seq) {
      Slot& s = b_.slots_[seq % kSlots];
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return s.state == Slot::Enqueued || (finished_ && seq >= next_fill_); });
        if (s.state != Slot::Enqueued) return;
      }
      try {
        deliver_slot(s, kq, vq);
      } catch (...) {
        delivery_error_ = std::current_exception();
        stopped_ = true;
      }
      std::lock_guard<std::mutex> l(mu_);
      s.state = Slot::Free;
      cv_.notify_all();
    }
  }
  void deliver_slot(Slot& s, std::vector<uint8_t>& kq, std::vector<uint8_t>& vq) {
    const auto t0 = StatsClock::now();
    PDB_CUDA_CHECK(cudaEventSynchronize(s.copied));
    const auto t1 = StatsClock::now();
    if (stats_.on) stats_.copy_wait_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    if (!stopped_) {
      const uint8_t* k = nullptr;
      const uint8_t* v = nullptr;
      size_t kb = 0, vb = 0;
      uint8_t* buf = b_.frames_->data(s.buf);
      b_.convert(s, spec_.k_type, rot_k_, k_rotation_size(info_.head_dim), buf + s.k_at, kq, k, kb, C_);
      if (has_v_) b_.convert(s, spec_.v_type, spec_.rot_v, kVRotationSize, buf + s.v_at, vq, v, vb, C_);
      KvBlock block{s.layer, s.pos0, s.rows, k, kb, v, vb};
      if (s.k_hash.valid()) {
        block.hashed = true;
        block.k_hash = s.k_hash.get();
        if (s.v_hash.valid()) block.v_hash = s.v_hash.get();
      }
      // the slot's buffer leaves as its block's frames (PDBRIDGE_FRAMES=copy: copied into new ones instead)
      if (hand_over_frames_ && cuda::encodes_on_gpu(spec_.k_type) && (!has_v_ || cuda::encodes_on_gpu(spec_.v_type)))
        block.take_frames = [this, &s, frame_bytes = (has_v_ ? s.v_at + vb : s.k_at + kb)] { return b_.hand_over(s, frame_bytes, stats_); };
      if (!sink_(block)) stopped_ = true;
    }
    s.k_hash = {};  // (a stopped capture's: waited for here, their bytes still the slot's)
    s.v_hash = {};
    if (stats_.on) stats_.deliver_ms += ms_since(t1);
  }

  // The next host slot once delivered, and the device staging its rows are computed in: stream rs waits (on the GPU,
  // the host does not) until the staging's previous rows have left for their slot.
  Slot& next_slot(int layer, int64_t rows, int64_t pos0, cudaStream_t rs) {
    Slot& s = free_slot();
    s.layer = layer;
    s.pos0 = pos0;
    s.rows = rows;
    stats_.wait_staging(rs, staged().copied_out);
    return s;
  }
  Slot& free_slot() {
    Slot& s = b_.slots_[next_fill_ % kSlots];
    const auto t0 = StatsClock::now();
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return s.state == Slot::Free; });
    if (stats_.on) stats_.slot_wait_ms += ms_since(t0);
    return s;
  }
  Staging& staged() { return b_.staging_[next_fill_ % kStaging]; }

  // The capture's last block leaves in pieces, each copied out and hashed on threads of its own as it lands: after the
  // engine's last product nothing is left to hide that block's copy and hashes behind (issue 36: at 8K in one
  // 8,192-token chunk, Qwen3's 16 MB of rows). Only rows the GPU writes in their final bytes (their hashes are the
  // frames') that leave as their frames.
  int pieces_of(const Slot& s) const {
    const bool last = s.layer == layers_ - 1 && s.pos0 + s.rows == int64_t(tokens_.size());
    if (!last || !hand_over_frames_ || !cuda::encodes_on_gpu(spec_.k_type) || (has_v_ && !cuda::encodes_on_gpu(spec_.v_type))) return 1;
    return int(std::clamp<int64_t>(s.rows / kTailPieceRows, 1, tail_pieces_));
  }
  static std::future<uint64_t> hash_when_landed(cudaEvent_t landed, const uint8_t* p, size_t n) {
    return std::async(std::launch::async, [=] {
      PDB_CUDA_CHECK(cudaEventSynchronize(landed));
      return wire::payload_hash(p, n);
    });
  }

  // The staged f32 rows (computed on rs) encoded and out to the slot's pinned host memory on the copy stream (the
  // capture's last block in pieces, pieces_of). encoded: the staging's bytes already hold the rows in the cache types
  // (the fused f16 rows).
  void send(Slot& s, cudaStream_t rs, bool encoded = false) {
    Staging& g = staged();
    const int64_t rows = s.rows;
    const size_t kbytes = encoded ? ggml_row_bytes(spec_.k_type, C_) * size_t(rows)
                                  : encode(spec_.k_type, rot_k_, k_rotation_size(info_.head_dim), g.dk, g.dkq, rows, C_, rs);
    const size_t vbytes = !has_v_ ? 0
                          : encoded ? ggml_row_bytes(spec_.v_type, C_) * size_t(rows)
                                    : encode(spec_.v_type, spec_.rot_v, kVRotationSize, g.dv, g.dvq, rows, C_, rs);
    PDB_CUDA_CHECK(cudaEventRecord(s.computed, rs));
    PDB_CUDA_CHECK(cudaStreamWaitEvent(b_.copy_stream_, s.computed, 0));
    const int pieces = pieces_of(s);
    const auto* k = static_cast<const uint8_t*>(outgoing(spec_.k_type, g.dk, g.dkq));
    const auto* v = static_cast<const uint8_t*>(outgoing(spec_.v_type, g.dv, g.dvq));
    const size_t krow = kbytes / size_t(rows), vrow = vbytes / size_t(rows);
    Slot* p = &s;
    for (int i = 0; i < pieces; ++i) {
      const int64_t r0 = rows * i / pieces, r1 = rows * (i + 1) / pieces;
      if (i > 0) {
        p = &free_slot();
        p->layer = s.layer;
      }
      p->pos0 = s.pos0 + r0;
      p->rows = r1 - r0;
      copy_out(*p, k + size_t(r0) * krow, size_t(r1 - r0) * krow, v + size_t(r0) * vrow, size_t(r1 - r0) * vrow);
      if (i == pieces - 1) PDB_CUDA_CHECK(cudaEventRecord(g.copied_out, b_.copy_stream_));
      PDB_CUDA_CHECK(cudaEventRecord(p->copied, b_.copy_stream_));
      if (pieces > 1) {
        const uint8_t* buf = b_.frames_->data(p->buf);
        p->k_hash = hash_when_landed(p->copied, buf + p->k_at, size_t(p->rows) * krow);
        if (has_v_) p->v_hash = hash_when_landed(p->copied, buf + p->v_at, size_t(p->rows) * vrow);
      }
      std::lock_guard<std::mutex> l(mu_);
      p->state = Slot::Enqueued;
      ++next_fill_;
      cv_.notify_all();
    }
    if (stats_.on && pieces > 1) stats_.tail_pieces = pieces;
  }
  // A slot's K and V bytes from the device to its buffer, on the copy stream: K right behind header room; V behind
  // more, right after K where it leaves as it is (the buffer is then the block's frames), 16-byte aligned where the
  // host converts its f32 rows.
  void copy_out(Slot& s, const uint8_t* k, size_t kbytes, const uint8_t* v, size_t vbytes) {
    uint8_t* buf = b_.frames_->data(s.buf);
    const size_t hb = wire::kHeaderBytes;
    s.k_at = hb;
    s.v_at = cuda::encodes_on_gpu(spec_.v_type) ? hb + kbytes + hb : (hb + kbytes + hb + 15) / 16 * 16;
    PDB_CUDA_CHECK(cudaMemcpyAsync(buf + s.k_at, k, kbytes, cudaMemcpyDeviceToHost, b_.copy_stream_));
    if (has_v_) PDB_CUDA_CHECK(cudaMemcpyAsync(buf + s.v_at, v, vbytes, cudaMemcpyDeviceToHost, b_.copy_stream_));
  }

  // The recipe's rows of one layer from its input (the residual on stream st).
  void emit(int layer, const float* src, int64_t rows, int64_t pos0, cudaStream_t st) {
    const cudaStream_t rs = b_.recipe_stream_ ? b_.recipe_stream_ : st;
    Slot& s = next_slot(layer, rows, pos0, rs);
    stats_.begin(st);
    const int nb = int(next_fill_ % kNormBuffers);
    PDB_CUDA_CHECK(cudaStreamWaitEvent(st, b_.normed_free_[nb], 0));
    b_.gpu_recipe_.normalize(layer, src, rows, st, b_.normed_[nb].as<float>());
    PDB_CUDA_CHECK(cudaEventRecord(b_.normed_ready_[nb], st));
    PDB_CUDA_CHECK(cudaStreamWaitEvent(rs, b_.normed_ready_[nb], 0));
    const float* x = b_.normed_[nb].as<float>();
    Staging& g = staged();
    const bool encoded = fused_ && b_.gpu_recipe_.kv_f16_from_normed(layer, x, rows, rs, g.dk.as<float>(), g.dv.as<float>(), g.dkq.get(), g.dvq.get());
    if (!encoded) b_.gpu_recipe_.kv_from_normed(layer, x, rows, rs, g.dk.as<float>(), g.dv.as<float>());
    PDB_CUDA_CHECK(cudaEventRecord(b_.normed_free_[nb], rs));
    send(s, rs, encoded);
    stats_.end(rs);
  }

  // --kv-rows engine: on the engine's stream (its K/V buffers are rewritten at the next layer), RoPE and type only.
  void rows_from_engine(int layer, const float* k, const float* v, int64_t ld, int64_t rows, int64_t pos0, cudaStream_t st) {
    if (stopped_) return;
    if (layer == 0) b_.gpu_recipe_.set_positions(pos0, rows, st);
    Slot& s = next_slot(layer, rows, pos0, st);
    stats_.begin(st);
    if (fused_ && b_.gpu_recipe_.rows_f16_from_engine(layer, k, v, ld, rows, hf_k_order_, st, staged().dkq.get(), staged().dvq.get())) {
      send(s, st, true);
    } else {
      b_.gpu_recipe_.rows_from_engine(layer, k, v, ld, rows, hf_k_order_, st, staged().dk.as<float>(), staged().dv.as<float>());
      send(s, st);
    }
    stats_.end(st);
  }

  // Layer 0 starts from the decoder's own (possibly quantized) embedding rows, dequantized on the host. Done inline
  // that cost the GPU ~30 ms per 4K-token chunk (the launching thread waited on it): a helper thread makes each
  // chunk's rows one chunk ahead into two pinned buffers, and the layer-0 rows are computed at a later layer's hook
  // (recipe_hook), so even the first chunk's are made while the GPU runs. Each layer's rows still leave in position
  // order, and a chunk's last layer last.
  EmbedJob start_embedding(int64_t pos0, int buf) {
    EmbedJob j;
    j.pos0 = pos0;
    j.rows = std::min(chunk_, int64_t(tokens_.size()) - pos0);
    j.buf = buf;
    if (j.rows <= 0) return j;
    j.ready = std::async(std::launch::async, [this, pos0, rows = j.rows, buf] {
      PDB_CUDA_CHECK(cudaEventSynchronize(b_.embed_uploaded_[buf]));  // its previous upload has left the buffer
      b_.recipe_->decoder_embedding(tokens_.data() + pos0, rows, b_.embed_pinned_[buf].as<float>());
    });
    return j;
  }
  // The chunk's embedding rows to embed_dev_ on the upload stream, behind the last chunk's layer-0 norm that read it. On
  // the engine's stream the copy held its kernels (67 MB of f32 rows per 4K-token chunk of Llama-8B: over a millisecond
  // at PCIe rates; with the recipe's f16 norm, +1.3-3.2% engine + recipe + frames, docs/RESULTS.md session 43).
  void upload_layer0() {
    if (job_.pos0 != chunk_pos0_ || job_.rows != chunk_rows_ || !job_.ready.valid()) {  // the engine chunked otherwise: make them now
      if (job_.ready.valid()) job_.ready.wait();
      job_ = EmbedJob{chunk_pos0_, chunk_rows_, job_.buf, {}};
      PDB_CUDA_CHECK(cudaEventSynchronize(b_.embed_uploaded_[job_.buf]));
      b_.recipe_->decoder_embedding(tokens_.data() + chunk_pos0_, chunk_rows_, b_.embed_pinned_[job_.buf].as<float>());
    } else {
      job_.ready.get();  // rethrows a token outside the decoder's vocabulary
    }
    const size_t bytes = size_t(chunk_rows_ * info_.n_embd) * 4;
    const cudaStream_t up = b_.upload_stream_;
    PDB_CUDA_CHECK(cudaStreamWaitEvent(up, b_.embed_free_, 0));
    PDB_CUDA_CHECK(cudaMemcpyAsync(b_.embed_dev_.get(), b_.embed_pinned_[job_.buf].as<float>(), bytes, cudaMemcpyHostToDevice, up));
    PDB_CUDA_CHECK(cudaEventRecord(b_.embed_uploaded_[job_.buf], up));
    PDB_CUDA_CHECK(cudaEventRecord(b_.embed_ready_, up));
    const int buf = job_.buf;
    job_ = start_embedding(chunk_pos0_ + chunk_rows_, buf ^ 1);
    layer0_uploaded_ = true;
  }
  void emit_layer0(cudaStream_t st) {
    if (!layer0_uploaded_) upload_layer0();
    PDB_CUDA_CHECK(cudaStreamWaitEvent(st, b_.embed_ready_, 0));
    emit(0, b_.embed_dev_.as<float>(), chunk_rows_, chunk_pos0_, st);
    PDB_CUDA_CHECK(cudaEventRecord(b_.embed_free_, st));  // the norm on st has read embed_dev_
    layer0_uploaded_ = false;
  }
  bool layer0_ready() {
    return job_.pos0 != chunk_pos0_ || !job_.ready.valid() || job_.ready.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  // The engine's hook at each layer's input. Layer 0's embedding rows of the chunk in flight are uploaded at the first
  // later hook that finds the helper's rows ready, and their rows go out at the next hook (a layer's work later, the
  // upload done), at the latest at the last layer's (whose rows mark the chunk complete), so the GPU waits neither on
  // the host nor on the copy: for the first chunk there was no chunk ahead to make them in.
  void recipe_hook(int layer, const float* d_h, int64_t rows, int64_t pos0, cudaStream_t st) {
    if (stopped_) return;
    if (layer == 0) {
      b_.gpu_recipe_.set_positions(pos0, rows, b_.recipe_stream_ ? b_.recipe_stream_ : st);  // the stream RoPE runs on
      chunk_pos0_ = pos0;
      chunk_rows_ = rows;
      layer0_due_ = true;
      if (layers_ > 1) return;
    }
    if (layer0_due_) {
      if (layer0_uploaded_ || layer == layers_ - 1) {
        emit_layer0(st);
        layer0_due_ = false;
      } else if (layer0_ready()) {
        upload_layer0();
      }
    }
    if (layer > 0) emit(layer, d_h, rows, pos0, st);
  }

  CudaBackend& b_;
  const std::vector<int32_t>& tokens_;
  const int64_t chunk_;
  const CacheSpec& spec_;
  const KvSink& sink_;
  const RecipeInfo& info_;
  const int64_t C_;
  const bool has_v_;  // MLA: one K row per token, no V section
  const bool rot_k_;
  const int layers_;
  const bool hf_k_order_;  // the engine's K rows are in HF's order
  bool hand_over_frames_ = false, fused_ = false;
  int tail_pieces_ = kTailPieces;
  CaptureStats stats_;
  std::atomic<bool> stopped_{false};
  bool finished_ = false;
  std::exception_ptr delivery_error_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_fill_ = 0;
  EmbedJob job_;
  int64_t chunk_pos0_ = 0, chunk_rows_ = 0;
  bool layer0_due_ = false, layer0_uploaded_ = false;
};

int64_t CudaBackend::capture(const std::vector<int32_t>& tokens, int64_t chunk, const CacheSpec& spec, const KvSink& sink,
                             const std::function<bool()>& stop, CaptureReuse* reuse) {
  std::lock_guard<std::mutex> one_at_a_time(capture_mu_);  // the slots and the engine's K/V are per capture
  chunk = std::min(chunk <= 0 ? max_chunk_ : chunk, max_chunk_);
  return Capture(*this, tokens, chunk, spec, sink).run(stop, reuse);
}

}  // namespace

bool cuda_backend_available() { return cuda::device_count() > 0; }

std::unique_ptr<PrefillBackend> make_cuda_backend(const std::string& hf_dir, std::shared_ptr<const Recipe> recipe, int threads,
                                                  int64_t max_chunk, bool kv_fp8, int tp, bool tp_shared_device, double max_gpu_mem_gib,
                                                  bool engine_kv_rows, ProductNumerics numerics) {
  if (cuda::device_count() == 0) throw std::runtime_error("--device cuda: " + cuda::device_summary());
  if (max_chunk <= 0 && max_gpu_mem_gib > 0) max_chunk = 4096;  // under a memory cap, the smaller buffers rather than the faster chunk
  auto b = std::make_unique<CudaBackend>(hf_dir, std::move(recipe), threads, max_chunk, kv_fp8, tp, tp_shared_device, engine_kv_rows, numerics);
  if (max_gpu_mem_gib > 0) b->set_memory_cap(size_t(max_gpu_mem_gib * double(size_t(1) << 30)));
  return b;
}

}  // namespace pdb
