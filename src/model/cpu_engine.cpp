#include "model/cpu_engine.h"

#include <cblas.h>

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "formats/numeric.h"
#include "formats/weight_source.h"
#include "numerics/rmsnorm.h"

namespace pdb {

OpenedModel open_model(const std::string& model) {
  OpenedModel m;
  if (is_gguf_path(model)) {
    auto g = gguf_weights(model);
    m.config = g.config;
    m.weights = std::move(g.weights);
  } else {
    m.config = HfConfig::load(model);
    m.weights = checkpoint_weights(model, m.config);
  }
  return m;
}

CpuEngine::CpuEngine(const std::string& model, int threads) : CpuEngine(open_model(model), threads) {}

CpuEngine::CpuEngine(OpenedModel m, int threads) : cfg_(std::move(m.config)), def_(model_definition(cfg_.arch)), threads_(threads) {
  openblas_set_num_threads(threads);
  const WeightSource& ws = *m.weights;
  weights_note_ = ws.describe();
  const auto& c = cfg_;
  const int64_t H = c.hidden_size;
  embed_ = ws.matrix("model.embed_tokens.weight", c.vocab_size, H);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    Layer L;
    L.in_norm = ws.vector(p + "input_layernorm.weight", H);
    L.post_norm = ws.vector(p + "post_attention_layernorm.weight", H);
    L.attention = load_cpu_attention(def_, ws, c, l);
    L.ffn = load_cpu_ffn(def_, ws, c, l);
    faithful_ok_ = faithful_ok_ && L.attention->rope_mirrored();
    layers_.push_back(std::move(L));
  }
  if (def_.mirrors_half_precision && !layers_.empty()) act_precision_ = layers_[0].attention->weight_bits();
}

CpuEngine::~CpuEngine() = default;

void CpuEngine::check_tokens(const std::vector<int32_t>& tokens) const {
  for (int32_t t : tokens)
    if (t < 0 || t >= cfg_.vocab_size) throw std::invalid_argument(fmt::format("token id {} outside the vocabulary ({})", t, cfg_.vocab_size));
}

void CpuEngine::embed_chunk(const std::vector<int32_t>& tokens, int64_t p0, int64_t n, std::vector<float>& h) const {
  const int64_t H = cfg_.hidden_size;
  h.resize(size_t(n * H));
  for (int64_t r = 0; r < n; ++r) std::copy_n(embed_.data() + int64_t(tokens[size_t(p0 + r)]) * H, H, h.data() + r * H);
}

void CpuEngine::set_activation_precision(int bits) {
  if (def_.mirrors_half_precision) act_precision_ = bits;
}

void CpuEngine::round_weights_to(int bits) {
  if (bits != 16 && bits != 17) throw std::invalid_argument("round_weights_to: 16 (f16) or 17 (bf16)");
  if (!def_.mirrors_half_precision) return;  // the forward multiplies the checkpoint's own values (its arithmetic is not mirrored yet)
  const WeightRounding round = [&](std::vector<float>& w) {
    parallel_for(int64_t(w.size()), threads_, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) w[size_t(i)] = bits == 16 ? round_f16(w[size_t(i)]) : round_bf16(w[size_t(i)]);
    });
  };
  round(embed_);
  for (auto& L : layers_) {
    L.attention->round_weights(round);
    L.ffn->round_weights(round);
  }
}

CpuPass CpuEngine::pass(int lanes, const KvRounding& kv_round, const DecoderCacheSpec& cache, CpuScratch& scratch) const {
  CpuPass p;
  if (lanes && cfg_.hidden_size % lanes) lanes = 0;
  for (const auto& L : layers_)
    if (lanes && (!L.attention->accepts_lanes(lanes) || !L.ffn->accepts_lanes(lanes))) lanes = 0;
  p.lanes = lanes;
  p.faithful = lanes && faithful_ok_;
  p.act_precision = act_precision_;
  p.quantize_activations = quantize_activations_;
  p.threads = threads_;
  p.kv_round = kv_round;
  p.cache = cache;
  p.scratch = &scratch;
  return p;
}

