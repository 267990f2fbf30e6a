// Internal to DeepSeek-V4's GPU engine (cuda_engine_dsv4.cpp, and cuda_engine_dsv4_sections.cpp where the decoder's
// cache rows are computed): its weights and buffers (Impl) and one prompt's run, per phase (PromptRun).
#pragma once
#include "common/tuning.h"
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <utility>
#include <optional>
#include <cmath>
#include <random>
#include <stdexcept>
#include <fmt/format.h>
#include "cuda/common.cuh"
#include "cuda/readback.cuh"
#include "cuda/dsv4.cuh"
#include "cuda/dsv4_attention.cuh"
#include "cuda/dsv4_indexer.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/f32_narrow.cuh"
#include "cuda/f32_tensor.cuh"
#include "cuda/fp8.cuh"
#include "cuda/gemm.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/moe.cuh"
#include "cuda/moe_fp4_gemm.cuh"
#include "cuda/q8_gemm.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope_table.h"
#include "formats/gguf.h"
#include "formats/numeric.h"
#include "model/cuda_engine_load.h"
#include "numerics/deepseek4_blocks.h"
#include "recipes/deepseek4.h"
#include "numerics/q8_dot.h"
#include "recipes/recipe.h"
#include "numerics/rope_ggml.h"
#include "model/cuda_engine_dsv4.h"

