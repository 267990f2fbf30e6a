// The CUDA engine's deepseek2 forward (DeepSeek-V2 / V2-Lite): multi-head latent attention in the
// decompressed form (cuda/mla.cuh says why), the dense lead layers, and routed + shared experts
// (model/cuda_moe_ffn.h). Per layer and chunk, all products bf16 with f32 accumulation:
//   x = rms_norm(h) * in_norm
//   [q | c_kv | k_pe] = x [W_q ; W_kv_a]^T            (one product; with a q LoRA: [q_a | c_kv | k_pe], then q = rms_norm(q_a) W_q_b^T)
//   c_kv = rms_norm(c_kv) * kv_a_norm;  [k_nope | v] per head = c_kv W_kv_b^T
//   keys [k_nope_h | RoPE(k_pe)] (192), values v_h (128), queries [q_nope_h | RoPE(q_pe_h)]; scores x mscale^2/sqrt(192)
//   h += attention W_o^T;  x = rms_norm(h) * post_norm;  h += FFN(x) (dense, or shared experts + routed experts)
// RoPE: ggml's NORM pairs with llama.cpp's YaRN angles (numerics/mla_rope.h), the same as the CPU engine.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "common/parallel.h"
#include "cuda/attention.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/mla.cuh"
#include "cuda/rmsnorm.cuh"
#include "model/cuda_engine.h"
#include "model/cuda_engine_load.h"
#include "numerics/mla_rope.h"

namespace pdb {

using bf16 = __nv_bfloat16;
using cuda_load::upload_f32;
using cuda_load::upload_stacked;

namespace {
int64_t mla_front_width(const HfConfig& c) {  // the first product's outputs: q (or q_a) | c_kv | k_pe
  const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  return (c.q_lora_rank ? c.q_lora_rank : c.num_heads * qk) + c.kv_lora_rank + c.qk_rope_head_dim;
}
int64_t ffn_width(const HfConfig& c, int64_t layer) {
  return layer < c.first_k_dense_replace ? c.intermediate_size : c.moe_intermediate_size * c.n_shared_experts;
}
}  // namespace

void CudaEngine::load_mla(const SafetensorsCheckpoint& ck, int threads, size_t& total) {
  const auto& c = cfg_;
  const int64_t H = c.hidden_size, nh = c.num_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim, kvl = c.kv_lora_rank;
  const int64_t rope = c.qk_rope_head_dim, vd = c.v_head_dim;
  if (c.moe() && c.n_shared_experts <= 0) throw std::runtime_error("CUDA engine: deepseek2 without shared experts is not supported");
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    Weights::Layer L;
    L.in_norm = upload_f32(ck.to_f32(p + "input_layernorm.weight"));
    L.post_norm = upload_f32(ck.to_f32(p + "post_attention_layernorm.weight"));
    L.kv_a_norm = upload_f32(ck.to_f32(p + "self_attn.kv_a_layernorm.weight"));
    const std::pair<std::string, int64_t> kv_a{p + "self_attn.kv_a_proj_with_mqa.weight", kvl + rope};
    if (c.q_lora_rank) {
      L.wqkv = upload_stacked(ck, c, {{p + "self_attn.q_a_proj.weight", c.q_lora_rank}, kv_a}, H, threads, total);
      L.q_a_norm = upload_f32(ck.to_f32(p + "self_attn.q_a_layernorm.weight"));
      L.wq_b = upload_stacked(ck, c, {{p + "self_attn.q_b_proj.weight", nh * qk}}, c.q_lora_rank, threads, total);
    } else {
      L.wqkv = upload_stacked(ck, c, {{p + "self_attn.q_proj.weight", nh * qk}, kv_a}, H, threads, total);
    }
    L.wkv_b = upload_stacked(ck, c, {{p + "self_attn.kv_b_proj.weight", nh * (c.qk_nope_head_dim + vd)}}, kvl, threads, total);
    L.wo = upload_stacked(ck, c, {{p + "self_attn.o_proj.weight", H}}, nh * vd, threads, total);
    const bool dense = l < c.first_k_dense_replace;
    const std::string mlp = dense ? p + "mlp." : p + "mlp.shared_experts.";
    const int64_t F = ffn_width(c, l);
    L.wgu = upload_stacked(ck, c, {{mlp + "gate_proj.weight", F}, {mlp + "up_proj.weight", F}}, H, threads, total);
    L.wd = upload_stacked(ck, c, {{mlp + "down_proj.weight", H}}, F, threads, total);
    if (!dense) {
      L.moe = std::make_unique<CudaMoeWeights>(load_cuda_moe(ck, c, p, threads));
      total += L.moe->bytes();
    }
    w_->layers.push_back(std::move(L));
  }
}

