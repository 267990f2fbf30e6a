#include "prefill/capture.h"

#include <chrono>

#include <fmt/format.h>

namespace pdb {

CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk,
                          const std::function<bool(std::vector<uint8_t>&&)>& emit) {
  return run_capture(engine, recipe, req, chunk, EmitFn([&](std::vector<uint8_t>&& f, bool) { return emit(std::move(f)) ? Emit::Ok : Emit::Gone; }));
}

CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk, const EmitFn& emit) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto& info = recipe.info();
  CacheSpec spec{req.k_type, req.v_type, req.rot_k, req.rot_v, req.simd_width};
  const int64_t T = int64_t(req.tokens.size());
  CaptureResult res;
  bool aborted = false, sealed = false;
  {
    std::vector<uint8_t> hello;
    wire::encode_json_frame(wire::FrameKind::Hello,
                            {{"wire_version", wire::kWireVersion}, {"fingerprint", recipe_fingerprint(info)}, {"n_tokens", T},
                             {"n_layer", info.n_layer}, {"n_embd_kv", info.n_embd_kv()},
                             {"k_type", ggml_type_name(spec.k_type)}, {"v_type", ggml_type_name(spec.v_type)},
                             {"k_row_bytes", ggml_row_bytes(spec.k_type, info.n_embd_kv())},
                             {"v_row_bytes", ggml_row_bytes(spec.v_type, info.n_embd_kv())},
                             {"rot_k", spec.rot_k}, {"rot_v", spec.rot_v}, {"chunk", chunk}},
                            hello);
    if (emit(std::move(hello), true) == Emit::Gone) aborted = true;
  }
  // A chunk is complete when its last layer's rows are out; track the contiguous prefix sent.
  int64_t done = 0;
  try {
    if (!aborted) {
      engine.prefill(
          req.tokens, chunk, spec.simd_width,
          [&](int layer, const float* h, int64_t rows, int64_t pos0) {
            if (aborted || sealed) return;
            std::vector<uint8_t> k, v, frame;
            recipe.kv_rows(layer, h, rows, pos0, spec, k, v);
            wire::FrameHeader fh;
            fh.layer = uint32_t(layer);
            fh.pos0 = uint32_t(pos0);
            fh.n_rows = uint32_t(rows);
            fh.kind = wire::FrameKind::K;
            fh.type = uint8_t(spec.k_type);
            frame.reserve(k.size() + v.size() + 2 * wire::kHeaderBytes);
            wire::encode_frame(fh, k.data(), k.size(), frame);
            fh.kind = wire::FrameKind::V;
            fh.type = uint8_t(spec.v_type);
            wire::encode_frame(fh, v.data(), v.size(), frame);
            const Emit e = emit(std::move(frame), false);
            if (e == Emit::Gone) { aborted = true; return; }
            if (e == Emit::Seal) { sealed = true; return; }
            if (layer == info.n_layer - 1) done = pos0 + rows;
          },
          [&] { return aborted || sealed; },
          [&](float* rows, int64_t n, int64_t kv_dim, bool is_v) {
            // Attend over what the decoder's cache will hold: K/V through the cache type (and rotation).
            const GgmlType t = is_v ? spec.v_type : spec.k_type;
            if (t == GgmlType::F32) return;
            const bool rot = is_v ? spec.rot_v : spec.rot_k;
            const int64_t rn = is_v ? kVRotationSize : k_rotation_size(info.head_dim);
            if (rot) hadamard_rows(rows, n * kv_dim, rn);
            std::vector<uint8_t> tmp(ggml_row_bytes(t, kv_dim));
            for (int64_t r = 0; r < n; ++r) {
              quantize_row(t, rows + r * kv_dim, tmp.data(), kv_dim, Q8Rounding::TiesEven);
              dequantize_row(t, tmp.data(), rows + r * kv_dim, kv_dim);
            }
            if (rot) hadamard_rows(rows, n * kv_dim, rn);  // orthonormal and symmetric: its own inverse
          },
          DecoderCacheSpec{spec.k_type == GgmlType::Q8_0 && spec.v_type == GgmlType::Q8_0, spec.rot_k, spec.rot_v,
                           k_rotation_size(info.head_dim), kVRotationSize});
    }
    if (aborted) { res.status = "error"; res.reason = "receiver went away"; }
    else if (sealed) { res.status = done > 0 ? "partial" : "error"; res.reason = "memory limit reached: sealed the prefix sent so far"; }
    else if (done == T) res.status = "complete";
    else { res.status = "partial"; res.reason = "engine stopped early"; }
  } catch (const std::exception& e) {
    res.status = done > 0 ? "partial" : "error";
    res.reason = e.what();
  }
  res.tokens = done;
  res.engine_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!aborted) {
    std::vector<uint8_t> tr;
    wire::encode_json_frame(wire::FrameKind::Trailer,
                            {{"status", res.status}, {"tokens", res.tokens}, {"n_tokens", T}, {"reason", res.reason},
                             {"engine_s", res.engine_s}, {"tok_s", res.engine_s > 0 ? double(res.tokens) / res.engine_s : 0.0}},
                            tr);
    emit(std::move(tr), true);
  }
  return res;
}

}  // namespace pdb
