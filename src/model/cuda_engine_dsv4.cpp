#include "model/cuda_engine_dsv4.h"
#include "model/cuda_engine_dsv4_run.h"
#include "common/tuning.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <cmath>
#include <random>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "cuda/common.cuh"
#include "cuda/dsv4.cuh"
#include "cuda/dsv4_attention.cuh"
#include "cuda/dsv4_indexer.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/fp8.cuh"
#include "cuda/gemm.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/moe.cuh"
#include "cuda/moe_fp4_gemm.cuh"
#include "cuda/q8_gemm.cuh"
#include "cuda/rmsnorm.cuh"
#include "formats/gguf.h"
#include "formats/numeric.h"
#include "model/cuda_engine_load.h"
#include "model/dsv4_chunk.h"
#include "numerics/deepseek4_blocks.h"
#include "recipes/deepseek4.h"
#include "numerics/q8_dot.h"
#include "recipes/recipe.h"
#include "numerics/rope_ggml.h"

namespace pdb {

void check_dsv4_cublas(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(fmt::format("cuBLAS {} failed (status {})", what, int(st)));
}

namespace {

using cuda_load::upload_f32;
DeviceBuffer upload_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  DeviceBuffer b(std::max<size_t>(h.size(), 1) * 2);
  if (!h.empty()) b.upload(h.data(), h.size() * 2);
  return b;
}

}  // namespace

const char* Deepseek4CudaEngine::Profile::phase_name(int p) {
  static const char* names[] = {"sections", "query", "indexer", "attention", "output", "moe", "hook", "moe_fp4_expand", "moe_routed_products",
                                "sections_mix", "sections_window", "sections_pool", "sections_lid", "indexer_topk", "moe_route", "moe_expand_wait",
                                "moe_shared_combine"};
  return p >= 0 && p < kPhases ? names[p] : "?";
}


namespace {

// Every routed expert of layer L, FP4 -> bf16 into the scratch, in three launches on `st` (gate and up into the
// two halves of each expert's fused 2F rows).
void expand_all_experts(Deepseek4CudaEngine::Impl& I, const Deepseek4CudaEngine::Impl::Layer& L, cudaStream_t st) {
  const int64_t E = I.c.hidden, F = I.c.expert_ff, NE = I.c.experts, blocks_fe = F * E / 32, per = NE * blocks_fe;
  cuda::mxfp4_to_bf16(L.gate_fp4.as<uint8_t>(), per, I.exp_gu_scratch.as<__nv_bfloat16>(), st, blocks_fe, 2 * F * E);
  cuda::mxfp4_to_bf16(L.up_fp4.as<uint8_t>(), per, I.exp_gu_scratch.as<__nv_bfloat16>() + F * E, st, blocks_fe, 2 * F * E);
  cuda::mxfp4_to_bf16(L.down_fp4.as<uint8_t>(), per, I.exp_down_scratch.as<__nv_bfloat16>(), st);
}

// The layer's experts as FP8 tiles into gu8 / down8 (gate and up into the halves of each expert's 2F rows).
void expand_all_experts_fp8(Deepseek4CudaEngine::Impl& I, const Deepseek4CudaEngine::Impl::Layer& L, cudaStream_t st) {
  const int64_t E = I.c.hidden, F = I.c.expert_ff, NE = I.c.experts;
  const cuda::Fp8ScaleLayout& fl = *I.fp8;
  const int64_t gu_n = 2 * F / 128, gu_k = E / 128, dn_n = E / 128, dn_k = F / 128;
  unsigned* lost = I.inexact.as<unsigned>();
  const int64_t gu_ld = fl.weight_ld(gu_n, gu_k), gu_ss = fl.weight_scale_count(gu_n, gu_k);
  cuda::mxfp4_to_fp8_tiles({L.gate_fp4.as<uint8_t>(), NE, F, E, I.gu8.as<uint8_t>(), 2 * F * E, 0, I.gu8_s.as<float>(), gu_ss, gu_ld, fl.weight_kb_fastest, lost}, st);
  cuda::mxfp4_to_fp8_tiles({L.up_fp4.as<uint8_t>(), NE, F, E, I.gu8.as<uint8_t>(), 2 * F * E, F, I.gu8_s.as<float>(), gu_ss, gu_ld, fl.weight_kb_fastest, lost}, st);
  cuda::mxfp4_to_fp8_tiles({L.down_fp4.as<uint8_t>(), NE, E, F, I.down8.as<uint8_t>(), E * F, 0, I.down8_s.as<float>(), fl.weight_scale_count(dn_n, dn_k),
                            fl.weight_ld(dn_n, dn_k), fl.weight_kb_fastest, lost}, st);
}


}  // namespace

// The routed experts' products read the MXFP4 codes (cuda/moe_fp4_gemm.cuh) where the GPU and the widths take them:
// 1.1-1.2x the expansion + cuBLAS at V4-Flash's shapes, and no 12.9 GB bf16 scratch (docs/RESULTS.md, session 36).
// Each layer's blocks are taken apart once, here, and freed. PDBRIDGE_DSV4_EXPERTS_FP4=0 (or the FP8 experts'
// switch) keeps the expansion path.
void take_fp4_experts_apart(Deepseek4CudaEngine::Impl& I) {
  const int64_t E = I.c.hidden, F = I.c.expert_ff, NE = I.c.experts;
  const Tuning tuning = Tuning::from_env();
  if (!I.fp4 || tuning.dsv4_experts_fp4 == "0" || tuning.dsv4_experts_fp8 == "1" || !cuda::moe_fp4_products_supported(E, 2 * F) ||
      !cuda::moe_fp4_products_supported(F, E))
    return;
  for (const auto& L : I.layers)
    if (L.exp_gu.bytes()) return;  // a layer's experts are not FP4: every layer keeps the expansion path
  I.fp4_fused = tuning.dsv4_fp4_fuse != "0";
  I.fp4_shape = cuda::fp4_shape(tuning);
  for (auto& L : I.layers) {
    L.gu4_codes.resize(size_t(NE * 2 * F * E / 2));
    L.gu4_scales.resize(size_t(NE * 2 * F * E / 32));
    L.down4_codes.resize(size_t(NE * E * F / 2));
    L.down4_scales.resize(size_t(NE * E * F / 32));
    cuda::Fp4Matrices gu{L.gu4_codes.as<uint8_t>(), L.gu4_scales.as<uint8_t>(), NE, 2 * F, E};
    gu.gate_up_pairs = I.fp4_fused;
    const cuda::Fp4Matrices dn{L.down4_codes.as<uint8_t>(), L.down4_scales.as<uint8_t>(), NE, E, F};
    const bool wide_gu = cuda::repack_mxfp4(L.gate_fp4.as<uint8_t>(), F, 0, gu, I.s) | cuda::repack_mxfp4(L.up_fp4.as<uint8_t>(), F, F, gu, I.s);
    L.gu4_wide = wide_gu;
    L.down4_wide = cuda::repack_mxfp4(L.down_fp4.as<uint8_t>(), E, 0, dn, I.s);
    PDB_CUDA_CHECK(cudaStreamSynchronize(I.s));
    L.gate_fp4.release();
    L.up_fp4.release();
    L.down_fp4.release();
  }
  I.fp4_products = true;
}

std::string Deepseek4CudaEngine::experts_note() const {
  const Impl& I = *impl_;
  if (!I.fp4) return "routed experts bf16 in memory: bf16 products";
  if (I.fp4_products) return "FP4 routed experts: bf16 products that read the MXFP4 codes (no expansion; PDBRIDGE_DSV4_EXPERTS_FP4=0 expands them)";
  if (!I.fp8_probed) return "FP4 routed experts: bf16 products (FP8 products are PDBRIDGE_DSV4_EXPERTS_FP8=1, for widths that are multiples of 128)";
  if (!I.fp8) return "FP4 routed experts: bf16 products (" + I.fp8_note + ")";
  int64_t fit = 0, fp4_layers = 0;
  for (const auto& L : I.layers) {
    fp4_layers += L.exp_gu.bytes() == 0;
    fit += L.fp8_fit == 1;
  }
  return fmt::format("FP4 routed experts as FP8 products (e4m3 tiles of 128 x 128, token rows in 1 x 128 blocks) in {} of {} FP4 layers "
                     "(the others' tiles would round), chunks of >= 8 x experts / k rows; {}", fit, fp4_layers, I.fp8_note);
}

