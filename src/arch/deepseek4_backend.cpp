// The prefill backend for DeepSeek-V4 (the CPU engine here, the GPU engine through make_cuda_dsv4_backend): the
// engine's chunks, each layer's sections from the recipe turned into the decoder's bytes for the wire
// (docs/WIRE.md, "Sections"): the window rows among the prompt's last W positions, the CSA / HCA / LID blocks
// finished in the chunk, and with the prompt's last chunk the compressors' f32 rings; and a capture's seal.
#include "arch/deepseek4_backend.h"

#include <filesystem>
#include <stdexcept>

#include "formats/gguf.h"
#include "formats/hf_deepseek4.h"
#include "model/cpu_engine_dsv4.h"
#include "arch/backends.h"
#include "recipes/deepseek4.h"

namespace pdb {
namespace {

class Dsv4Backend final : public PrefillBackend {
 public:
  Dsv4Backend(std::shared_ptr<const Deepseek4Recipe> recipe, Dsv4EngineRun run, std::string device, std::string weights, int64_t preferred_chunk)
      : recipe_(std::move(recipe)), run_(std::move(run)), device_(std::move(device)), weights_(std::move(weights)),
        info_(read_recipe_info(recipe_->gguf())), preferred_chunk_(preferred_chunk) {
    const auto& c = recipe_->config();
    config_.arch = "deepseek4";
    config_.hidden_size = c.hidden;
    config_.num_layers = c.layers;
    config_.num_heads = c.heads;
    config_.num_kv_heads = 1;
    config_.head_dim = c.head_dim;
    config_.vocab_size = c.vocab;
  }
  const HfConfig& config() const override { return config_; }
  const RecipeInfo& info() const override { return info_; }
  std::string device() const override { return device_; }
  std::string weights() const override { return weights_; }
  int64_t preferred_chunk() const override { return preferred_chunk_; }

  int64_t capture(const std::vector<int32_t>& tokens, int64_t chunk, const CacheSpec& spec, const KvSink& sink,
                  const std::function<bool()>& stop, CaptureReuse*) override {
    const auto& c = recipe_->config();
    const int64_t T = int64_t(tokens.size()), D = c.head_dim, W = c.window, L = c.layers;
    const GgmlType kt = spec.k_type;
    const size_t wrb = ggml_row_bytes(kt, D);
    using K = wire::FrameKind;
    // What a seal needs besides the pool rows already sent: per layer the window rows of the last W positions and
    // the rings, as of the last chunk every layer finished (`sealable`), and as of the chunk in progress.
    struct Tail {
      int64_t win_first = 0, before_first = 0;
      std::vector<uint8_t> win;     // the last (up to W) rows, of positions win_first ..
      std::vector<uint8_t> before;  // the (up to W) rows ending at the chunk in progress's first position
      Dsv4LayerBytes rings, rings_done;  // after the chunk in progress / after the last complete one
      int ratio = 0;
    };
    std::vector<Tail> tail(static_cast<size_t>(L));
    int64_t sealable = 0;
    auto add = [](KvBlock& blk, K k, GgmlType t, int64_t first, const std::vector<uint8_t>& bytes, int64_t n_rows, size_t row_bytes) {
      if (n_rows > 0) blk.sections.push_back({k, t, first, n_rows, bytes.data(), size_t(n_rows) * row_bytes});
    };
    auto add_rings = [&](KvBlock& blk, const Dsv4LayerBytes& b, int ratio) {
      const bool csa = ratio == 4;
      const int64_t ring = csa ? 8 : 128;
      add(blk, csa ? K::CsaKvRing : K::HcaKvRing, GgmlType::F32, 0, b.ring_kv, ring, b.ring_kv.size() / size_t(ring));
      add(blk, csa ? K::CsaScoreRing : K::HcaScoreRing, GgmlType::F32, 0, b.ring_score, ring, b.ring_score.size() / size_t(ring));
      if (csa) {
        add(blk, K::LidKvRing, GgmlType::F32, 0, b.lid_kv, 8, b.lid_kv.size() / 8);
        add(blk, K::LidScoreRing, GgmlType::F32, 0, b.lid_score, 8, b.lid_score.size() / 8);
      }
    };
    bool refused = false;
    const int64_t done = run_(
        tokens, chunk, kt,
        [&](int layer, const float*, int64_t pos0, int64_t rows, const Deepseek4LayerSections& S) {
          // the engine's sections hold every position's window row (it attends over them); the decoder keeps the last W
          const Dsv4LayerBytes b = recipe_->to_bytes(S, kt);
          Tail& tl = tail[size_t(layer)];
          tl.ratio = int(S.ratio);
          // the engine's window rows: every position of the chunk (CPU) or its last min(rows, W) (GPU: all a seal and
          // the wire can need). `before` keeps the W rows ending at pos0 (a seal there, once this layer has moved on).
          const int64_t end = tl.win_first + int64_t(tl.win.size() / wrb), got = int64_t(S.window.size()) / D;
          if (S.window_first + got != pos0 + rows || S.window_first < pos0) throw std::logic_error("DSV4 backend: window rows must end at the chunk's end");
          tl.before.clear();
          if (!tl.win.empty() && end == pos0) {
            const int64_t nb = std::min<int64_t>(W, end - tl.win_first);
            tl.before.assign(tl.win.end() - std::ptrdiff_t(size_t(nb) * wrb), tl.win.end());
            tl.before_first = end - nb;
          }
          if (tl.win.empty() || end != S.window_first) {
            tl.win.clear();
            tl.win_first = S.window_first;
          }
          tl.win.insert(tl.win.end(), b.window.begin(), b.window.end());
          const int64_t keep = std::min<int64_t>(W, pos0 + rows - tl.win_first);
          tl.win.erase(tl.win.begin(), tl.win.end() - std::ptrdiff_t(size_t(keep) * wrb));
          tl.win_first = pos0 + rows - keep;
          tl.rings_done = std::move(tl.rings);
          tl.rings = Dsv4LayerBytes{};  // the rings only: the chunk's rows are in `win` or already sent
          tl.rings.ring_kv = b.ring_kv;
          tl.rings.ring_score = b.ring_score;
          tl.rings.lid_kv = b.lid_kv;
          tl.rings.lid_score = b.lid_score;
          KvBlock blk{layer, pos0, rows};
          const int64_t w0 = std::max(pos0, T - std::min(T, W)), wn = std::max<int64_t>(0, pos0 + rows - w0);
          if (wn > 0) blk.sections.push_back({K::Window, kt, w0, wn, b.window.data() + size_t(w0 - S.window_first) * wrb, size_t(wn) * wrb});
          const bool csa = S.ratio == 4;
          if (S.ratio) add(blk, csa ? K::Csa : K::Hca, kt, S.pool_first, b.pool, int64_t(S.pool.size()) / D, wrb);
          if (csa) add(blk, K::Lid, kt, S.lid_first, b.lid, int64_t(S.lid.size()) / c.index_dim, ggml_row_bytes(kt, c.index_dim));
          if (pos0 + rows == T && S.ratio) add_rings(blk, b, int(S.ratio));  // the prompt's last chunk: the state's rings
          if (!sink(blk)) { refused = true; return false; }
          if (layer == L - 1) sealable = pos0 + rows;
          return true;
        },
        stop);
    if (refused && sealable > 0 && sealable < T) {
      // Offer the seal: the rings a layer had after chunk `sealable` (layers that went on into the next chunk keep
      // them in rings_done) and the window rows before it. The sink takes them only when it stopped for a seal.
      for (int64_t l = 0; l < L; ++l) {
        Tail& tl = tail[size_t(l)];
        const bool moved_on = tl.win_first + int64_t(tl.win.size() / wrb) > sealable;
        const Dsv4LayerBytes& rings = moved_on ? tl.rings_done : tl.rings;
        const std::vector<uint8_t>& rows_before = moved_on ? tl.before : tl.win;
        const int64_t rows_first = moved_on ? tl.before_first : tl.win_first;
        const int64_t w = std::min(sealable, W), first = sealable - w;
        if (first < rows_first || rows_first + int64_t(rows_before.size() / wrb) != sealable)
          throw std::logic_error("DSV4 seal: the window rows before the seal were not kept");
        KvBlock blk{int(l), sealable, 0};
        blk.seal_tokens = sealable;
        blk.sections.push_back({K::Window, kt, first, w, rows_before.data() + size_t(first - rows_first) * wrb, size_t(w) * wrb});
        if (tl.ratio) add_rings(blk, rings, tl.ratio);
        if (!sink(blk)) break;
      }
    }
    return done;
  }

