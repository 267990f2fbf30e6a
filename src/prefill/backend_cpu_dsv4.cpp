// The prefill backend for DeepSeek-V4 on the CPU: the engine's chunks, each layer's sections from the recipe
// turned into the decoder's bytes for the wire (docs/WIRE.md, "Sections"): the window rows among the prompt's
// last W positions, the CSA / HCA / LID blocks finished in the chunk, and with the prompt's last chunk the
// compressors' f32 rings.
#include <filesystem>
#include <stdexcept>

#include "formats/gguf.h"
#include "formats/hf_deepseek4.h"
#include "model/cpu_engine_dsv4.h"
#include "prefill/backend.h"
#include "recipes/deepseek4.h"

namespace pdb {
namespace {

class CpuDsv4Backend final : public PrefillBackend {
 public:
  CpuDsv4Backend(const std::string& decoder_gguf, const std::string& weights)
      : recipe_(std::make_unique<Deepseek4Recipe>(decoder_gguf)), info_(read_recipe_info(recipe_->gguf())) {
    // The engine runs its own weights (an HF checkpoint, or a GGUF); the recipe the decoder's, and the engine
    // attends over the recipe's rows: what the decoder will hold.
    const Deepseek4Weights w = std::filesystem::is_directory(weights)
                                   ? Deepseek4Weights::from_checkpoint(Deepseek4Checkpoint::open(weights))
                                   : Deepseek4Weights::from_gguf(GgufFile::open(weights));
    weights_ = w.describe;
    engine_ = std::make_unique<Deepseek4CpuEngine>(*recipe_, &w);
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
  const Recipe& recipe() const override { throw std::logic_error("DeepSeek-V4's cache is pooled: no K/V recipe (recipes/deepseek4.h)"); }
  const RecipeInfo& info() const override { return info_; }
  std::string device() const override { return "cpu"; }
  std::string weights() const override { return weights_; }

  int64_t capture(const std::vector<int32_t>& tokens, int64_t chunk, const CacheSpec& spec, const KvSink& sink,
                  const std::function<bool()>& stop) override {
    const auto& c = recipe_->config();
    const int64_t T = int64_t(tokens.size()), D = c.head_dim, W = c.window;
    const GgmlType kt = spec.k_type;
    return engine_->prefill(
        tokens, chunk, kt,
        [&](int layer, const float*, int64_t pos0, int64_t rows, const Deepseek4LayerSections& all) {
          // the engine's sections hold every position's window row (it attends over them); the decoder keeps the last W
          const Deepseek4LayerSections* S = &all;
          const int64_t w0 = std::max(pos0, T - std::min(T, W)), wn = std::max<int64_t>(0, pos0 + rows - w0);
          Deepseek4LayerSections out;
          out.ratio = S->ratio;
          out.window.assign(S->window.begin() + (w0 - pos0) * D, S->window.begin() + (w0 - pos0 + wn) * D);
          out.pool = S->pool;
          out.lid = S->lid;
          out.ring_kv = S->ring_kv;
          out.ring_score = S->ring_score;
          out.lid_kv = S->lid_kv;
          out.lid_score = S->lid_score;
          const Dsv4LayerBytes b = recipe_->to_bytes(out, kt);
          KvBlock blk{layer, pos0, rows};
          auto add = [&](wire::FrameKind k, GgmlType t, int64_t first, const std::vector<uint8_t>& bytes, int64_t n_rows) {
            if (n_rows > 0) blk.sections.push_back({k, t, first, n_rows, bytes.data(), bytes.size()});
          };
          using K = wire::FrameKind;
          add(K::Window, kt, w0, b.window, wn);
          const bool csa = S->ratio == 4;
          if (S->ratio) add(csa ? K::Csa : K::Hca, kt, S->pool_first, b.pool, int64_t(S->pool.size()) / D);
          if (csa) add(K::Lid, kt, S->lid_first, b.lid, int64_t(S->lid.size()) / c.index_dim);
          if (!S->ring_kv.empty()) {  // the prompt's last chunk: the rings after its last token
            const int64_t ring = csa ? 8 : 128;
            add(csa ? K::CsaKvRing : K::HcaKvRing, GgmlType::F32, 0, b.ring_kv, ring);
            add(csa ? K::CsaScoreRing : K::HcaScoreRing, GgmlType::F32, 0, b.ring_score, ring);
            if (csa) {
              add(K::LidKvRing, GgmlType::F32, 0, b.lid_kv, 8);
              add(K::LidScoreRing, GgmlType::F32, 0, b.lid_score, 8);
            }
          }
          return sink(blk);
        },
        stop);
  }

  int64_t forward_only(const std::vector<int32_t>& tokens, int64_t chunk, bool, bool skip_attention) override {
    if (skip_attention) throw std::invalid_argument("the CPU engine has no forward without attention (a GPU benchmark mode)");
    return engine_->prefill(tokens, chunk, GgmlType::F16, [](int, const float*, int64_t, int64_t, const Deepseek4LayerSections&) { return true; });
  }

 private:
  std::unique_ptr<Deepseek4Recipe> recipe_;
  std::string weights_;
  RecipeInfo info_;
  std::unique_ptr<Deepseek4CpuEngine> engine_;
  HfConfig config_;
};

}  // namespace

std::unique_ptr<PrefillBackend> make_cpu_dsv4_backend(const std::string& decoder_gguf, const std::string& weights) {
  return std::make_unique<CpuDsv4Backend>(decoder_gguf, weights);
}

}  // namespace pdb
