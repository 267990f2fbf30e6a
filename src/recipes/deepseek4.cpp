#include "recipes/deepseek4.h"

#include "common/parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "formats/gguf.h"
#include "numerics/deepseek4_blocks.h"
#include "numerics/rmsnorm.h"
#include "formats/numeric.h"
#include "numerics/q8_dot.h"
#include "recipes/recipe.h"
#include "numerics/rope_ggml.h"

namespace pdb {

namespace {

// A projection as the decoder multiplies it: a Q8_0 weight (the converter's type for DeepSeek's block-FP8
// matrices) against the activation rounded to Q8_0, in integers per block (numerics/q8_dot.h: exact, whatever
// the ISA); a BF16 / F16 one against the activation rounded to that type; F32 as is.
struct Projection {
  GgmlType type = GgmlType::F32;
  int64_t in = 0, out = 0;
  std::vector<float> f;  // float weights: [out x in]
  Q8Matrix q;
  void load(const GgufFile& g, const std::string& name) {
    const auto& ti = g.tensor(name);
    type = ti.type;
    in = ti.ne[0];
    out = ti.n_elements() / in;
    if (has_q8_path(type)) q = unpack_q8_blocks(type, g.data(ti), out, in);
    else f = g.to_f32(ti);
  }
  // y[rows x out] = x[rows x in] W^T
  void apply(const float* x, int64_t rows, float* y) const {
    if (has_q8_path(type)) {
      std::vector<int8_t> qx(static_cast<size_t>(rows * in));
      std::vector<float> dx(static_cast<size_t>(rows * in / 32));
      quantize_rows_q8(x, rows, in, qx.data(), dx.data());
      q8_block_gemm(qx.data(), dx.data(), q, rows, y);
      return;
    }
    std::vector<float> xr(x, x + rows * in);
    if (type == GgmlType::BF16) for (auto& v : xr) v = round_bf16(v);
    if (type == GgmlType::F16) for (auto& v : xr) v = fp16_to_f32(f32_to_fp16(v));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        float s = 0.0f;
        const float* wr = f.data() + o * in;
        for (int64_t i = 0; i < in; ++i) s += wr[i] * xr[size_t(r * in + i)];
        y[r * out + o] = s;
      }
  }
};

}  // namespace

struct Deepseek4Recipe::Layer {
  int64_t ratio = 0;
  std::vector<float> attn_norm, hc_fn, hc_base, hc_scale, kv_norm;
  Projection wkv;
  Projection ckv, cgate;                       // compressor (ratio != 0)
  std::vector<float> cape, cnorm;
  Projection ikv, igate;                       // indexer compressor (ratio 4)
  std::vector<float> iape, inorm;
};

namespace {

uint32_t u32(const GgufFile& g, const std::string& k) { return uint32_t(g.get("deepseek4." + k).u); }
float f32(const GgufFile& g, const std::string& k) { return float(g.get("deepseek4." + k).f); }

int64_t rotation_size(int64_t n) {  // the largest power of two >= 64 dividing n (0: none)
  int64_t s = 0;
  for (int64_t p = 64; p <= n; p *= 2)
    if (n % p == 0) s = p;
  return s;
}

}  // namespace

Deepseek4Config deepseek4_config_from_gguf(const GgufFile& g) {
  if (g.get_string("general.architecture") != "deepseek4") throw std::runtime_error("not a deepseek4 GGUF");
  Deepseek4Config c_;
  c_.hidden = u32(g, "embedding_length");
  c_.layers = u32(g, "block_count");
  c_.heads = u32(g, "attention.head_count");
  c_.head_dim = u32(g, "attention.key_length");
  c_.rope_dims = u32(g, "rope.dimension_count");
  c_.q_lora = u32(g, "attention.q_lora_rank");
  c_.window = u32(g, "attention.sliding_window");
  c_.index_dim = u32(g, "attention.indexer.key_length");
  c_.index_heads = u32(g, "attention.indexer.head_count");
  c_.hc_streams = u32(g, "hyper_connection.count");
  c_.hc_eps = f32(g, "hyper_connection.epsilon");
  c_.hc_iterations = u32(g, "hyper_connection.sinkhorn_iterations");
  c_.out_groups = u32(g, "attention.output_group_count");
  c_.out_lora = u32(g, "attention.output_lora_rank");
  c_.index_top_k = u32(g, "attention.indexer.top_k");
  c_.experts = u32(g, "expert_count");
  c_.experts_used = u32(g, "expert_used_count");
  c_.shared_experts = u32(g, "expert_shared_count");
  c_.expert_ff = u32(g, "expert_feed_forward_length");
  c_.hash_layers = u32(g, "hash_layer_count");
  c_.swiglu_clamp = f32(g, "swiglu_clamp_exp");
  c_.expert_scale = f32(g, "expert_weights_scale");
  c_.rms_eps = f32(g, "attention.layer_norm_rms_epsilon");
  c_.rope_base = g.find("deepseek4.rope.freq_base") ? f32(g, "rope.freq_base") : 10000.0f;
  c_.compress_rope_base = f32(g, "attention.compress_rope_freq_base");
  if (g.find("deepseek4.rope.scaling.type")) {
    const std::string st = g.get_string("deepseek4.rope.scaling.type");
    if (st != "yarn" && st != "none") throw std::runtime_error("deepseek4 recipe: rope.scaling.type " + st + " (llama.cpp's deepseek4 scales with yarn only)");
    if (st == "yarn") {
      c_.yarn_factor = f32(g, "rope.scaling.factor");
      c_.yarn_orig_ctx = u32(g, "rope.scaling.original_context_length");
    }
  }
  for (const auto& v : g.get("deepseek4.attention.compress_ratios").arr) c_.compress_ratios.push_back(int32_t(v.u));
  c_.vocab = g.tensor("token_embd.weight").ne[1];
  return c_;
}