// Every layer's cache for T positions, the first resume.tokens of them from a state this engine kept.
std::vector<CpuLayerCache> CpuEngine::prompt_caches(int64_t T, const CpuPass& p, ResumePoint resume) const {
  const CpuCacheRows rows = layers_.empty() ? CpuCacheRows{} : layers_[0].attention->cache_rows(p);
  std::vector<CpuLayerCache> caches(layers_.size());
  for (auto& lc : caches) {
    lc.k.resize(size_t(T * rows.k));
    lc.v.resize(size_t(T * rows.v));
    lc.kq8.resize(size_t(T) * rows.q8);
  }
  const int64_t start = resume.tokens;
  if (start <= 0) return caches;
  const auto* st = dynamic_cast<const CpuEngineState*>(resume.state);
  if (!st || st->rows.k != rows.k || st->rows.v != rows.v || st->rows.q8 != rows.q8 || st->layers.size() != caches.size() ||
      st->tokens < start || start > T)
    throw std::invalid_argument("the resume state is not this engine's for this cache spec");
  for (size_t l = 0; l < caches.size(); ++l) {
    std::copy_n(st->layers[l].k.begin(), start * rows.k, caches[l].k.begin());
    std::copy_n(st->layers[l].v.begin(), start * rows.v, caches[l].v.begin());
    std::copy_n(st->layers[l].kq8.begin(), size_t(start) * rows.q8, caches[l].kq8.begin());
  }
  return caches;
}

int64_t CpuEngine::prefill(const std::vector<int32_t>& tokens, int64_t chunk, int lanes, const LayerHook& hook,
                           const std::function<bool()>& cancelled, const KvRounding& kv_round, const DecoderCacheSpec& cache,
                           ResumePoint resume, std::shared_ptr<EngineState>* keep) {
  if (!def_.resumable && (resume.tokens > 0 || keep))
    throw std::invalid_argument(fmt::format("the {} forward does not resume from a prefix state", def_.name));
  const int64_t T = int64_t(tokens.size()), H = cfg_.hidden_size;
  const float eps = float(cfg_.rms_norm_eps);
  if (chunk <= 0) chunk = 512;
  check_tokens(tokens);
  CpuScratch scratch;
  const CpuPass p = pass(lanes, kv_round, cache, scratch);
  std::vector<CpuLayerCache> caches = prompt_caches(T, p, resume);
  // The state of the positions processed so far, handed over however the forward ends.
  int64_t processed = resume.tokens;
  struct Keep {
    std::shared_ptr<EngineState>* out;
    std::function<void()> f;
    ~Keep() { if (out) f(); }
  } keep_on_exit{keep, [&] {
    auto st = std::make_shared<CpuEngineState>();
    st->tokens = processed;
    st->rows = layers_.empty() ? CpuCacheRows{} : layers_[0].attention->cache_rows(p);
    st->layers = std::move(caches);
    for (auto& lc : st->layers) {
      lc.k.resize(size_t(processed * st->rows.k));
      lc.v.resize(size_t(processed * st->rows.v));
      lc.kq8.resize(size_t(processed) * st->rows.q8);
      if (processed < T) { lc.k.shrink_to_fit(); lc.v.shrink_to_fit(); lc.kq8.shrink_to_fit(); }
    }
    *keep = std::move(st);
  }};
  std::vector<float> h, x(size_t(std::min(chunk, T) * H)), o;
  for (int64_t p0 = resume.tokens; p0 < T; p0 += chunk) {
    const int64_t n = std::min(chunk, T - p0);
    embed_chunk(tokens, p0, n, h);
    x.resize(size_t(n * H));
    o.resize(size_t(n * H));
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (cancelled && cancelled()) return p0;
      const Layer& L = layers_[l];
      hook(int(l), h.data(), n, p0);
      rmsnorm_rows(h.data(), L.in_norm.data(), x.data(), n, H, eps);
      L.attention->forward(x.data(), n, p0, p, caches[l], o.data());
      for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
      rmsnorm_rows(h.data(), L.post_norm.data(), x.data(), n, H, eps);
      L.ffn->forward(x.data(), n, p, o.data());
      for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
    }
    processed = p0 + n;
  }
  return T;
}

}  // namespace pdb