Deepseek4CudaEngine::Deepseek4CudaEngine(const Deepseek4Config& c) : c_(c), impl_(std::make_unique<Impl>()) { impl_->c = c; }

Deepseek4CudaEngine::~Deepseek4CudaEngine() = default;

namespace {

// One layer's tensors from the decoder's GGUF (the sections' weights) and the engine's weights (W), uploaded as the
// engine keeps them; every upload counted in `bytes`.
struct GgufLayerLoader {
  const GgufFile& g;
  const Deepseek4Weights& W;
  const Deepseek4Config& c;
  size_t& bytes;

  DeviceBuffer decoder_f32(const std::string& n) const { return upload_f32(g.to_f32(g.tensor(n))); }
  DeviceBuffer f32(const std::string& n) const { return upload_f32(W.f32(n)); }
  DeviceBuffer bf16(const std::string& n) const {
    auto b = upload_bf16(W.f32(n));
    bytes += b.bytes();
    return b;
  }
  // Q8_0-family weights stay integer blocks (their products run in integers, as the decoder's do); others as f32.
  SectionProjection section(const std::string& n) const {
    SectionProjection P;
    const auto& ti = g.tensor(n);
    P.in = ti.ne[0];
    P.out = ti.n_elements() / P.in;
    if (has_q8_path(ti.type) && P.in % 128 == 0) {
      const Q8Matrix q = unpack_q8_blocks(ti.type, g.data(ti), P.out, P.in);
      P.q8 = true;
      P.w.resize(q.q.size());
      P.w.upload(q.q.data(), q.q.size());
      P.d = upload_f32(q.d);
    } else {
      P.w = upload_f32(g.to_f32(ti));
    }
    bytes += P.w.bytes() + P.d.bytes();
    return P;
  }

  // What the cached rows are computed from: the decoder's own weights.
  void sections(Deepseek4CudaEngine::Impl::Layer& L, const std::string& p) const {
    L.r_hc_fn = decoder_f32(p + "hc_attn_fn.weight");
    L.r_hc_base = decoder_f32(p + "hc_attn_base.weight");
    L.r_hc_scale = decoder_f32(p + "hc_attn_scale.weight");
    L.attn_norm = decoder_f32(p + "attn_norm.weight");
    L.kv_norm = decoder_f32(p + "attn_kv_a_norm.weight");
    L.wkv = section(p + "attn_kv.weight");
    if (L.ratio) {
      L.ckv = section(p + "attn_compressor_kv.weight");
      L.cgate = section(p + "attn_compressor_gate.weight");
      L.cape = decoder_f32(p + "attn_compressor_ape.weight");
      L.cnorm = decoder_f32(p + "attn_compressor_norm.weight");
    }
    if (L.ratio == 4) {
      L.ikv = section(p + "indexer_compressor_kv.weight");
      L.igate = section(p + "indexer_compressor_gate.weight");
      L.iape = decoder_f32(p + "indexer_compressor_ape.weight");
      L.inorm = decoder_f32(p + "indexer_compressor_norm.weight");
    }
  }

  // The engine's layer: hyper-connections, the indexer's query, attention, the router and the shared expert.
  void engine(Deepseek4CudaEngine::Impl::Layer& L, const std::string& p, bool hash_layer) const {
    if (L.ratio == 4) {
      L.idx_q_b = bf16(p + "indexer.attn_q_b.weight");
      L.idx_proj = bf16(p + "indexer.proj.weight");
    }
    L.hc_attn_fn = f32(p + "hc_attn_fn.weight");
    L.hc_attn_base = f32(p + "hc_attn_base.weight");
    L.hc_attn_scale = f32(p + "hc_attn_scale.weight");
    L.hc_ffn_fn = f32(p + "hc_ffn_fn.weight");
    Deepseek4CudaEngine::Impl::stack_attn_hc(L);
    L.hc_ffn_base = f32(p + "hc_ffn_base.weight");
    L.hc_ffn_scale = f32(p + "hc_ffn_scale.weight");
    L.q_a_norm = f32(p + "attn_q_a_norm.weight");
    L.sinks = f32(p + "attn_sinks.weight");
    L.ffn_norm = f32(p + "ffn_norm.weight");
    L.router = f32(p + "ffn_gate_inp.weight");
    L.wq_a = bf16(p + "attn_q_a.weight");
    L.wq_b = bf16(p + "attn_q_b.weight");
    L.wo_a = bf16(p + "attn_output_a.weight");
    L.wo_b = bf16(p + "attn_output_b.weight");
    if (hash_layer) {
      const auto ids = W.i32(p + "ffn_gate_tid2eid.weight");
      if (int64_t(ids.size()) != c.experts_used * c.vocab) throw std::runtime_error(p + "ffn_gate_tid2eid: not k ids per token");
      L.tid2eid.resize(ids.size() * 4);
      L.tid2eid.upload(ids.data(), ids.size() * 4);
      L.hash = true;
    } else {
      L.probs_bias = f32(p + "exp_probs_b.bias");
    }
    auto gs = W.f32(p + "ffn_gate_shexp.weight"), us = W.f32(p + "ffn_up_shexp.weight");  // gate rows, then up rows
    gs.insert(gs.end(), us.begin(), us.end());
    L.sh_gu = upload_bf16(gs);
    L.sh_down = bf16(p + "ffn_down_shexp.weight");
    bytes += L.sh_gu.bytes();
  }

  // The routed experts: their MXFP4 blocks as stored where the weights have them (true), else bf16 with gate and up
  // fused into 2F rows per expert.
  bool experts(Deepseek4CudaEngine::Impl::Layer& L, const std::string& p) const {
    const int64_t E = c.hidden, NE = c.experts, F = c.expert_ff;
    std::vector<uint8_t> gb, ub, db;
    if (W.mxfp4 && W.mxfp4(p + "ffn_gate_exps.weight", gb) && W.mxfp4(p + "ffn_up_exps.weight", ub) && W.mxfp4(p + "ffn_down_exps.weight", db)) {
      auto put = [&](DeviceBuffer& b, const std::vector<uint8_t>& v) {
        b.resize(v.size());
        b.upload(v.data(), v.size());
        bytes += v.size();
      };
      put(L.gate_fp4, gb);
      put(L.up_fp4, ub);
      put(L.down_fp4, db);
      return true;
    }
    const auto ge = W.f32(p + "ffn_gate_exps.weight"), ue = W.f32(p + "ffn_up_exps.weight");
    std::vector<float> gu(size_t(NE * 2 * F * E));
    for (int64_t e = 0; e < NE; ++e) {
      std::copy_n(ge.data() + e * F * E, F * E, gu.data() + e * 2 * F * E);
      std::copy_n(ue.data() + e * F * E, F * E, gu.data() + e * 2 * F * E + F * E);
    }
    L.exp_gu = upload_bf16(gu);
    L.exp_down = bf16(p + "ffn_down_exps.weight");
    bytes += L.exp_gu.bytes();
    return false;
  }
};

}  // namespace

Deepseek4CudaEngine::Deepseek4CudaEngine(const Deepseek4Recipe& recipe, const Deepseek4Weights& W) : Deepseek4CudaEngine(recipe.config()) {
  const GgufFile& g = recipe.gguf();
  const GgufLayerLoader load{g, W, c_, weight_bytes_};
  impl_->embed = upload_f32(g.to_f32(g.tensor("token_embd.weight")));  // the decoder's embedding: what its layer 0 sees
  bool any_fp4 = false;
  for (int64_t l = 0; l < c_.layers; ++l) {
    const std::string p = fmt::format("blk.{}.", l);
    Impl::Layer L;
    L.ratio = c_.compress_ratios.at(size_t(l));
    load.sections(L, p);
    load.engine(L, p, l < c_.hash_layers);
    any_fp4 |= load.experts(L, p);
    impl_->layers.push_back(std::move(L));
  }
  impl_->fp4 = any_fp4;
  take_fp4_experts_apart(*impl_);
  note_ = fmt::format("deepseek4 on the GPU: bf16 products (f32 accumulation) of {}; routed experts {}; the sections' projections with the "
                      "decoder's weights ({})",
                      W.describe,
                      !any_fp4                ? "bf16"
                      : impl_->fp4_products ? "FP4 (MXFP4) in memory, read by the products (no expansion)"
                                            : "FP4 (MXFP4) in memory, expanded to bf16 per layer on a side stream before one product per expert",
                      impl_->layers.empty() || !impl_->layers[0].wkv.q8 ? "f32" : "Q8_0 in integers");
}