Deepseek4Recipe::Deepseek4Recipe(const std::string& path) : g_(GgufFile::open(path)) {
  const GgufFile& g = *g_;
  if (g.get_string("general.architecture") != "deepseek4") throw std::runtime_error(path + ": not a deepseek4 GGUF");
  c_ = deepseek4_config_from_gguf(g);
  if (c_.hc_streams != 4) throw std::runtime_error("deepseek4 recipe: hyper_connection.count must be 4");
  const int64_t E = c_.hidden, D = c_.head_dim, I = c_.index_dim;
  // any weight type the converter writes (F32, BF16, Q8_0): the recipe multiplies their values in f32, where the
  // decoder rounds its activations to the weight's dot type first (tolerance class)
  embed_ = g.to_f32(g.tensor("token_embd.weight"));
  c_.vocab = int64_t(embed_.size()) / E;
  auto t = [&](const std::string& n) { return g.to_f32(g.tensor(n)); };
  for (int64_t l = 0; l < c_.layers; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    auto L = std::make_unique<Layer>();
    L->ratio = c_.compress_ratios.at(size_t(l));
    L->attn_norm = t(p + "attn_norm.weight");
    L->hc_fn = t(p + "hc_attn_fn.weight");
    L->hc_base = t(p + "hc_attn_base.weight");
    L->hc_scale = t(p + "hc_attn_scale.weight");
    L->wkv.load(g, p + "attn_kv.weight");
    L->kv_norm = t(p + "attn_kv_a_norm.weight");
    if (L->ratio) {
      L->ckv.load(g, p + "attn_compressor_kv.weight");
      L->cgate.load(g, p + "attn_compressor_gate.weight");
      L->cape = t(p + "attn_compressor_ape.weight");
      L->cnorm = t(p + "attn_compressor_norm.weight");
    }
    if (L->ratio == 4) {
      L->ikv.load(g, p + "indexer_compressor_kv.weight");
      L->igate.load(g, p + "indexer_compressor_gate.weight");
      L->iape = t(p + "indexer_compressor_ape.weight");
      L->inorm = t(p + "indexer_compressor_norm.weight");
    }
    if (L->wkv.in != E || L->wkv.out != D || (L->ratio == 4 && (L->ikv.in != E || L->ikv.out != 2 * I)))
      throw std::runtime_error(p + ": unexpected deepseek4 tensor shapes");
    layers_.push_back(std::move(L));
  }
}

Deepseek4Recipe::~Deepseek4Recipe() = default;

std::vector<float> Deepseek4Recipe::layer0_input(const std::vector<int32_t>& tokens) const {
  const int64_t E = c_.hidden;
  std::vector<float> x(tokens.size() * size_t(4 * E));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= c_.vocab) throw std::invalid_argument(fmt::format("token {} outside the vocabulary", tokens[i]));
    for (int h = 0; h < 4; ++h) std::copy_n(embed_.data() + int64_t(tokens[i]) * E, E, x.data() + (i * 4 + size_t(h)) * size_t(E));
  }
  return x;
}

Deepseek4LayerSections Deepseek4Recipe::sections(int layer, const float* x, int64_t T, GgmlType k_type, bool all_raw_rows,
                                                 std::vector<float>* cur_out) const {
  Deepseek4Carry carry;
  return sections_chunk(layer, x, 0, T, T, k_type, carry, all_raw_rows, cur_out);
}