size_t CudaEngine::bytes_for_prompt_mla(int64_t T, int64_t chunk) const {
  const auto& c = cfg_;
  const int64_t H = c.hidden_size, nh = c.num_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim, vd = c.v_head_dim;
  const int64_t F = std::max(c.intermediate_size, c.moe_intermediate_size * c.n_shared_experts);
  chunk = std::min(chunk, T);
  const size_t kv = size_t(std::max<int64_t>(c.num_layers - 1, 1)) * size_t(nh * T) * size_t(qk + vd) * 2;
  size_t work = size_t(chunk) * size_t(4 + H * 4 + H * 2 + mla_front_width(c) * 2 + c.q_lora_rank * 2 + 2 * nh * qk * 2 + c.kv_lora_rank * 2 +
                                       nh * (c.qk_nope_head_dim + vd) * 2 + nh * vd * 2 + 2 * F * 2 + F * 2 + c.qk_rope_head_dim * 4);
  if (c.moe()) work += CudaMoeFfn::bytes_for(c, chunk);
  return kv + work;
}

int64_t CudaEngine::prefill_mla(const std::vector<int32_t>& tokens, int64_t chunk, const DeviceHook& hook, const std::function<bool()>& cancelled,
                                bool full_last_layer, bool skip_attention) {
  const auto& c = cfg_;
  const int64_t T = int64_t(tokens.size()), H = c.hidden_size, nh = c.num_heads, L = c.num_layers;
  const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, qk = nope + rope, vd = c.v_head_dim, kvl = c.kv_lora_rank;
  const int64_t ql = c.q_lora_rank, A = mla_front_width(c), qpart = ql ? ql : nh * qk;
  check_fits(T, chunk);
  auto& W = *w_;
  const int64_t cache_layers = full_last_layer ? L : std::max<int64_t>(L - 1, 1);
  const size_t kbytes = size_t(cache_layers * nh * T * qk) * 2, vbytes = size_t(cache_layers * nh * T * vd) * 2;
  if (W.capacity < T || W.kcache.bytes() < kbytes || W.vcache.bytes() < vbytes) {
    W.kcache.release();
    W.vcache.release();
    W.kcache.resize(kbytes);
    W.vcache.resize(vbytes);
    W.capacity = T;
  }
  const int64_t cap = W.capacity;
  int64_t F = 0;
  for (int64_t l = 0; l < L; ++l) F = std::max(F, ffn_width(c, l));
  W.tokens.resize(size_t(chunk) * 4);
  W.h.resize(size_t(chunk * H) * 4);
  W.x.resize(size_t(chunk * H) * 2);
  W.qkv.resize(size_t(chunk * A) * 2);
  if (ql) {
    W.qa.resize(size_t(chunk * ql) * 2);
    W.qfull.resize(size_t(chunk * nh * qk) * 2);
  }
  W.q.resize(size_t(chunk * nh * qk) * 2);
  W.ckv.resize(size_t(chunk * kvl) * 2);
  W.kvb.resize(size_t(chunk * nh * (nope + vd)) * 2);
  W.att.resize(size_t(chunk * nh * vd) * 2);
  W.gu.resize(size_t(chunk * 2 * F) * 2);
  W.act.resize(size_t(chunk * F) * 2);
  W.cs.resize(size_t(chunk * rope) * 4);
  cudaStream_t s = stream_;
  auto& gemm = *gemm_;
  const float eps = float(c.rms_norm_eps);
  const MlaRope mr = mla_rope(c);
  std::vector<float> cs_host(size_t(chunk * rope));
  cuda::MlaShape ms;
  ms.n_heads = int(nh);
  ms.nope = int(nope);
  ms.rope = int(rope);
  ms.v_dim = int(vd);
  ms.kv_capacity = cap;
  cuda::AttentionShape as;
  as.n_heads = as.n_kv_heads = int(nh);
  as.head_dim = int(qk);
  as.v_head_dim = int(vd);
  as.kv_capacity = cap;
  as.scale = mr.kq_scale;
  for (int64_t p0 = 0; p0 < T; p0 += chunk) {
    const int64_t n = std::min(chunk, T - p0);
    ms.rows = as.n_q = n;
    ms.pos0 = as.pos0 = p0;
    PDB_CUDA_CHECK(cudaMemcpyAsync(W.tokens.get(), tokens.data() + p0, size_t(n) * 4, cudaMemcpyHostToDevice, s));
    parallel_for(n, 4, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) ggml_rope_cache(mr.rope, p0 + i, cs_host.data() + i * rope);
    });
    // Pageable source: the copy is staged before the call returns, so the next chunk may refill cs_host.
    PDB_CUDA_CHECK(cudaMemcpyAsync(W.cs.get(), cs_host.data(), size_t(n * rope) * 4, cudaMemcpyHostToDevice, s));
    float* h = W.h.as<float>();
    cuda::embed_rows(W.embed.as<float>(), W.tokens.as<int32_t>(), n, H, h, s);
    for (int64_t l = 0; l < L; ++l) {
      if (cancelled && cancelled()) { PDB_CUDA_CHECK(cudaStreamSynchronize(s)); return p0; }
      if (hook) hook(int(l), h, n, p0, s);
      if (l == L - 1 && !full_last_layer) break;
      auto& Lw = W.layers[size_t(l)];
      bf16* x = W.x.as<bf16>();
      bf16* kc = W.kcache.as<bf16>() + l * nh * cap * qk;
      bf16* vc = W.vcache.as<bf16>() + l * nh * cap * vd;
      cuda::rmsnorm_rows_bf16(h, Lw.in_norm.as<float>(), x, n, H, eps, s);
      gemm.xwt(cuda::DType::BF16, x, Lw.wqkv.get(), cuda::DType::BF16, W.qkv.get(), n, H, A, 0.0f, s);
      const bf16* front = W.qkv.as<bf16>();
      const bf16* q_src = front;
      int64_t q_stride = A;
      if (ql) {
        cuda::rmsnorm_rows_strided_bf16(front, A, Lw.q_a_norm.as<float>(), W.qa.as<bf16>(), ql, n, ql, eps, s);
        gemm.xwt(cuda::DType::BF16, W.qa.get(), Lw.wq_b.get(), cuda::DType::BF16, W.qfull.get(), n, ql, nh * qk, 0.0f, s);
        q_src = W.qfull.as<bf16>();
        q_stride = nh * qk;
      }
      cuda::rmsnorm_rows_strided_bf16(front + qpart, A, Lw.kv_a_norm.as<float>(), W.ckv.as<bf16>(), kvl, n, kvl, eps, s);
      cuda::mla_rope_qk(q_src, q_stride, front + qpart + kvl, A, W.cs.as<float>(), W.q.as<bf16>(), kc, ms, s);
      gemm.xwt(cuda::DType::BF16, W.ckv.get(), Lw.wkv_b.get(), cuda::DType::BF16, W.kvb.get(), n, kvl, nh * (nope + vd), 0.0f, s);
      cuda::mla_scatter_kv(W.kvb.as<bf16>(), kc, vc, ms, s);
      if (!skip_attention) cuda::causal_attention(W.q.as<bf16>(), kc, vc, W.att.as<bf16>(), as, s);
      gemm.xwt(cuda::DType::BF16, W.att.get(), Lw.wo.get(), cuda::DType::F32, h, n, nh * vd, H, 1.0f, s);
      cuda::rmsnorm_rows_bf16(h, Lw.post_norm.as<float>(), x, n, H, eps, s);
      const int64_t Fl = ffn_width(c, l);
      gemm.xwt(cuda::DType::BF16, x, Lw.wgu.get(), cuda::DType::BF16, W.gu.get(), n, H, 2 * Fl, 0.0f, s);
      cuda::swiglu_rows(W.gu.as<bf16>(), W.act.as<bf16>(), n, Fl, s);
      gemm.xwt(cuda::DType::BF16, W.act.get(), Lw.wd.get(), cuda::DType::F32, h, n, Fl, H, 1.0f, s);
      if (Lw.moe) W.moe.forward(*Lw.moe, x, n, h, gemm, s);
    }
  }
  PDB_CUDA_CHECK(cudaStreamSynchronize(s));
  return T;
}

}  // namespace pdb
