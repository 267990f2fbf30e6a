#include <stdexcept>
#include <vector>

#include "model/cpu_engine.h"
#include "arch/backends.h"

namespace pdb {
namespace {

class CpuBackend final : public PrefillBackend {
 public:
  CpuBackend(std::shared_ptr<CpuEngine> e, std::shared_ptr<const Recipe> r, bool faithful)
      : engine_(std::move(e)), recipe_(std::move(r)), faithful_(faithful) {
    // The decoder rounds each matmul input to its weights' dot type; with the same weights in two
    // dtypes (HF bf16, GGUF F16) the engine must round as the decoder does, not as its checkpoint.
    if (faithful_ && recipe_->loaded_layers() > 0 && !recipe_->info().mla()) {
      const GgmlType t = recipe_->k_weight(0).type;
      if (t == GgmlType::F16) engine_->set_activation_precision(16);
      else if (t == GgmlType::BF16) engine_->set_activation_precision(17);
      else if (t == GgmlType::F32) engine_->set_activation_precision(32);
      // and multiplies the weights its GGUF holds: a float GGUF of another width than the checkpoint
      // rounds some of them (the recipe reads them from the GGUF; the engine rounds its own alike)
      if (t == GgmlType::F16 || t == GgmlType::BF16) engine_->round_weights_to(t == GgmlType::F16 ? 16 : 17);
    }
  }
  const HfConfig& config() const override { return engine_->config(); }
  const RecipeInfo& info() const override { return recipe_->info(); }
  std::string device() const override { return faithful_ ? "cpu" : "cpu (fast numerics)"; }

  bool resumable() const override { return engine_->resumable(); }

  int64_t capture(const std::vector<int32_t>& tokens, int64_t chunk, const CacheSpec& spec, const KvSink& sink,
                  const std::function<bool()>& stop, CaptureReuse* reuse) override {
    const auto& info = recipe_->info();
    bool stopped = false;
    const bool resume = reuse && resumable();
    const int64_t send_from = reuse ? reuse->send_from : 0;
    const ResumePoint from = resume ? ResumePoint{reuse->resume_state.get(), reuse->resume_tokens} : ResumePoint{};
    return engine_->prefill(
        tokens, chunk, faithful_ ? spec.simd_width : 0,
        [&](int layer, const float* h, int64_t rows, int64_t pos0) {
          if (stopped) return;
          if (pos0 + rows <= send_from) return;  // the decoder holds these rows: no recipe for them
          if (pos0 < send_from) {
            h += (send_from - pos0) * recipe_->info().n_embd;
            rows -= send_from - pos0;
            pos0 = send_from;
          }
          std::vector<uint8_t> k, v;
          std::vector<float> h0;
          if (layer == 0) {  // the decoder's own layer-0 input: its (possibly quantized) embedding rows
            h0.resize(size_t(rows * recipe_->info().n_embd));
            recipe_->decoder_embedding(tokens.data() + pos0, rows, h0.data());
            h = h0.data();
          }
          recipe_->kv_rows(layer, h, rows, pos0, spec, k, v);
          if (!sink(KvBlock{layer, pos0, rows, k.data(), k.size(), v.data(), v.size()})) stopped = true;
        },
        [&] { return stopped || (stop && stop()); },
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
                         k_rotation_size(info.head_dim), kVRotationSize},
        from, resume && reuse->wants_state() ? &reuse->kept : nullptr);
  }

  int64_t forward_only(const std::vector<int32_t>& tokens, int64_t chunk, bool, bool skip_attention) override {
    if (skip_attention) throw std::invalid_argument("the CPU engine has no forward without attention (a GPU benchmark mode)");
    return engine_->prefill(tokens, chunk, 0, [](int, const float*, int64_t, int64_t) {});
  }
  std::string weights() const override { return engine_->weights_note(); }

 private:
  std::shared_ptr<CpuEngine> engine_;
  std::shared_ptr<const Recipe> recipe_;
  bool faithful_ = true;
};

}  // namespace

std::unique_ptr<PrefillBackend> make_cpu_backend(std::shared_ptr<CpuEngine> engine, std::shared_ptr<const Recipe> recipe, bool faithful) {
  return std::make_unique<CpuBackend>(std::move(engine), std::move(recipe), faithful);
}

CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk,
                          const std::function<bool(wire::Bytes&&)>& emit) {
  return run_capture(engine, recipe, req, chunk, EmitFn([&](wire::Bytes&& f, bool) { return emit(std::move(f)) ? Emit::Ok : Emit::Gone; }));
}

CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk, const EmitFn& emit) {
  // Non-owning views of the caller's engine and recipe.
  auto backend = make_cpu_backend(std::shared_ptr<CpuEngine>(&engine, [](CpuEngine*) {}), std::shared_ptr<const Recipe>(&recipe, [](const Recipe*) {}));
  return run_capture(*backend, req, chunk, emit);
}

}  // namespace pdb