Deepseek4LayerSections Deepseek4Recipe::sections_chunk(int layer, const float* x, int64_t pos0, int64_t rows, int64_t T, GgmlType k_type,
                                                       Deepseek4Carry& carry, bool all_raw_rows, std::vector<float>* cur_out) const {
  const Layer& L = *layers_.at(size_t(layer));
  const int64_t E = c_.hidden, D = c_.head_dim, I = c_.index_dim, r = c_.rope_dims, W = c_.window;
  if (pos0 < 0 || rows < 0 || pos0 + rows > T) throw std::invalid_argument("deepseek4 recipe: chunk outside the prompt");
  const float eps = c_.rms_eps;
  const bool rotate = k_type != GgmlType::F32 && k_type != GgmlType::F16 && k_type != GgmlType::BF16;  // quantized caches are Hadamard-rotated
  const GgmlRopeParams rp = dsv4_rope(c_, L.ratio);
  auto rope_at = [&](float* row, int64_t width, int64_t pos) {
    std::vector<float> cs(static_cast<size_t>(r));
    ggml_rope_cache(rp, pos, cs.data());
    ggml_rope_apply(rp, cs.data(), row + (width - r));
  };
  // cur = rms_norm(sum_h pre[h] x_h) * attn_norm (the hyper-connection pre-mix, numerics/deepseek4_blocks.h)
  std::vector<float> cur(static_cast<size_t>(rows * E));
  {
    std::vector<float> pre_mix(static_cast<size_t>(E));
    const Dsv4HcWeights hw{&L.hc_fn, &L.hc_base, &L.hc_scale};
    for (int64_t t = 0; t < rows; ++t) {
      dsv4_hc_pre(hw, x + t * 4 * E, E, eps, c_.hc_eps, int(c_.hc_iterations), pre_mix.data());
      rmsnorm_rows(pre_mix.data(), L.attn_norm.data(), cur.data() + t * E, 1, E, eps);
    }
  }
  if (cur_out) *cur_out = cur;
  Deepseek4LayerSections out;
  out.ratio = L.ratio;
  // the window: this chunk's positions among the last min(T, W) (every position for the engine)
  const int64_t w0 = all_raw_rows ? pos0 : std::max(pos0, T - std::min(T, W)), wn = pos0 + rows - w0;
  out.window_first = w0;
  out.window.resize(size_t(std::max<int64_t>(wn, 0) * D));
  if (wn > 0) L.wkv.apply(cur.data() + (w0 - pos0) * E, wn, out.window.data());
  for (int64_t i = 0; i < wn; ++i) {
    float* row = out.window.data() + i * D;
    rmsnorm_rows(row, L.kv_norm.data(), row, 1, D, eps);
    rope_at(row, D, w0 + i);
  }
  if (rotate && rotation_size(D) && !out.window.empty()) hadamard_rows(out.window.data(), int64_t(out.window.size()), rotation_size(D));
  if (!L.ratio) return out;
  if (carry.pool.size() < layers_.size()) carry.pool.resize(layers_.size()), carry.lid.resize(layers_.size());
  // the compressors: a_t, g_t (+ ape row t mod ratio) of this chunk after the carried ones; the blocks that
  // finish in this chunk pool 128 tokens or 8 overlapping ones; the rings after the prompt's last token
  auto compress = [&](const Projection& wkv, const Projection& wgate, const std::vector<float>& ape,
                      const std::vector<float>& norm, int64_t width, int64_t ratio, bool hadamard, Deepseek4Carry::History& hist,
                      std::vector<float>& pooled, int64_t& first_block, std::vector<float>& ring_kv, std::vector<float>& ring_score) {
    const int64_t c = ratio == 4 ? 2 : 1, cw = c * width, ring = ratio == 4 ? 8 : 128;
    if (hist.first + int64_t(hist.a.size()) / std::max<int64_t>(cw, 1) != pos0 && !(hist.a.empty() && pos0 == 0))
      throw std::invalid_argument("deepseek4 recipe: chunks must come in position order, each layer's after its previous one");
    const int64_t h0 = hist.a.empty() ? pos0 : hist.first;
    std::vector<float> a = hist.a, g = hist.g;
    a.resize(size_t((pos0 + rows - h0) * cw));
    g.resize(a.size());
    float* ac = a.data() + (pos0 - h0) * cw;
    float* gc = g.data() + (pos0 - h0) * cw;
    if (wkv.out != cw || wgate.out != cw) throw std::runtime_error("deepseek4 recipe: compressor width");
    wkv.apply(cur.data(), rows, ac);
    wgate.apply(cur.data(), rows, gc);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < cw; ++j) gc[t * cw + j] += ape[size_t(((pos0 + t) % ratio) * cw + j)];
    auto at = [&](int64_t t, int64_t j) { return std::pair<float, float>{a[size_t((t - h0) * cw + j)], g[size_t((t - h0) * cw + j)]}; };
    first_block = pos0 / ratio;
    pooled.clear();
    for (int64_t b = first_block; ratio * b + ratio - 1 < pos0 + rows; ++b) {
      if (ratio * b + ratio - 1 < pos0) { ++first_block; continue; }
      std::vector<float> row(static_cast<size_t>(width));
      for (int64_t d = 0; d < width; ++d) {
        // (value, score) entries: ratio 128: the block's tokens; ratio 4: the previous block's low halves, then this one's high halves
        std::vector<std::pair<float, float>> e;
        if (ratio == 128) {
          for (int64_t j = 0; j < 128; ++j) e.push_back(at(128 * b + j, d));
        } else {
          for (int64_t j = 0; j < 4; ++j) {
            const int64_t tp = 4 * b - 4 + j;
            e.push_back(tp < 0 ? std::pair<float, float>{0.0f, -INFINITY} : at(tp, d));
          }
          for (int64_t j = 0; j < 4; ++j) e.push_back(at(4 * b + j, width + d));
        }
        float mx = -INFINITY;
        for (const auto& [v, sc] : e) mx = std::max(mx, sc);
        float sum = 0.0f, acc = 0.0f;
        for (const auto& [v, sc] : e) sum += std::exp(sc - mx);
        for (const auto& [v, sc] : e) acc += v * (std::exp(sc - mx) / sum);
        row[size_t(d)] = acc;
      }
      rmsnorm_rows(row.data(), norm.data(), row.data(), 1, width, eps);
      rope_at(row.data(), width, ratio * b);
      pooled.insert(pooled.end(), row.begin(), row.end());
    }
    if (hadamard && rotation_size(width) && !pooled.empty()) hadamard_rows(pooled.data(), int64_t(pooled.size()), rotation_size(width));
    {  // the rings after this chunk's last token (the state's at the prompt's end; a sealed prefix's at a chunk's)
      const int64_t end = pos0 + rows;
      ring_kv.assign(size_t(ring * cw), 0.0f);
      ring_score.assign(size_t(ring * cw), 0.0f);
      for (int64_t t = std::max<int64_t>(h0, end - ring); t < end; ++t) {
        std::copy_n(a.data() + (t - h0) * cw, cw, ring_kv.data() + (t % ring) * cw);
        std::copy_n(g.data() + (t - h0) * cw, cw, ring_score.data() + (t % ring) * cw);
      }
    }
    // keep the last `ring` tokens: all that the next chunk's blocks and the rings can need
    const int64_t keep_from = std::max(h0, pos0 + rows - ring);
    hist.first = keep_from;
    hist.a.assign(a.begin() + (keep_from - h0) * cw, a.end());
    hist.g.assign(g.begin() + (keep_from - h0) * cw, g.end());
  };
  compress(L.ckv, L.cgate, L.cape, L.cnorm, D, L.ratio, rotate, carry.pool[size_t(layer)], out.pool, out.pool_first, out.ring_kv, out.ring_score);
  if (L.ratio == 4)
    compress(L.ikv, L.igate, L.iape, L.inorm, I, 4, true, carry.lid[size_t(layer)], out.lid, out.lid_first, out.lid_kv, out.lid_score);
  return out;
}