namespace {

// Random weights at a configuration's shapes, drawn on the GPU in a fixed order (seed * 1000 + the draw's number),
// so a seed always gives the same engine.
struct RandomLayerWeights {
  Deepseek4CudaEngine::Impl& I;
  const Deepseek4Config& c;
  size_t& bytes;
  uint64_t k;
  std::mt19937 rng;

  DeviceBuffer f32(int64_t n, float sd, float mean) {
    DeviceBuffer b(size_t(n) * 4);
    cuda::fill_random_f32(b.as<float>(), n, ++k, sd, mean, I.s);
    return b;
  }
  DeviceBuffer b16(int64_t out, int64_t in) {
    DeviceBuffer b(size_t(out * in) * 2);
    cuda::fill_random_bf16(b.as<bf16>(), out * in, ++k, 1.0f / std::sqrt(float(in)), I.s);
    bytes += b.bytes();
    return b;
  }
  SectionProjection q8(int64_t out, int64_t in) {
    SectionProjection P;
    P.in = in;
    P.out = out;
    P.q8 = true;
    P.w.resize(size_t(out * in));
    P.d.resize(size_t(out * in / 32) * 4);
    cuda::fill_random_q8(P.w.as<int8_t>(), P.d.as<float>(), out * in, ++k, 1.0f / (73.0f * std::sqrt(float(in))), I.s);
    bytes += P.w.bytes() + P.d.bytes();
    return P;
  }
  DeviceBuffer fp4(int64_t elements) {
    DeviceBuffer b(size_t(elements / 32) * 17);
    cuda::fill_random_mxfp4(b.as<uint8_t>(), elements / 32, ++k, 120, I.s);
    bytes += b.bytes();
    return b;
  }

  // The sections' weights and the indexer's, in the GGUF loader's order.
  void sections(Deepseek4CudaEngine::Impl::Layer& L) {
    const int64_t E = c.hidden, D = c.head_dim, Lq = c.q_lora, Hi = c.index_heads, Id = c.index_dim;
    L.r_hc_fn = f32(24 * 4 * E, 0.01f, 0.0f);
    L.r_hc_base = f32(24, 0.1f, 0.0f);
    L.r_hc_scale = f32(3, 0.0f, 1.0f);
    L.attn_norm = f32(E, 0.0f, 1.0f);
    L.kv_norm = f32(D, 0.0f, 1.0f);
    L.wkv = q8(D, E);
    if (L.ratio) {
      const int64_t cw = (L.ratio == 4 ? 2 : 1) * D;
      L.ckv = q8(cw, E);
      L.cgate = q8(cw, E);
      L.cape = f32(L.ratio * cw, 0.02f, 0.0f);
      L.cnorm = f32(D, 0.0f, 1.0f);
    }
    if (L.ratio == 4) {
      L.ikv = q8(2 * Id, E);
      L.igate = q8(2 * Id, E);
      L.iape = f32(4 * 2 * Id, 0.02f, 0.0f);
      L.inorm = f32(Id, 0.0f, 1.0f);
      L.idx_q_b = b16(Hi * Id, Lq);
      L.idx_proj = b16(Hi, E);
    }
  }

  void attention(Deepseek4CudaEngine::Impl::Layer& L) {
    const int64_t E = c.hidden, D = c.head_dim, H = c.heads, Lq = c.q_lora, G = c.out_groups, R = c.out_lora;
    L.hc_attn_fn = f32(24 * 4 * E, 0.01f, 0.0f);
    L.hc_attn_base = f32(24, 0.1f, 0.0f);
    L.hc_attn_scale = f32(3, 0.0f, 1.0f);
    L.hc_ffn_fn = f32(24 * 4 * E, 0.01f, 0.0f);
    Deepseek4CudaEngine::Impl::stack_attn_hc(L);
    L.hc_ffn_base = f32(24, 0.1f, 0.0f);
    L.hc_ffn_scale = f32(3, 0.0f, 1.0f);
    L.q_a_norm = f32(Lq, 0.0f, 1.0f);
    L.sinks = f32(H, 0.5f, 0.0f);
    L.ffn_norm = f32(E, 0.0f, 1.0f);
    L.router = f32(c.experts * E, 1.0f / std::sqrt(float(E)), 0.0f);
    L.wq_a = b16(Lq, E);
    L.wq_b = b16(H * D, Lq);
    L.wo_a = b16(G * R, H * D / G);
    L.wo_b = b16(E, G * R);
  }

  // A hash layer's k distinct experts per token id, drawn on the host.
  void hash_routing(Deepseek4CudaEngine::Impl::Layer& L) {
    std::vector<int32_t> ids(size_t(c.vocab * c.experts_used));
    std::uniform_int_distribution<int32_t> pick(0, int32_t(c.experts - 1));
    for (int64_t t = 0; t < c.vocab; ++t)
      for (int64_t j = 0; j < c.experts_used; ++j) {
        int32_t e;
        bool dup;
        do {
          e = pick(rng);
          dup = false;
          for (int64_t i = 0; i < j; ++i) dup |= ids[size_t(t * c.experts_used + i)] == e;
        } while (dup);
        ids[size_t(t * c.experts_used + j)] = e;
      }
    L.tid2eid.resize(ids.size() * 4);
    L.tid2eid.upload(ids.data(), ids.size() * 4);
    L.hash = true;
  }

  void experts(Deepseek4CudaEngine::Impl::Layer& L, bool bf16_experts) {
    const int64_t E = c.hidden, NE = c.experts, F = c.expert_ff, FS = F * c.shared_experts;
    L.sh_gu = b16(2 * FS, E);
    L.sh_down = b16(E, FS);
    if (bf16_experts) {
      L.exp_gu = b16(NE * 2 * F, E);
      L.exp_down = b16(NE * E, F);
    } else {
      L.gate_fp4 = fp4(NE * F * E);
      L.up_fp4 = fp4(NE * F * E);
      L.down_fp4 = fp4(NE * E * F);
    }
  }
};

}  // namespace

std::unique_ptr<Deepseek4CudaEngine> Deepseek4CudaEngine::random(const Deepseek4Config& c, uint64_t seed) {
  std::unique_ptr<Deepseek4CudaEngine> eng(new Deepseek4CudaEngine(c));
  Impl& I = *eng->impl_;
  RandomLayerWeights r{I, c, eng->weight_bytes_, seed * 1000, std::mt19937{static_cast<uint32_t>(seed)}};
  I.embed = r.f32(c.vocab * c.hidden, 1.0f, 0.0f);
  const bool bf16_experts = Tuning::from_env().dsv4_experts == "bf16";
  for (int64_t l = 0; l < c.layers; ++l) {
    Impl::Layer L;
    L.ratio = c.compress_ratios.at(size_t(l));
    r.sections(L);
    r.attention(L);
    if (l < c.hash_layers) r.hash_routing(L);
    else L.probs_bias = r.f32(c.experts, 0.0f, 0.0f);
    r.experts(L, bf16_experts);
    I.layers.push_back(std::move(L));
  }
  I.fp4 = !bf16_experts;
  PDB_CUDA_CHECK(cudaStreamSynchronize(I.s));
  take_fp4_experts_apart(I);
  eng->note_ = std::string("deepseek4 on the GPU, random weights at these shapes: bf16 dense products, ") +
               (bf16_experts     ? "bf16 routed experts (PDBRIDGE_DSV4_EXPERTS=bf16)"
                : I.fp4_products ? "FP4 (MXFP4) routed experts read by the products"
                                 : "FP4 (MXFP4) routed experts expanded per layer") +
               ", Q8_0 section projections in integers";
  return eng;
}