namespace pdb {

using cuda::DeviceBuffer;
using bf16 = __nv_bfloat16;

void check_dsv4_cublas(cublasStatus_t st, const char* what);  // cuda_engine_dsv4.cpp

// A section projection with the decoder's weight: Q8_0 in integers against the activation's Q8_0 codes (as
// ggml-cpu), or f32.
struct SectionProjection {
  int64_t in = 0, out = 0;
  bool q8 = false;
  DeviceBuffer w, d;  // f32 [out x in], or int8 codes [out x in] and f32 scales [out x in/32]
};

struct Deepseek4CudaEngine::Impl {
  struct Layer {
    int64_t ratio = 0;
    // the decoder's (the sections)
    DeviceBuffer r_hc_fn, r_hc_base, r_hc_scale, attn_norm, kv_norm, cape, cnorm, iape, inorm;
    SectionProjection wkv, ckv, cgate, ikv, igate;
    // the engine's
    DeviceBuffer hc_attn_fn, hc_attn_base, hc_attn_scale, hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
    // [r_hc_fn; hc_attn_fn] (48 x 4E): the recipe's and the engine's attention-side mixes in one pass over x
    DeviceBuffer hc_attn_fns;
    DeviceBuffer q_a_norm, sinks, ffn_norm, probs_bias, router;  // f32
    DeviceBuffer wq_a, wq_b, wo_a, wo_b, idx_q_b, idx_proj, sh_gu, sh_down;  // bf16
    DeviceBuffer exp_gu, exp_down;                 // bf16 [NE x 2F x E], [NE x E x F], or empty when FP4
    DeviceBuffer gate_fp4, up_fp4, down_fp4;       // GGUF MXFP4 blocks
    // the same taken apart for the products that read FP4 (the default; the blocks are then freed):
    // codes and scales of [NE x 2F x E] (gate rows, then up rows) and [NE x E x F]
    DeviceBuffer gu4_codes, gu4_scales, down4_codes, down4_scales;
    bool gu4_wide = true, down4_wide = true;  // a scale above 2^0 among them (cuda::Fp4Matrices::wide_scales)
    int fp8_fit = -1;  // its FP4 experts as FP8 tiles lose nothing (1), would (0), not yet looked (-1)
    DeviceBuffer tid2eid;                          // int32 [vocab x K] (hash layers)
    bool hash = false;
    // per prompt: the raw rows (as stored, bf16) of the last W positions and the chunk's, the compressed rows,
    // the compressors' last tokens
    DeviceBuffer win, pool, lid;
    DeviceBuffer lid8, lid8_s;  // the LID rows again as the FP8 indexer's operand: e4m3 codes, a scale per row
    int64_t win_first = 0, win_rows = 0, n_pool = 0, n_lid = 0;
    struct History {
      DeviceBuffer a, g;
      int64_t first = 0, rows = 0;
    } hp, hl;
  };
  Deepseek4Config c;
  // the decoder's cos/sin of every position so far (uncompressed and compressed layers' RoPE), pinned, made once
  std::optional<cuda::RopeTable> rope_plain, rope_comp;
  std::vector<Layer> layers;
  DeviceBuffer embed;  // f32 [vocab x E]
  cuda::Gemm gemm;
  cuda::GroupedGemm grouped{true};  // one product per expert: faster than the grouped call at these shapes
  cublasHandle_t blas = nullptr;
  cudaStream_t s = nullptr;
  // The FP4 experts' expansion of a long chunk's layer runs here, beside the layer's attention (memory-bound work
  // beside compute-bound): `expanded` tells the MoE it is done, `scratch_free` that the last layer's products have
  // read the scratch it overwrites.
  cudaStream_t side = nullptr;
  cudaEvent_t expanded = nullptr, scratch_free = nullptr;
  bool fp4 = false;
  // The routed experts' products read the FP4 codes (cuda/moe_fp4_gemm.cuh): no expansion, no bf16 scratch. Their
  // tiles (up to 256 rows of one expert) reach the device from pinned memory once the counts are back, each layer.
  bool fp4_products = false;
  bool fp4_fused = false;  // their gate|up products gather the token rows and write the SwiGLU (unless PDBRIDGE_DSV4_FP4_FUSE=0)
  cuda::Fp4Shape fp4_shape = cuda::Fp4Shape::kOutputs256;  // their CTAs' outputs x rows (PDBRIDGE_DSV4_FP4_TILE)
  DeviceBuffer fp4_tiles;
  DeviceBuffer mix_parts;  // the mixes' split partial sums (PDBRIDGE_DSV4_MIX=split)
  cuda::PinnedBuffer fp4_tiles_host;
  // scratch, grown on demand
  DeviceBuffer tokens, x, xa, inv_x, m, mix_r, mix_e, pre, cur, cur_b, qx, dx, kvrow, kvtmp, pooled, csb, cs_plain, cs_comp;
  DeviceBuffer qr, qr_b, q, q_b, iq, iq_b, iq8, iq8_s, iw, isc, iscores, idx, kg, valid, sc, p, att, oa, ao, shift_tmp;
  DeviceBuffer hn, hn_b, logits, experts, weights, counts, offsets, slot_of, token_of, xg, gu, act, yexp, shgu, shact, y;
  DeviceBuffer exp_gu_scratch, exp_down_scratch;
  // The routed experts as FP8 products (long chunks): the layer's experts expanded FP4 -> e4m3 tiles (half the
  // bf16 expansion's bytes, twice the tensor rate), the token rows quantized per expert (1 x 128 blocks).
  bool fp8_probed = false;
  std::optional<cuda::Fp8ScaleLayout> fp8;
  std::string fp8_note;
  DeviceBuffer gu8, gu8_s, down8, down8_s, xq, xq_s, aq, aq_s, inexact;
  cuda::Readback counts_back;
  const int32_t* counts_host = nullptr;  // the layer's expert counts, read back

  // A layer's sections on their way to the hook: copied on the layer's stream into pinned memory (a pageable
  // destination makes each copy stall the stream and the host), taken out on the host once `copied` has passed,
  // while the GPU runs the layer's attention. One layer's at a time: the hook has taken them before the next
  // layer's sections are queued.
  struct SectionsDownload {
    cuda::PinnedBuffer buf;
    size_t used = 0;  // floats queued
    std::vector<std::pair<size_t, std::function<void(const float*)>>> parts;  // where each starts, who takes it
    cudaEvent_t copied = nullptr;
  } dl;

  Impl() {
    // the layer's stream first wherever an SM frees up, the expansion in the gaps (without priorities its blocks
    // took the SMs from the sections and the layer gained nothing, docs/RESULTS.md)
    int least = 0, greatest = 0;
    PDB_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    PDB_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    PDB_CUDA_CHECK(cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, least));
    PDB_CUDA_CHECK(cudaEventCreateWithFlags(&expanded, cudaEventDisableTiming));
    PDB_CUDA_CHECK(cudaEventCreateWithFlags(&scratch_free, cudaEventDisableTiming));
    PDB_CUDA_CHECK(cudaEventRecord(scratch_free, s));
    PDB_CUDA_CHECK(cudaEventCreateWithFlags(&dl.copied, cudaEventDisableTiming));
    check_dsv4_cublas(cublasCreate(&blas), "create");
    check_dsv4_cublas(cublasSetStream(blas, s), "set stream");
  }
  ~Impl() {
    if (blas) cublasDestroy(blas);
    if (side) cudaStreamSynchronize(side);
    if (expanded) cudaEventDestroy(expanded);
    if (scratch_free) cudaEventDestroy(scratch_free);
    if (dl.copied) cudaEventDestroy(dl.copied);
    if (side) cudaStreamDestroy(side);
    if (s) cudaStreamDestroy(s);
  }

