#include "prefill/capture.h"

#include <atomic>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "cache/cache_kind.h"

namespace pdb {

CaptureResult run_capture(PrefillBackend& backend, const wire::PrefillRequest& req, int64_t chunk, const EmitFn& emit,
                          PrefixCache* cache) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& info = backend.info();
  const CacheKindTraits& kind = cache_kind_traits(info.cache_kind);
  CacheSpec spec{req.k_type, req.v_type, req.rot_k, req.rot_v, req.simd_width};
  const int64_t T = int64_t(req.tokens.size());
  CaptureResult res;
  if (!kind.per_token_rows && req.tail_from > 0)
    throw std::invalid_argument(fmt::format("a pooled cache ({}) is captured whole: tail_from must be 0", info.arch));
  // Rows before send_from are the decoder's already; the engine may resume after a cached prefix of them.
  const int64_t send_from = req.tail_from;
  CaptureReuse reuse;
  reuse.send_from = send_from;
  const bool keeps = cache && cache->enabled() && backend.resumable();
  const std::string key = keeps ? backend.state_key(spec) : std::string();
  if (keeps && send_from > 0) {
    auto hit = cache->lookup(key, req.tokens, send_from);
    reuse.resume_state = std::move(hit.state);
    reuse.resume_tokens = hit.tokens;
  }
  if (keeps && cache->stats().entries > 0) {
    // The cached prefixes (in the GPU's memory) may be what leaves this prompt no room: it is worth more.
    try {
      backend.check_fits(T, chunk);
    } catch (const std::exception&) {
      cache->clear();
      reuse.resume_state.reset();
      reuse.resume_tokens = 0;
    }
  }
  // Without a cache to keep it in, the engine does not copy its state: on the GPU that copy (the prompt's K/V, with
  // its allocation and release) would cost every capture for nothing.
  reuse.keep_max_bytes = keeps ? cache->stats().max_bytes : 0;
  res.tail_from = send_from;
  res.prefix_reused = reuse.resume_tokens;
  std::atomic<bool> aborted{false}, sealed{false};  // the sink may run on a backend's delivery thread
  {
    std::vector<uint8_t> hello;
    nlohmann::json h = {{"wire_version", wire::kWireVersion}, {"fingerprint", recipe_fingerprint(info)}, {"n_tokens", T},
                        {"n_layer", info.n_layer}, {"n_embd_kv", info.n_embd_kv()},
                        {"k_type", ggml_type_name(spec.k_type)}, {"v_type", ggml_type_name(spec.v_type)},
                        {"k_row_bytes", ggml_row_bytes(spec.k_type, info.n_embd_kv())},
                        {"v_row_bytes", info.n_embd_v() && kind.per_token_rows ? ggml_row_bytes(spec.v_type, info.n_embd_v()) : 0},
                        {"rot_k", spec.rot_k}, {"rot_v", spec.rot_v}, {"chunk", chunk}, {"cache", kind.wire_name},
                        {"tail_from", send_from}, {"prefix_reused", reuse.resume_tokens}};
    if (!kind.per_token_rows) h["window"] = info.window;
    wire::encode_json_frame(wire::FrameKind::Hello, h, hello);
    if (emit(std::move(hello), true) == Emit::Gone) aborted = true;
  }
  // A chunk is complete when its last layer's rows are out; track the contiguous prefix sent (the decoder
  // holds [0, send_from)).
  int64_t done = send_from;
  bool seal_sent = false;
  try {
    if (!aborted) {
      backend.check_fits(T, chunk);
      backend.capture(
          req.tokens, chunk, spec,
          [&](const KvBlock& whole) {
            // K/V rows the decoder holds (a backend that computed them anyway) are not sent
            KvBlock b = whole;
            if (b.k && b.seal_tokens == 0 && b.pos0 < send_from) {
              if (b.pos0 + b.rows <= send_from) {
                if (b.layer == info.n_layer - 1) done = std::max(done, b.pos0 + b.rows);
                return true;
              }
              const size_t cut = size_t(send_from - b.pos0), k_row = b.k_bytes / size_t(b.rows), v_row = b.v_bytes / size_t(b.rows);
              b.pos0 = send_from;
              b.rows -= int64_t(cut);
              b.k += cut * k_row;
              b.k_bytes -= cut * k_row;
              if (b.v) b.v += cut * v_row;
              b.v_bytes -= cut * v_row;
            }
            std::vector<uint8_t> frame;
            wire::FrameHeader fh;
            fh.layer = uint32_t(b.layer);
            auto encode_sections = [&](const KvBlock& blk, std::vector<uint8_t>& out) {
              for (const auto& sec : blk.sections) {
                fh.kind = sec.kind;
                fh.type = uint8_t(sec.type);
                fh.pos0 = uint32_t(sec.first);
                fh.n_rows = uint32_t(sec.rows);
                wire::encode_frame(fh, sec.data, sec.bytes, out);
              }
            };
            if (b.seal_tokens > 0) {  // a pooled backend's seal: taken only when this capture stopped for one
              if (!sealed || aborted) return false;
              if (b.seal_tokens != done) throw std::logic_error(fmt::format("seal at {} tokens, {} sent whole", b.seal_tokens, done));
              if (!seal_sent) {
                wire::encode_json_frame(wire::FrameKind::Seal, {{"tokens", done}}, frame);
                seal_sent = true;
              }
              encode_sections(b, frame);
              if (emit(std::move(frame), true) == Emit::Gone) { aborted = true; return false; }
              return true;
            }
            if (!b.k) {  // a pooled cache's sections
              encode_sections(b, frame);
            } else {
              fh.pos0 = uint32_t(b.pos0);
              fh.n_rows = uint32_t(b.rows);
              fh.kind = wire::FrameKind::K;
              fh.type = uint8_t(spec.k_type);
              frame.reserve(b.k_bytes + b.v_bytes + 2 * wire::kHeaderBytes);
              // Large blocks: hash V on a helper thread while this one hashes and copies K (the GPU
              // backend produces rows faster than one core frames them).
              uint64_t v_hash = 0;
              std::thread hasher;
              if (b.v_bytes >= (size_t(1) << 20)) hasher = std::thread([&] { v_hash = wire::payload_hash(b.v, b.v_bytes); });
              else v_hash = wire::payload_hash(b.v, b.v_bytes);
              wire::encode_frame(fh, b.k, b.k_bytes, frame);
              if (hasher.joinable()) hasher.join();
              if (info.n_embd_v()) {  // no V frames where the decoder's state has no V section (MLA)
                fh.kind = wire::FrameKind::V;
                fh.type = uint8_t(spec.v_type);
                wire::encode_frame_hashed(fh, b.v, b.v_bytes, v_hash, frame);
              }
            }
            if (frame.empty()) {  // a pooled layer with nothing to send for this chunk
              if (b.layer == info.n_layer - 1) done = b.pos0 + b.rows;
              return true;
            }
            const Emit e = emit(std::move(frame), false);
            if (e == Emit::Gone) { aborted = true; return false; }
            if (e == Emit::Seal) { sealed = true; return false; }
            if (b.layer == info.n_layer - 1) done = b.pos0 + b.rows;
            return true;
          },
          [&] { return aborted || sealed; }, &reuse);
    }
    if (aborted) { res.status = "error"; res.reason = "receiver went away"; }
    else if (sealed) { res.status = done > send_from ? "partial" : "error"; res.reason = "memory limit reached: sealed the prefix sent so far"; }
    else if (done == T) res.status = "complete";
    else { res.status = "partial"; res.reason = "engine stopped early"; }
  } catch (const std::exception& e) {
    res.status = done > send_from ? "partial" : "error";
    res.reason = e.what();
  }
  if (keeps && reuse.kept && reuse.kept->tokens > reuse.resume_tokens) {
    res.computed = reuse.kept->tokens - reuse.resume_tokens;
    cache->insert(key, req.tokens, std::move(reuse.kept));
  } else {
    res.computed = std::max<int64_t>(0, done - reuse.resume_tokens);
  }
  res.tokens = done;
  res.engine_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!aborted) {
    std::vector<uint8_t> tr;
    wire::encode_json_frame(wire::FrameKind::Trailer,
                            {{"status", res.status}, {"tokens", res.tokens}, {"n_tokens", T}, {"reason", res.reason},
                             {"tail_from", send_from}, {"prefix_reused", res.prefix_reused}, {"computed_tokens", res.computed},
                             {"engine_s", res.engine_s}, {"tok_s", res.engine_s > 0 ? double(res.tokens) / res.engine_s : 0.0}},
                            tr);
    emit(std::move(tr), true);
  }
  return res;
}

}  // namespace pdb