Dsv4LayerBytes Deepseek4Recipe::to_bytes(const Deepseek4LayerSections& s, GgmlType k_type) const {
  auto rows = [&](const std::vector<float>& v, int64_t width) {
    std::vector<uint8_t> out;
    if (v.empty()) return out;
    const int64_t n = int64_t(v.size()) / width;
    const size_t rb = ggml_row_bytes(k_type, width);
    out.resize(rb * size_t(n));
    // in slices of >= 512 rows on the host's cores: a 32K-token chunk's CSA pool is 8,192 rows, and the GPU engine
    // hands its sections over while its attention runs
    const int threads = int(std::clamp<int64_t>(n / 512, 1, default_threads()));
    parallel_for(n, threads, [&](int64_t b, int64_t e) { rows_to_cache_type(k_type, v.data() + b * width, e - b, width, out.data() + size_t(b) * rb); });
    return out;
  };
  auto f32 = [](const std::vector<float>& v) {
    std::vector<uint8_t> out(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  };
  Dsv4LayerBytes b;
  b.window = rows(s.window, c_.head_dim);
  b.pool = rows(s.pool, c_.head_dim);
  b.lid = rows(s.lid, c_.index_dim);
  b.ring_kv = f32(s.ring_kv);
  b.ring_score = f32(s.ring_score);
  b.lid_kv = f32(s.lid_kv);
  b.lid_score = f32(s.lid_score);
  return b;
}

}  // namespace pdb