  static void grow(DeviceBuffer& b, size_t bytes) {
    if (b.bytes() < bytes) b.resize(bytes);
  }

  // The recipe's and the engine's attention-side hc products stacked (48 x 4E); the two alone are dropped.
  static void stack_attn_hc(Layer& L) {
    const size_t a = L.r_hc_fn.bytes(), b = L.hc_attn_fn.bytes();
    L.hc_attn_fns.resize(a + b);
    PDB_CUDA_CHECK(cudaMemcpy(L.hc_attn_fns.get(), L.r_hc_fn.get(), a, cudaMemcpyDeviceToDevice));
    PDB_CUDA_CHECK(cudaMemcpy(L.hc_attn_fns.as<uint8_t>() + a, L.hc_attn_fn.get(), b, cudaMemcpyDeviceToDevice));
    L.r_hc_fn.release();
    L.hc_attn_fn.release();
  }

  void project(const SectionProjection& P, const float* x_f32, const int8_t* x_q, const float* x_d, int64_t n, float* y) {
    if (P.q8) cuda::q8_block_gemm(x_q, x_d, P.w.as<int8_t>(), P.d.as<float>(), y, n, P.in, P.out, s);
    else gemm.xwt(cuda::DType::F32, x_f32, P.w.get(), cuda::DType::F32, y, n, P.in, P.out, 0.0f, s);
  }

  // Drops all but the last `keep` rows (of row_bytes) of a buffer holding `rows`.
  void keep_last(DeviceBuffer& b, int64_t& rows, int64_t keep, size_t row_bytes) {
    if (rows <= keep) return;
    const size_t bytes = size_t(keep) * row_bytes;
    if (bytes) {
      grow(shift_tmp, bytes);
      PDB_CUDA_CHECK(cudaMemcpyAsync(shift_tmp.get(), b.as<uint8_t>() + size_t(rows - keep) * row_bytes, bytes, cudaMemcpyDeviceToDevice, s));
      PDB_CUDA_CHECK(cudaMemcpyAsync(b.get(), shift_tmp.get(), bytes, cudaMemcpyDeviceToDevice, s));
    }
    rows = keep;
  }

  // Queues `count` floats at src for the host; `take` gets them there (take_downloads).
  void download(const void* src, int64_t count, std::function<void(const float*)> take) {
    count = std::max<int64_t>(count, 0);
    if (dl.used + size_t(count) > dl.buf.bytes() / 4)
      throw std::logic_error(fmt::format("DSV4 GPU sections: {} floats to download past the {} staged for them", dl.used + size_t(count), dl.buf.bytes() / 4));
    if (count > 0) PDB_CUDA_CHECK(cudaMemcpyAsync(dl.buf.as<float>() + dl.used, src, size_t(count) * 4, cudaMemcpyDeviceToHost, s));
    dl.parts.emplace_back(dl.used, std::move(take));
    dl.used += size_t(count);
  }
  void download(std::vector<float>& out, const void* src, int64_t count) {
    download(src, count, [&out, count](const float* p) { out.assign(p, p + std::max<int64_t>(count, 0)); });
  }
  // Every queued download handed over, once the stream has passed `dl.copied` (recorded after the last).
  void take_downloads() {
    PDB_CUDA_CHECK(cudaEventSynchronize(dl.copied));
    for (auto& [at, take] : dl.parts) take(dl.buf.as<float>() + at);
    dl.parts.clear();
    dl.used = 0;
  }
};

// The decoder's Hadamard rotation of `count` rows of `width` (its groups: recipes/recipe.h k_rotation_size).
void rotate_rows(float* rows, int64_t count, int64_t width, cudaStream_t s);

