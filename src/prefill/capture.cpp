#include "prefill/capture.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include <fmt/format.h>

#include "cache/cache_kind.h"

namespace pdb {

namespace {
wire::Bytes hello_frame(const RecipeInfo& info, const CacheKindTraits& kind, const CacheSpec& spec, int64_t T, int64_t chunk,
                        int64_t send_from, int64_t prefix_reused) {
  nlohmann::json h = {{"wire_version", wire::kWireVersion}, {"fingerprint", recipe_fingerprint(info)}, {"n_tokens", T},
                      {"n_layer", info.n_layer}, {"n_embd_kv", info.n_embd_kv()},
                      {"k_type", ggml_type_name(spec.k_type)}, {"v_type", ggml_type_name(spec.v_type)},
                      {"k_row_bytes", ggml_row_bytes(spec.k_type, info.n_embd_kv())},
                      {"v_row_bytes", info.n_embd_v() && kind.per_token_rows ? ggml_row_bytes(spec.v_type, info.n_embd_v()) : 0},
                      {"rot_k", spec.rot_k}, {"rot_v", spec.rot_v}, {"chunk", chunk}, {"cache", kind.wire_name},
                      {"tail_from", send_from}, {"prefix_reused", prefix_reused}};
  if (!kind.per_token_rows) h["window"] = info.window;
  wire::Bytes out;
  wire::encode_json_frame(wire::FrameKind::Hello, h, out);
  return out;
}

// The block without the K/V rows the decoder holds (a backend that computed them anyway); rows 0 when none is left.
KvBlock without_rows_before(const KvBlock& whole, int64_t send_from) {
  KvBlock b = whole;
  if (!b.k || b.seal_tokens != 0 || b.rows == 0 || b.pos0 >= send_from) return b;
  const int64_t cut = std::min(b.rows, send_from - b.pos0);
  const size_t k_row = b.k_bytes / size_t(b.rows), v_row = b.v_bytes / size_t(b.rows);
  b.take_frames = nullptr;  // the rows left no longer lie as frames
  b.hashed = false;         // nor are the payloads' hashes theirs
  b.pos0 += cut;
  b.rows -= cut;
  b.k += size_t(cut) * k_row;
  b.k_bytes -= size_t(cut) * k_row;
  if (b.v) b.v += size_t(cut) * v_row;
  b.v_bytes -= size_t(cut) * v_row;
  return b;
}

void append_section_frames(const KvBlock& b, wire::Bytes& out) {
  std::vector<wire::FramePayload> parts;
  parts.reserve(b.sections.size());
  for (const auto& sec : b.sections) {
    wire::FrameHeader fh;
    fh.layer = uint32_t(b.layer);
    fh.kind = sec.kind;
    fh.type = uint8_t(sec.type);
    fh.pos0 = uint32_t(sec.first);
    fh.n_rows = uint32_t(sec.rows);
    parts.push_back({fh, sec.data, sec.bytes});
  }
  wire::encode_frames(parts, out);
}

// K and V frames of a block in one buffer (no V frames where the decoder's state has no V section: MLA): the
// backend's own buffer where it offers one laid out as the frames, else a copy.
wire::Bytes kv_frames(const KvBlock& b, const CacheSpec& spec, bool has_v) {
  wire::FrameHeader k;
  k.kind = wire::FrameKind::K;
  k.type = uint8_t(spec.k_type);
  k.layer = uint32_t(b.layer);
  k.pos0 = uint32_t(b.pos0);
  k.n_rows = uint32_t(b.rows);
  wire::FrameHeader v = k;
  v.kind = wire::FrameKind::V;
  v.type = uint8_t(spec.v_type);
  // The backend's buffer as the frames, if it lies as they do; it stays alive until the rows are copied otherwise.
  wire::Bytes taken = b.take_frames ? b.take_frames() : wire::Bytes();
  const size_t hb = wire::kHeaderBytes, bytes = hb + b.k_bytes + (has_v ? hb + b.v_bytes : 0);
  if (taken.size() == bytes && taken.data() + hb == b.k && (!has_v || taken.data() + 2 * hb + b.k_bytes == b.v)) {
    k.payload_hash = b.k_hash;
    v.payload_hash = b.v_hash;
    if (has_v) wire::frame_in_place({{k, 0, b.k_bytes, b.hashed}, {v, hb + b.k_bytes, b.v_bytes, b.hashed}}, taken);
    else wire::frame_in_place({{k, 0, b.k_bytes, b.hashed}}, taken);
    return taken;
  }
  wire::Bytes out;
  if (has_v) wire::encode_frames({{k, b.k, b.k_bytes}, {v, b.v, b.v_bytes}}, out);
  else wire::encode_frames({{k, b.k, b.k_bytes}}, out);
  return out;
}

wire::Bytes trailer_frame(const CaptureResult& res, int64_t T) {
  wire::Bytes out;
  wire::encode_json_frame(wire::FrameKind::Trailer,
                          {{"status", res.status}, {"tokens", res.tokens}, {"n_tokens", T}, {"reason", res.reason},
                           {"tail_from", res.tail_from}, {"prefix_reused", res.prefix_reused}, {"computed_tokens", res.computed},
                           {"engine_s", res.engine_s}, {"tok_s", res.engine_s > 0 ? double(res.tokens) / res.engine_s : 0.0}},
                          out);
  return out;
}
}  // namespace

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
  if (emit(hello_frame(info, kind, spec, T, chunk, send_from, reuse.resume_tokens), true) == Emit::Gone) aborted = true;
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
            const KvBlock b = without_rows_before(whole, send_from);
            if (b.k && b.rows == 0) {  // every row the decoder's already
              if (b.layer == info.n_layer - 1) done = std::max(done, b.pos0);
              return true;
            }
            wire::Bytes frame;
            if (b.seal_tokens > 0) {  // a pooled backend's seal: taken only when this capture stopped for one
              if (!sealed || aborted) return false;
              if (b.seal_tokens != done) throw std::logic_error(fmt::format("seal at {} tokens, {} sent whole", b.seal_tokens, done));
              if (!seal_sent) {
                wire::encode_json_frame(wire::FrameKind::Seal, {{"tokens", done}}, frame);
                seal_sent = true;
              }
              append_section_frames(b, frame);
              if (emit(std::move(frame), true) == Emit::Gone) { aborted = true; return false; }
              return true;
            }
            if (b.k) frame = kv_frames(b, spec, info.n_embd_v() > 0);
            else append_section_frames(b, frame);  // a pooled cache's sections
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
  if (!aborted) emit(trailer_frame(res, T), true);
  return res;
}

}  // namespace pdb