  int64_t forward_only(const std::vector<int32_t>& tokens, int64_t chunk, bool, bool skip_attention) override {
    if (skip_attention) throw std::invalid_argument("the CPU engine has no forward without attention (a GPU benchmark mode)");
    return run_(tokens, chunk, GgmlType::F16, [](int, const float*, int64_t, int64_t, const Deepseek4LayerSections&) { return true; }, {});
  }

 private:
  std::shared_ptr<const Deepseek4Recipe> recipe_;
  Dsv4EngineRun run_;
  std::string device_, weights_;
  RecipeInfo info_;
  HfConfig config_;
  int64_t preferred_chunk_;
};

}  // namespace

Deepseek4Weights dsv4_engine_weights(const std::string& weights) {
  return std::filesystem::is_directory(weights) ? Deepseek4Weights::from_checkpoint(Deepseek4Checkpoint::open(weights))
                                                : Deepseek4Weights::from_gguf(GgufFile::open(weights));
}

std::unique_ptr<PrefillBackend> make_dsv4_backend(std::shared_ptr<const Deepseek4Recipe> recipe, Dsv4EngineRun run, const std::string& device,
                                                  const std::string& weights_note, int64_t preferred_chunk) {
  return std::make_unique<Dsv4Backend>(std::move(recipe), std::move(run), device, weights_note, preferred_chunk);
}

std::unique_ptr<PrefillBackend> make_cpu_dsv4_backend(const std::string& decoder_gguf, const std::string& weights) {
  // The engine runs its own weights (an HF checkpoint, or a GGUF); the recipe the decoder's, and the engine
  // attends over the recipe's rows: what the decoder will hold.
  auto recipe = std::make_shared<const Deepseek4Recipe>(decoder_gguf);
  const Deepseek4Weights w = dsv4_engine_weights(weights);
  auto engine = std::make_shared<Deepseek4CpuEngine>(*recipe, &w);
  Dsv4EngineRun run = [engine, recipe](const std::vector<int32_t>& tokens, int64_t chunk, GgmlType kt, const Deepseek4CpuEngine::ChunkHook& hook,
                                       const std::function<bool()>& stop) { return engine->prefill(tokens, chunk, kt, hook, stop); };
  return make_dsv4_backend(recipe, std::move(run), "cpu", w.describe);
}

}  // namespace pdb