// Host cos/sin of the layer's RoPE for each of `n` positions pos(i).
template <class Pos>
std::vector<float> rope_table(const GgmlRopeParams& rp, int64_t n, Pos pos) {
  std::vector<float> cs(size_t(n * rp.n_dims));
  for (int64_t i = 0; i < n; ++i) ggml_rope_cache(rp, pos(i), cs.data() + i * rp.n_dims);
  return cs;
}

struct Deepseek4CudaEngine::PromptRun {
  using bf16 = __nv_bfloat16;
  PromptRun(Impl& impl, const Deepseek4Config& config, const std::vector<int32_t>& tokens, int64_t chunk_tokens, GgmlType kt, Profile* prof);
  ~PromptRun() {
    for (auto& e : ev) cudaEventDestroy(e);
  }
  int64_t run(const ChunkHook& hook, const std::function<bool()>& stop, bool compute_last);

  void size_prompt_state();
  void size_scratch();
  void prepare_fp8_experts();
  void size_batches();
  void begin_layer(int64_t layer);
  void sections(Deepseek4LayerSections& S);
  bool hand_over(const ChunkHook& hook, const Deepseek4LayerSections& S);
  void compress(const SectionProjection& wa, const SectionProjection& wg, const DeviceBuffer& ape, const DeviceBuffer& norm, int64_t width,
                int ratio, bool hadamard, Impl::Layer::History& h, DeviceBuffer& rows_out, int64_t& n_out, std::vector<float>& pooled,
                int64_t& first_block, std::vector<float>& ring_kv, std::vector<float>& ring_score);
  void q_path();
  void indexer();
  void attention();
  void output();
  void moe();
  void route_and_gather();
  void routed_experts();
  void fp4_products(const int32_t* counts);
  void shared_expert_and_combine();
  void record_profile();
  // m [rows x n] = x [rows x 4E] . fn^T, f32: a hyper-connection mix's product
  void pre_sum_norm(const float* streams, const float* mix, const DeviceBuffer& norm, float* y, bf16* y_bf16, int8_t* q8 = nullptr,
                    float* q8_scales = nullptr);
  bool f32_on_tensor_cores(const float* x_, const float* w, int64_t k, int64_t n_out, float* y);
  void mix_product(const float* x_, const DeviceBuffer& fn, int64_t n_out, float* m);
  // rows as the decoder stores and the engine reads them: the cache type's values (quantized rows un-rotated:
  // a rotated query against rotated rows is the same dot product), then bf16
  void as_stored(float* rows_, int64_t count, int64_t width, bool rotated, bf16* out);
  void mark(int phase) {
    if (profile) PDB_CUDA_CHECK(cudaEventRecord(ev[phase], s));
  }

  Impl& I;
  const Deepseek4Config& c;
  Profile* profile;
  cudaStream_t s;
  int64_t T, E, D, H, r, W, Id, Hi, Lq, G, R, ogd, NE, K, F, FS, topk, chunk, n;
  float eps, scale;
  int round_kind = 0;
  bool quantized = false;
  Tuning tuning;
  bool fp8_idx = false, fused_idx = false, fused_attn = false, wgmma_attn = false, side_expansion = true, fp8_experts = false, any_q8 = false;
  GgmlRopeParams rp_plain, rp_comp;
  int64_t max_nk = 0, attn_batch = 1, max_blocks = 0, idx_batch = 1;
  // 0-6 phase bounds, 8 the layer's start after the sections, 9-10 around the FP4 expansion, 11-12 the routed
  // experts' products, 13-15 inside the sections, 16 the MoE's routing done
  cudaEvent_t ev[17];
  cuda::EventSpans topk_spans;  // profiled: each query batch's top-k (kIndexerTopk)
  // the chunk and the layer in progress
  int64_t p0 = 0, rows = 0, l = 0;
  const int32_t* tok = nullptr;
  Impl::Layer* layer_ = nullptr;
  const float* cs = nullptr;
  const GgmlRopeParams* rope_ = nullptr;
  bool fp4 = false, experts_fp8 = false, expand_ahead = false;
  float* x = nullptr;
  const float* inv_x = nullptr;
  float* cur = nullptr;
  const int8_t* qx = nullptr;
  const float* dx = nullptr;
};

}  // namespace pdb