// One prompt's run through the GPU engine, per phase: the sizes and flags it fixes once, then per chunk and layer
// the sections (with the decoder's weights) handed to the hook, and the layer with the engine's: the q path, the
// indexer, the sparse attention, the output LoRA and the MoE. The buffers are the engine's (Impl), grown on demand.

Deepseek4CudaEngine::PromptRun::PromptRun(Impl& impl, const Deepseek4Config& config, const std::vector<int32_t>& tokens, int64_t chunk_tokens,
                                          GgmlType kt, Profile* prof)
    : I(impl), c(config), profile(prof), s(impl.s) {
  T = int64_t(tokens.size()), E = c.hidden, D = c.head_dim, H = c.heads, r = c.rope_dims, W = c.window;
  Id = c.index_dim, Hi = c.index_heads, Lq = c.q_lora, G = c.out_groups, R = c.out_lora, ogd = H * D / G;
  NE = c.experts, K = c.experts_used, F = c.expert_ff, FS = c.expert_ff * c.shared_experts, topk = c.index_top_k;
  eps = c.rms_eps;
  chunk = chunk_tokens <= 0 ? T : std::min(chunk_tokens, T);
  n = chunk;
  switch (kt) {
    case GgmlType::F32: break;
    case GgmlType::F16: round_kind = 1; break;
    case GgmlType::BF16: round_kind = 2; break;
    case GgmlType::Q8_0: quantized = true; break;
    default: throw std::invalid_argument(std::string("the GPU DSV4 engine attends over f32, f16, bf16 or q8_0 caches, not ") + ggml_type_name(kt));
  }
  for (int32_t t : tokens)
    if (t < 0 || t >= c.vocab) throw std::invalid_argument(fmt::format("token {} outside the vocabulary", t));
  // The fused kernels where they take the shapes; PDBRIDGE_DSV4_ATTN=gather (=mma: the fused attention on mma.sync
  // instead of wgmma, 1.15-1.27x slower at V4-Flash's shapes), PDBRIDGE_DSV4_INDEXER=bf16|gemm,
  // PDBRIDGE_DSV4_EXPAND=inline select the paths before them (the same-run A/B of the benchmark). The indexer
  // in FP8 by default, as DeepSeek runs it: at V4-Flash's shapes it keeps 95-98% of the bf16 top-512 and what it
  // swaps sits within 0.2 score SDs of the k-th (docs/RESULTS.md, on random operands: the hard case of many ties).
  tuning = Tuning::from_env();
  fp8_idx = cuda::indexer_scores_fp8_supported(int(Hi), int(Id)) && tuning.dsv4_indexer != "bf16" &&
                       tuning.dsv4_indexer != "gemm";
  fused_idx = fp8_idx || (cuda::indexer_scores_supported(int(Hi), int(Id)) && tuning.dsv4_indexer != "gemm");
  size_prompt_state();
  Impl::grow(I.tokens, size_t(T) * 4);
  I.tokens.upload(tokens.data(), size_t(T) * 4);
  size_scratch();
  rp_plain = dsv4_rope(c, 0), rp_comp = dsv4_rope(c, 4);
  if (!I.rope_plain) {
    const int threads = int(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
    I.rope_plain.emplace(rp_plain, threads);
    I.rope_comp.emplace(rp_comp, threads);
  }
  fused_attn = cuda::dsv4_sparse_attention_supported(int(H), int(D)) && tuning.dsv4_attn != "gather";
  wgmma_attn = fused_attn && tuning.dsv4_attn != "mma" && cuda::dsv4_sparse_attention_wgmma_supported(int(H), int(D));
  side_expansion = tuning.dsv4_expand != "inline";  // =inline: in the MoE, as before
  prepare_fp8_experts();
  size_batches();
  if (profile) {
    profile->ms.resize(size_t(c.layers));
    profile->ratio.resize(size_t(c.layers));
    for (int64_t l = 0; l < c.layers; ++l) profile->ratio[size_t(l)] = c.compress_ratios[size_t(l)];
  }
  for (auto& e : ev) PDB_CUDA_CHECK(cudaEventCreate(&e));
  any_q8 = !I.layers.empty() && I.layers[0].wkv.q8;
  scale = 1.0f / std::sqrt(float(D));
}

// per-prompt state
void Deepseek4CudaEngine::PromptRun::size_prompt_state() {
  for (auto& L : I.layers) {
    Impl::grow(L.win, size_t(W + chunk) * D * 2);
    L.win_first = L.win_rows = 0;
    L.n_pool = L.n_lid = 0;
    if (L.ratio) Impl::grow(L.pool, size_t(T / L.ratio + 1) * D * 2);
    if (L.ratio == 4) Impl::grow(L.lid, size_t(T / 4 + 1) * Id * 2);
    if (L.ratio == 4 && fp8_idx) {
      Impl::grow(L.lid8, size_t(T / 4 + 1) * Id);
      Impl::grow(L.lid8_s, size_t(T / 4 + 1) * 4);
    }
    for (auto* h : {&L.hp, &L.hl}) h->first = h->rows = 0;
    if (L.ratio) {
      const int64_t cw = (L.ratio == 4 ? 2 : 1) * D, ring = L.ratio == 4 ? 8 : 128;
      Impl::grow(L.hp.a, size_t(ring + chunk) * cw * 4);
      Impl::grow(L.hp.g, size_t(ring + chunk) * cw * 4);
    }
    if (L.ratio == 4) {
      Impl::grow(L.hl.a, size_t(8 + chunk) * 2 * Id * 4);
      Impl::grow(L.hl.g, size_t(8 + chunk) * 2 * Id * 4);
    }
  }
}

void Deepseek4CudaEngine::PromptRun::size_scratch() {
  for (auto* b : {&I.x, &I.xa}) Impl::grow(*b, size_t(n * 4 * E) * 4);
  Impl::grow(I.inv_x, size_t(n) * 4);
  Impl::grow(I.m, size_t(n * 2 * cuda::kDsv4MixFloats) * 4);
  for (auto* b : {&I.mix_r, &I.mix_e}) Impl::grow(*b, size_t(n * cuda::kDsv4MixFloats) * 4);
  for (auto* b : {&I.pre, &I.cur, &I.ao, &I.hn, &I.y}) Impl::grow(*b, size_t(n * E) * 4);
  Impl::grow(I.cur_b, size_t(n * E) * 2);
  Impl::grow(I.hn_b, size_t(n * E) * 2);
  Impl::grow(I.qx, size_t(n * E));
  Impl::grow(I.dx, size_t(n * E / 32) * 4);
  Impl::grow(I.kvrow, size_t(n * D) * 4);
  Impl::grow(I.kvtmp, size_t(n * std::max(D, Id)) * 4);
  Impl::grow(I.pooled, size_t(n / 4 + 2) * std::max(D, Id) * 4);
  // one layer's sections on the host: the window's last W rows, the pools' and LID's blocks, the rings' tails (a
  // ratio-128 layer's 128 tokens of a and g, a ratio-4 layer's 8 of 2D and of 2 Id each)
  I.dl.parts.clear();  // a prompt that ended in an exception may have left some queued
  I.dl.used = 0;
  I.dl.buf.resize(size_t(W * D + (n / 4 + 2) * (D + Id) + 2 * 128 * D + 4 * 8 * 2 * std::max(D, Id)) * 4);
  Impl::grow(I.csb, size_t(n / 4 + 2) * r * 4);
  Impl::grow(I.cs_plain, size_t(n * r) * 4);
  Impl::grow(I.cs_comp, size_t(n * r) * 4);
  Impl::grow(I.qr, size_t(n * Lq) * 4);
  Impl::grow(I.qr_b, size_t(n * Lq) * 2);
  Impl::grow(I.q, size_t(n * H * D) * 4);
  Impl::grow(I.q_b, size_t(n * H * D) * 2);
  Impl::grow(I.att, size_t(n * H * D) * 2);
  Impl::grow(I.oa, size_t(n * G * R) * 2);
  Impl::grow(I.iq, size_t(n * Hi * Id) * 4);
  if (fp8_idx) {  // the indexer's queries as e4m3 codes and scales, or in bf16
    Impl::grow(I.iq8, size_t(n * Hi * Id));
    Impl::grow(I.iq8_s, size_t(n * Hi) * 4);
  } else {
    Impl::grow(I.iq_b, size_t(n * Hi * Id) * 2);
  }
  Impl::grow(I.iw, size_t(n * Hi) * 4);
  Impl::grow(I.idx, size_t(n * std::max<int64_t>(topk, 1)) * 4);
  Impl::grow(I.logits, size_t(n * NE) * 4);
  Impl::grow(I.experts, size_t(n * K) * 4);
  Impl::grow(I.weights, size_t(n * K) * 4);
  Impl::grow(I.counts, size_t(NE) * 4);
  Impl::grow(I.offsets, size_t(NE) * 4);
  Impl::grow(I.slot_of, size_t(n * K) * 4);
  Impl::grow(I.token_of, size_t(n * K) * 4);
  // 64 rows of slack: the FP8 products' padding rows past the last expert's
  if (!I.fp4_fused) {  // the fused FP4 products neither gather nor store the gate|up products
    Impl::grow(I.xg, size_t((n * K + 64) * E) * 2);
    Impl::grow(I.gu, size_t((n * K + 64) * 2 * F) * 2);
  }
  Impl::grow(I.act, size_t((n * K + 64) * F) * 2);
  Impl::grow(I.yexp, size_t((n * K + 64) * E) * 2);
  Impl::grow(I.shgu, size_t(n * 2 * FS) * 2);
  Impl::grow(I.shact, size_t(n * FS) * 2);
  if (I.fp4 && !I.fp4_products) {
    Impl::grow(I.exp_gu_scratch, size_t(NE * 2 * F * E) * 2);
    Impl::grow(I.exp_down_scratch, size_t(NE * E * F) * 2);
  }
}

// PDBRIDGE_DSV4_EXPERTS_FP8=1: the routed experts as FP8 products where the library has the block-scaled
// product, the widths are multiples of 128 and a layer's FP4 values fit its e4m3 tiles exactly (looked at once
// per layer). Not the default: at V4-Flash's shapes cuBLASLt's block-scaled products per expert took 17.2 ms per
// 32K-token layer against the bf16 products' 15.9 (docs/RESULTS.md), and the activations lose bits.
void Deepseek4CudaEngine::PromptRun::prepare_fp8_experts() {
  if (I.fp4 && !I.fp4_products && E % 128 == 0 && F % 128 == 0 && tuning.dsv4_experts_fp8 == "1") {
    if (!I.fp8_probed) {
      I.fp8_probed = true;
      I.fp8 = cuda::probe_fp8_layout(I.gemm, &I.fp8_note);
    }
    if (I.fp8) {
      const cuda::Fp8ScaleLayout& fl = *I.fp8;
      Impl::grow(I.gu8, size_t(NE * 2 * F * E));
      Impl::grow(I.gu8_s, size_t(NE * fl.weight_scale_count(2 * F / 128, E / 128)) * 4);
      Impl::grow(I.down8, size_t(NE * E * F));
      Impl::grow(I.down8_s, size_t(NE * fl.weight_scale_count(E / 128, F / 128)) * 4);
      // each expert's rows padded to 64, each scale grid's ld aligned: bounded by these many rows
      const int64_t qrows = n * K + NE * (64 + fl.act_ld_align);
      Impl::grow(I.xq, size_t(qrows * E));
      Impl::grow(I.aq, size_t(qrows * F));
      Impl::grow(I.xq_s, cuda::fp8_scale_bytes(qrows, E, fl));
      Impl::grow(I.aq_s, cuda::fp8_scale_bytes(qrows, F, fl));
      Impl::grow(I.inexact, 4);
      for (auto& L : I.layers) {
        if (L.exp_gu.bytes() != 0 || L.fp8_fit != -1) continue;
        PDB_CUDA_CHECK(cudaMemsetAsync(I.inexact.get(), 0, 4, s));
        expand_all_experts_fp8(I, L, s);
        unsigned lost = 0;
        PDB_CUDA_CHECK(cudaMemcpyAsync(&lost, I.inexact.get(), 4, cudaMemcpyDeviceToHost, s));
        PDB_CUDA_CHECK(cudaStreamSynchronize(s));
        L.fp8_fit = lost == 0;
      }
      fp8_experts = true;
    }
  }
}

// the gathered attention's key batches: sized so that one batch's keys and scores stay near 512 MB each; the
// indexer's query batches: S [batch*Hi x blocks] f32 near 1 GB (the GEMM path), or the scores alone
void Deepseek4CudaEngine::PromptRun::size_batches() {
  max_nk = W + std::max<int64_t>(topk, T / 128);
  attn_batch = std::max<int64_t>(1, std::min<int64_t>(n, (int64_t(512) << 20) / std::max<int64_t>(max_nk * std::max(D * 2, H * 4), 1)));
  if (!fused_attn) {
    Impl::grow(I.kg, size_t(attn_batch * max_nk * D) * 2);
    Impl::grow(I.valid, size_t(attn_batch * max_nk));
    Impl::grow(I.sc, size_t(attn_batch * H * max_nk) * 4);
    Impl::grow(I.p, size_t(attn_batch * H * max_nk) * 2);
  }
  max_blocks = T / 4 + 1;
  const int64_t idx_row_bytes = (fused_idx ? 1 : Hi) * max_blocks * 4;
  idx_batch = std::max<int64_t>(1, std::min<int64_t>(n, (int64_t(1) << 30) / std::max<int64_t>(idx_row_bytes, 1)));
  if (!fused_idx) Impl::grow(I.isc, size_t(idx_batch * Hi * max_blocks) * 4);
  Impl::grow(I.iscores, size_t(idx_batch * max_blocks) * 4);
}


int64_t Deepseek4CudaEngine::PromptRun::run(const ChunkHook& hook, const std::function<bool()>& stop, bool compute_last) {
  int64_t done = 0;
  for (p0 = 0; p0 < T; p0 += chunk) {
    rows = std::min(chunk, T - p0);
    tok = I.tokens.as<int32_t>() + p0;
    cuda::dsv4_embed_streams(I.embed.as<float>(), tok, rows, E, I.x.as<float>(), s);
    cuda::dsv4_row_inv_rms(I.x.as<float>(), rows, 4 * E, eps, I.inv_x.as<float>(), s);  // each later layer's: its hc_post's
    I.rope_plain->upload(p0, rows, I.cs_plain.as<float>(), s);
    I.rope_comp->upload(p0, rows, I.cs_comp.as<float>(), s);
    for (l = 0; l < c.layers; ++l) {
      if (stop && stop()) return done;
      begin_layer(l);
      Deepseek4LayerSections S;
      sections(S);
      mark(8);
      // The hook takes the sections on the host while the GPU runs the layer's attention: it is queued up to the
      // MoE, whose routing waits for the expert counts on the host.
      const bool sections_only = l == c.layers - 1 && !compute_last;
      if (!sections_only) {
        q_path();
        indexer();
        attention();
        output();
      }
      if (!hand_over(hook, S)) return done;
      if (sections_only) {
        if (profile) {
          float ms = 0;
          PDB_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
          profile->ms[size_t(l)][kSections] += ms;
        }
        break;
      }
      moe();
      record_profile();
    }
    PDB_CUDA_CHECK(cudaStreamSynchronize(s));
    done = p0 + rows;
  }
  return done;
}

// The layer's sections to the hook, once their copies are on the host; the hook's own time to the profile (beside the
// layer's device work: where it outlasts the queued phases, the MoE's events take the wait).
bool Deepseek4CudaEngine::PromptRun::hand_over(const ChunkHook& hook, const Deepseek4LayerSections& S) {
  I.take_downloads();
  const auto h0 = std::chrono::steady_clock::now();
  const bool go_on = hook(int(l), nullptr, p0, rows, S);
  if (profile) profile->ms[size_t(l)][kHook] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
  return go_on;
}

// The layer's rope table and, for FP4 experts, their expansion on the side stream from the layer's start.
void Deepseek4CudaEngine::PromptRun::begin_layer(int64_t layer) {
  layer_ = &I.layers[size_t(layer)];
  Impl::Layer& L = *layer_;
  cs = L.ratio ? I.cs_comp.as<float>() : I.cs_plain.as<float>();
  rope_ = L.ratio ? &rp_comp : &rp_plain;
  mark(0);
  fp4 = L.exp_gu.bytes() == 0;
  // A chunk of rows * K >= 8 * NE token choices uses (nearly) every expert: all of them are expanded (to FP8
  // tiles where the layer's fit) on the side stream from the layer's start, once the last layer's products are
  // done with the scratch.
  const bool long_chunk = rows * K >= 8 * NE;
  experts_fp8 = fp8_experts && fp4 && long_chunk && L.fp8_fit == 1;
  expand_ahead = side_expansion && fp4 && long_chunk && !I.fp4_products;
  if (expand_ahead) {
    PDB_CUDA_CHECK(cudaStreamWaitEvent(I.side, I.scratch_free, 0));
    if (profile) PDB_CUDA_CHECK(cudaEventRecord(ev[9], I.side));
    if (experts_fp8) expand_all_experts_fp8(I, L, I.side);
    else expand_all_experts(I, L, I.side);
    if (profile) PDB_CUDA_CHECK(cudaEventRecord(ev[10], I.side));
    PDB_CUDA_CHECK(cudaEventRecord(I.expanded, I.side));
  }
}

// ---- the sections, with the decoder's weights (to the hook)
// ---- the layer, with the engine's weights: the q path (from cur_b, the sections' normed rows in bf16)
void Deepseek4CudaEngine::PromptRun::q_path() {
  Impl::Layer& L = *layer_;
  I.gemm.xwt(cuda::DType::BF16, I.cur_b.get(), L.wq_a.get(), cuda::DType::F32, I.qr.get(), rows, E, Lq, 0.0f, s);
  cuda::rmsnorm_rows(I.qr.as<float>(), L.q_a_norm.as<float>(), I.qr.as<float>(), rows, Lq, eps, s);
  cuda::f32_to_bf16(I.qr.as<float>(), I.qr_b.as<bf16>(), rows * Lq, s);
  // q in bf16 straight from its product: the head norm sees bf16-rounded values (the engine's products' class)
  I.gemm.xwt(cuda::DType::BF16, I.qr_b.get(), L.wq_b.get(), cuda::DType::BF16, I.q.get(), rows, Lq, H * D, 0.0f, s);
  cuda::dsv4_head_norm_rope_bf16(I.q.as<bf16>(), cs, rows, int(H), int(D), int(r), eps, I.q_b.as<bf16>(), s);
  mark(2);
}

// ---- the lightning indexer (ratio 4): each query's top-k of the finished blocks
void Deepseek4CudaEngine::PromptRun::indexer() {
  Impl::Layer& L = *layer_;
  if (L.ratio == 4) {
    I.gemm.xwt(cuda::DType::BF16, I.qr_b.get(), L.idx_q_b.get(), cuda::DType::F32, I.iq.get(), rows, Lq, Hi * Id, 0.0f, s);
    cuda::rope_tail(I.iq.as<float>(), cs, rows, int(Hi), int(Id), int(r), Hi * Id, s);
    rotate_rows(I.iq.as<float>(), rows * Hi, Id, s);
    if (fp8_idx)
      cuda::indexer_fp8_rows(I.iq.as<float>(), rows * Hi, int(Id), I.iq8.as<uint8_t>(), I.iq8_s.as<float>(), s);
    else
      cuda::f32_to_bf16(I.iq.as<float>(), I.iq_b.as<bf16>(), rows * Hi * Id, s);
    I.gemm.xwt(cuda::DType::BF16, I.cur_b.get(), L.idx_proj.get(), cuda::DType::F32, I.iw.get(), rows, E, Hi, 0.0f, s);
    cuda::scale_f32(I.iw.as<float>(), rows * Hi, 1.0f / std::sqrt(float(Id * Hi)), s);
    const int64_t nblocks = L.n_lid;
    if (nblocks == 0) {
      PDB_CUDA_CHECK(cudaMemsetAsync(I.idx.get(), 0xff, size_t(rows * topk) * 4, s));
    } else {
      for (int64_t q0 = 0; q0 < rows; q0 += idx_batch) {
        const int64_t nq = std::min(idx_batch, rows - q0);
        const cuda::IndexerShape sh{nq, p0 + q0, int(Hi), nblocks, 4, int(topk)};
        if (fp8_idx) {
          cuda::indexer_scores_fp8(I.iq8.as<uint8_t>() + q0 * Hi * Id, I.iq8_s.as<float>() + q0 * Hi, L.lid8.as<uint8_t>(), L.lid8_s.as<float>(),
                                   I.iw.as<float>() + q0 * Hi, I.iscores.as<float>(), sh, int(Id), s);
        } else if (fused_idx) {
          cuda::indexer_scores(I.iq_b.as<bf16>() + q0 * Hi * Id, L.lid.as<bf16>(), I.iw.as<float>() + q0 * Hi, I.iscores.as<float>(), sh, int(Id), s);
        } else {
          I.gemm.xwt(cuda::DType::BF16, I.iq_b.as<bf16>() + q0 * Hi * Id, L.lid.get(), cuda::DType::F32, I.isc.get(), nq * Hi, Id, nblocks, 0.0f, s);
          cuda::indexer_weighted_relu(I.isc.as<float>(), I.iw.as<float>() + q0 * Hi, I.iscores.as<float>(), sh, s);
        }
        if (profile) topk_spans.begin(s);
        cuda::indexer_topk(I.iscores.as<float>(), I.idx.as<int32_t>() + q0 * topk, sh, s);
        if (profile) topk_spans.end(s);
      }
    }
  }
  mark(3);
}

// ---- the sparse attention: per query its window rows and its compressed rows, softmax with the sink
void Deepseek4CudaEngine::PromptRun::attention() {
  Impl::Layer& L = *layer_;
  {
    const int64_t NK = W + (L.ratio == 4 ? topk : L.ratio == 128 ? (p0 + rows) / 128 : 0);
    if (fused_attn) {
      cuda::Dsv4SparseAttention a;
      a.q = I.q_b.as<bf16>();
      a.win = L.win.as<bf16>();
      a.win_first = L.win_first;
      a.pool = L.ratio ? L.pool.as<bf16>() : nullptr;
      a.n_pool = L.ratio ? L.n_pool : 0;
      a.idx = L.ratio == 4 ? I.idx.as<int32_t>() : nullptr;
      a.sinks = L.sinks.as<float>();
      a.top_k = int(topk);
      a.ratio = int(L.ratio);
      a.W = int(W);
      a.H = int(H);
      a.D = int(D);
      a.t0 = p0;
      a.nq = rows;
      a.scale = scale;
      if (wgmma_attn) cuda::dsv4_sparse_attention_wgmma(a, I.att.as<bf16>(), s);
      else cuda::dsv4_sparse_attention(a, I.att.as<bf16>(), s);
    }
    const int64_t batch = std::max<int64_t>(1, std::min<int64_t>(rows, attn_batch * max_nk / NK));
    const float one = 1.0f, zero = 0.0f;
    for (int64_t q0 = 0; q0 < rows && !fused_attn; q0 += batch) {
      const int64_t nq = std::min(batch, rows - q0);
      cuda::Dsv4KeyGather kg;
      kg.win = L.win.as<bf16>();
      kg.win_first = L.win_first;
      kg.pool = L.ratio ? L.pool.as<bf16>() : nullptr;
      kg.idx = L.ratio == 4 ? I.idx.as<int32_t>() + q0 * topk : nullptr;
      kg.top_k = int(topk);
      kg.ratio = int(L.ratio);
      kg.W = int(W);
      kg.NK = int(NK);
      kg.D = int(D);
      kg.t0 = p0 + q0;
      kg.nq = nq;
      cuda::dsv4_gather_keys(kg, I.kg.as<bf16>(), I.valid.as<uint8_t>(), s);
      // S^T [NK x H] = Kg [NK x D] . Q^T per query (column-major views of the row-major buffers)
      check_dsv4_cublas(cublasGemmStridedBatchedEx(I.blas, CUBLAS_OP_T, CUBLAS_OP_N, int(NK), int(H), int(D), &one, I.kg.get(), CUDA_R_16BF, int(D),
                                              NK * D, I.q_b.as<bf16>() + q0 * H * D, CUDA_R_16BF, int(D), H * D, &zero, I.sc.get(), CUDA_R_32F,
                                              int(NK), H * NK, int(nq), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "attention scores");
      cuda::dsv4_sink_softmax(I.sc.as<float>(), I.valid.as<uint8_t>(), L.sinks.as<float>(), nq, int(H), int(NK), scale, I.p.as<bf16>(), s);
      // O^T [D x H] = Kg^T [D x NK] . P^T [NK x H]
      check_dsv4_cublas(cublasGemmStridedBatchedEx(I.blas, CUBLAS_OP_N, CUBLAS_OP_N, int(D), int(H), int(NK), &one, I.kg.get(), CUDA_R_16BF, int(D),
                                              NK * D, I.p.get(), CUDA_R_16BF, int(NK), H * NK, &zero, I.att.as<bf16>() + q0 * H * D, CUDA_R_16BF,
                                              int(D), H * D, int(nq), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                   "attention output");
    }
    cuda::dsv4_derope(I.att.as<bf16>(), cs, rows, int(H), int(D), int(r), s);
  }
  mark(4);
}

// ---- the grouped output LoRA: per group g, oa[:, gR..] = att[:, g ogd..] . wo_a_g^T; then wo_b; the post-mix
void Deepseek4CudaEngine::PromptRun::output() {
  Impl::Layer& L = *layer_;
  {
    const float one = 1.0f, zero = 0.0f;
    check_dsv4_cublas(cublasGemmStridedBatchedEx(I.blas, CUBLAS_OP_T, CUBLAS_OP_N, int(R), int(rows), int(ogd), &one, L.wo_a.get(), CUDA_R_16BF,
                                            int(ogd), R * ogd, I.att.get(), CUDA_R_16BF, int(H * D), ogd, &zero, I.oa.get(), CUDA_R_16BF,
                                            int(G * R), R, int(G), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "grouped output LoRA");
    I.gemm.xwt(cuda::DType::BF16, I.oa.get(), L.wo_b.get(), cuda::DType::F32, I.ao.get(), rows, G * R, E, 0.0f, s);
    cuda::dsv4_hc_post(I.ao.as<float>(), I.mix_e.as<float>(), x, rows, E, I.xa.as<float>(), s, I.inv_x.as<float>(), eps);
  }
  mark(5);
}

// ---- the MoE: pre-mix, ffn_norm, routing, routed experts (one grouped product each for gate|up and down), shared expert
void Deepseek4CudaEngine::PromptRun::moe() {
  route_and_gather();
  mark(16);
  routed_experts();
  shared_expert_and_combine();
  mark(6);
}

// the FFN's pre-mix and norm, each token's experts, the (token, choice) pairs grouped by expert, their rows gathered
void Deepseek4CudaEngine::PromptRun::route_and_gather() {
  Impl::Layer& L = *layer_;
  {
    float* xa = I.xa.as<float>();
    mix_product(xa, L.hc_ffn_fn, cuda::kDsv4MixFloats, I.m.as<float>());
    cuda::dsv4_hc_coefs(I.m.as<float>(), 24, I.inv_x.as<float>(), L.hc_ffn_base.as<float>(), L.hc_ffn_scale.as<float>(), rows, c.hc_eps,
                        int(c.hc_iterations), I.mix_r.as<float>(), s);
    pre_sum_norm(xa, I.mix_r.as<float>(), L.ffn_norm, I.hn.as<float>(), I.hn_b.as<bf16>());
    if (tuning.dsv4_f32 == "mixes" || !f32_on_tensor_cores(I.hn.as<float>(), L.router.as<float>(), E, NE, I.logits.as<float>()))
      I.gemm.xwt(cuda::DType::F32, I.hn.get(), L.router.get(), cuda::DType::F32, I.logits.get(), rows, E, NE, 0.0f, s);
    cuda::dsv4_route(I.logits.as<float>(), L.hash ? nullptr : L.probs_bias.as<float>(), L.hash ? L.tid2eid.as<int32_t>() : nullptr, tok, rows,
                     int(NE), int(K), c.expert_scale, I.experts.as<int32_t>(), I.weights.as<float>(), s);
    const int64_t g = rows * K;
    cuda::moe_group(I.experts.as<int32_t>(), rows, int(K), int(NE), I.counts.as<int32_t>(), I.offsets.as<int32_t>(), I.slot_of.as<int32_t>(),
                    I.token_of.as<int32_t>(), s);
    if (!I.fp4_fused) cuda::gather_rows(I.hn_b.as<bf16>(), I.token_of.as<int32_t>(), g, E, I.xg.as<bf16>(), s);  // fused: in the products' loads
    I.counts_host = I.counts_back.fetch(I.counts.as<int32_t>(), NE, s);
  }
}

// the routed experts' products (FP4 experts expanded first: ahead on the side stream, or here), SwiGLU between
void Deepseek4CudaEngine::PromptRun::routed_experts() {
  Impl::Layer& L = *layer_;
  {
    const int64_t g = rows * K;
    const int32_t* cnt = I.counts_host;
    const bf16* wgu = fp4 ? I.exp_gu_scratch.as<bf16>() : L.exp_gu.as<bf16>();
    const bf16* wd = fp4 ? I.exp_down_scratch.as<bf16>() : L.exp_down.as<bf16>();
    std::vector<cuda::GroupedProduct> up(static_cast<size_t>(NE)), down(static_cast<size_t>(NE));
    int64_t off = 0;
    const int64_t blocks_fe = F * E / 32;
    if (fp4 && !expand_ahead) mark(9);
    int64_t used = 0;
    for (int64_t e = 0; e < NE; ++e) used += cnt[e] > 0;
    const bool expand_all = fp4 && !I.fp4_products && !expand_ahead && (used == NE || experts_fp8);
    if (expand_all && experts_fp8) expand_all_experts_fp8(I, L, s);
    else if (expand_all) expand_all_experts(I, L, s);
    for (int64_t e = 0; e < NE; ++e) {
      const int64_t ne_rows = cnt[e];
      if (fp4 && !I.fp4_products && ne_rows > 0 && !expand_ahead && !expand_all) {  // this layer's used experts, FP4 -> bf16, just before their products
        cuda::mxfp4_to_bf16(L.gate_fp4.as<uint8_t>() + e * blocks_fe * 17, blocks_fe, I.exp_gu_scratch.as<bf16>() + e * 2 * F * E, s);
        cuda::mxfp4_to_bf16(L.up_fp4.as<uint8_t>() + e * blocks_fe * 17, blocks_fe, I.exp_gu_scratch.as<bf16>() + e * 2 * F * E + F * E, s);
        cuda::mxfp4_to_bf16(L.down_fp4.as<uint8_t>() + e * blocks_fe * 17, blocks_fe, I.exp_down_scratch.as<bf16>() + e * E * F, s);
      }
      if (!I.fp4_products) {  // (the FP4 products take tiles instead; their fused form has no xg)
        up[size_t(e)] = {I.xg.as<bf16>() + off * E, wgu + e * 2 * F * E, I.gu.as<bf16>() + off * 2 * F, ne_rows};
        down[size_t(e)] = {I.act.as<bf16>() + off * F, wd + e * E * F, I.yexp.as<bf16>() + off * E, ne_rows};
      }
      off += ne_rows;
    }
    if (fp4 && !expand_ahead) mark(10);
    if (expand_ahead) PDB_CUDA_CHECK(cudaStreamWaitEvent(s, I.expanded, 0));
    if (off != g) throw std::runtime_error(fmt::format("DSV4 MoE grouping placed {} of {} token choices", off, g));
    mark(11);
    if (I.fp4_products) {
      fp4_products(cnt);
    } else if (experts_fp8) {
      // One FP8 product per expert, its rows padded to 64 (few shapes, few plans) and quantized with their own
      // scale grid; the padding rows are the next expert's, whose own product overwrites them after (one
      // stream, in order), or the slack past the last.
      const cuda::Fp8ScaleLayout& fl = *I.fp8;
      auto products = [&](const bf16* in, int64_t width, uint8_t* q, float* qs, const uint8_t* w8, const float* w8s, int64_t w_stride,
                          int64_t s_stride, int64_t out_width, bf16* out) {
        int64_t at = 0, scale_at = 0;
        for (int64_t e = 0; e < NE; ++e) {
          const int64_t ne_rows = cnt[e];
          if (ne_rows == 0) continue;
          const int64_t padded = (ne_rows + 63) / 64 * 64;
          cuda::quantize_rows_fp8(in + at * width, padded, width, q + at * width, qs + scale_at, fl, s);
          I.gemm.xwt_fp8(fl, q + at * width, qs + scale_at, w8 + e * w_stride, w8s + e * s_stride, cuda::DType::BF16, out + at * out_width,
                         padded, width, out_width, 0.0f, s);
          at += ne_rows;
          scale_at += int64_t(cuda::fp8_scale_bytes(padded, width, fl) / 4);
        }
      };
      products(I.xg.as<bf16>(), E, I.xq.as<uint8_t>(), I.xq_s.as<float>(), I.gu8.as<uint8_t>(), I.gu8_s.as<float>(), 2 * F * E,
               fl.weight_scale_count(2 * F / 128, E / 128), 2 * F, I.gu.as<bf16>());
      cuda::swiglu_clamp_rows(I.gu.as<bf16>(), I.act.as<bf16>(), g, F, c.swiglu_clamp, s);
      products(I.act.as<bf16>(), F, I.aq.as<uint8_t>(), I.aq_s.as<float>(), I.down8.as<uint8_t>(), I.down8_s.as<float>(), E * F,
               fl.weight_scale_count(E / 128, F / 128), E, I.yexp.as<bf16>());
    } else {
      I.grouped.xwt(up, E, 2 * F, cuda::DType::BF16, s);
      cuda::swiglu_clamp_rows(I.gu.as<bf16>(), I.act.as<bf16>(), g, F, c.swiglu_clamp, s);
      I.grouped.xwt(down, F, E, cuda::DType::BF16, s);
    }
    if (fp4) PDB_CUDA_CHECK(cudaEventRecord(I.scratch_free, s));
    mark(12);
  }
}

// The routed products from the FP4 codes: the layer's tiles (rows of one expert, as many as the products' shape
// takes) from the counts, to the device from pinned memory (the host waited for this layer's counts, so the stream is
// past the previous layer's copy out of it), then gate|up, SwiGLU, down over the same tiles.
void Deepseek4CudaEngine::PromptRun::fp4_products(const int32_t* cnt) {
  Impl::Layer& L = *layer_;
  const auto tiles = cuda::fp4_tiles(cnt, NE, I.fp4_shape);
  const size_t bytes = tiles.size() * sizeof(cuda::Fp4Tile);
  if (I.fp4_tiles_host.bytes() < bytes) I.fp4_tiles_host.resize(bytes * 2);
  Impl::grow(I.fp4_tiles, bytes * 2);
  std::copy(tiles.begin(), tiles.end(), I.fp4_tiles_host.as<cuda::Fp4Tile>());
  PDB_CUDA_CHECK(cudaMemcpyAsync(I.fp4_tiles.get(), I.fp4_tiles_host.as<void>(), bytes, cudaMemcpyHostToDevice, s));
  const auto* dt = I.fp4_tiles.as<cuda::Fp4Tile>();
  const int64_t n = int64_t(tiles.size());
  const cuda::Fp4Matrices gu{L.gu4_codes.as<uint8_t>(), L.gu4_scales.as<uint8_t>(), NE, 2 * F, E, L.gu4_wide, I.fp4_fused};
  if (I.fp4_fused) {  // the token rows gathered in the loads, the SwiGLU in the epilogue (PDBRIDGE_DSV4_FP4_FUSE=0: not)
    cuda::moe_fp4_products(I.hn_b.as<bf16>(), gu, dt, n, I.fp4_shape, I.act.as<bf16>(), s, {I.token_of.as<int32_t>(), true, c.swiglu_clamp});
  } else {
    cuda::moe_fp4_products(I.xg.as<bf16>(), gu, dt, n, I.fp4_shape, I.gu.as<bf16>(), s);
    cuda::swiglu_clamp_rows(I.gu.as<bf16>(), I.act.as<bf16>(), rows * K, F, c.swiglu_clamp, s);
  }
  cuda::moe_fp4_products(I.act.as<bf16>(), {L.down4_codes.as<uint8_t>(), L.down4_scales.as<uint8_t>(), NE, E, F, L.down4_wide}, dt, n, I.fp4_shape, I.yexp.as<bf16>(), s);
}

void Deepseek4CudaEngine::PromptRun::shared_expert_and_combine() {
  Impl::Layer& L = *layer_;
  {
    float* xa = I.xa.as<float>();
    I.gemm.xwt(cuda::DType::BF16, I.hn_b.get(), L.sh_gu.get(), cuda::DType::BF16, I.shgu.get(), rows, E, 2 * FS, 0.0f, s);
    cuda::swiglu_clamp_rows(I.shgu.as<bf16>(), I.shact.as<bf16>(), rows, FS, c.swiglu_clamp, s);
    I.gemm.xwt(cuda::DType::BF16, I.shact.get(), L.sh_down.get(), cuda::DType::F32, I.y.get(), rows, FS, E, 0.0f, s);
    // the routed experts' rows combined inside the post-mix's pass (moe_combine's sums; y read once)
    cuda::dsv4_hc_post(I.y.as<float>(), I.mix_r.as<float>(), xa, rows, E, x, s, I.inv_x.as<float>(), eps,
                       {I.yexp.as<bf16>(), I.slot_of.as<int32_t>(), I.weights.as<float>(), int(K)});
  }
}

void Deepseek4CudaEngine::PromptRun::record_profile() {
  const Impl::Layer& L = *layer_;
  if (profile) {
    PDB_CUDA_CHECK(cudaEventSynchronize(ev[6]));
    // sections 0 -> 1 | (hook) | query 8 -> 2 | indexer 2 -> 3 | attention 3 -> 4 | output 4 -> 5 | moe 5 -> 6
    // and within the sections: the mixes 0 -> 13 | the window row 13 -> 14 | the pool's compressor 14 -> 15 | the
    // indexer's 15 -> 1; within the MoE: routing and gather 5 -> 16 | the wait for the expansion (or the expansion
    // itself, inline) 16 -> 11 | the routed products 11 -> 12 | the shared expert and the combine 12 -> 6
    constexpr int kSpans = 13;
    const int from[kSpans] = {0, 8, 2, 3, 4, 5, 0, 13, 14, 15, 5, 16, 12}, to[kSpans] = {1, 2, 3, 4, 5, 6, 13, 14, 15, 1, 16, 11, 6};
    const int phase[kSpans] = {kSections,    kQuery,          kIndexer,     kAttention, kOutput,        kMoe,      kSectionsMix,
                               kSectionsWindow, kSectionsPool, kSectionsLid, kMoeRoute,  kMoeExpandWait, kMoeShared};
    for (int i = 0; i < kSpans; ++i) {
      float ms = 0;
      PDB_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[from[i]], ev[to[i]]));
      profile->ms[size_t(l)][phase[i]] += ms;
    }
    if (L.exp_gu.bytes() == 0) {
      float ms = 0;
      PDB_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[9], ev[10]));
      profile->ms[size_t(l)][kExpand] += ms;
    }
    float routed = 0;
    PDB_CUDA_CHECK(cudaEventElapsedTime(&routed, ev[11], ev[12]));
    profile->ms[size_t(l)][kRouted] += routed;
    profile->ms[size_t(l)][kIndexerTopk] += topk_spans.take_ms();
  }
}

static_assert(cuda::kDsv4MixFloats == 24, "model/dsv4_chunk.h counts 24 mix floats per row");

int64_t Deepseek4CudaEngine::default_chunk() const {
  size_t free_bytes = 0, total = 0;
  PDB_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  return dsv4_cuda_largest_chunk(dsv4_cuda_bytes_per_chunk_row(c_), int64_t(free_bytes));
}

int64_t Deepseek4CudaEngine::prefill(const std::vector<int32_t>& tokens, int64_t chunk, GgmlType kt, const ChunkHook& hook,
                                     const std::function<bool()>& stop, bool compute_last, Profile* profile) {
  if (tokens.empty()) return 0;
  PromptRun run(*impl_, c_, tokens, chunk, kt, profile);
  return run.run(hook, stop, compute_last);
}

}  // namespace pdb
