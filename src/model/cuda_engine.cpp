#include "model/cuda_engine.h"
#include "common/tuning.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "common/parallel.h"
#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/elementwise.cuh"
#include "cuda/fp8.cuh"
#include "cuda/gemm.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/rope.cuh"
#include "formats/ggml_types.h"
#include "formats/numeric.h"
#include "formats/safetensors.h"
#include "cuda/tp_comm.cuh"
#include "model/cuda_engine_load.h"

namespace pdb {

using cuda::DeviceBuffer;
using bf16 = __nv_bfloat16;


namespace cuda_load {

// HF tensor -> bf16 bytes (bf16 as is; f32/f16 rounded; block FP8 dequantized with its scales).
std::vector<uint16_t> to_bf16(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::string& name, int64_t rows, int64_t cols,
                              int threads) {
  const StTensor& t = ck.get(name);
  if (t.shape.size() != 2 || t.shape[0] != rows || t.shape[1] != cols)
    throw std::runtime_error(fmt::format("{}: shape does not match config.json ({} x {})", name, rows, cols));
  std::vector<uint16_t> out(size_t(rows * cols));
  const int64_t n = rows * cols;
  switch (t.dtype) {
    case StDtype::BF16: std::memcpy(out.data(), t.data, size_t(n) * 2); break;
    case StDtype::F16:
      parallel_for(n, threads, [&](int64_t b, int64_t e) {
        const auto* s = reinterpret_cast<const uint16_t*>(t.data);
        for (int64_t i = b; i < e; ++i) out[size_t(i)] = f32_to_bf16(fp16_to_f32(s[i]));
      });
      break;
    case StDtype::F32:
      parallel_for(n, threads, [&](int64_t b, int64_t e) {
        const auto* s = reinterpret_cast<const float*>(t.data);
        for (int64_t i = b; i < e; ++i) out[size_t(i)] = f32_to_bf16(s[i]);
      });
      break;
    case StDtype::F8_E4M3: {
      const std::string sname = name.substr(0, name.size() - 6) + "weight_scale_inv";
      if (!ck.find(sname)) throw std::runtime_error(name + " is FP8 but " + sname + " is missing");
      auto s = ck.to_f32(sname);
      std::vector<float> w(static_cast<size_t>(n));
      dequantize_block_fp8(t.data, rows, cols, s.data(), c.fp8_block_rows, c.fp8_block_cols, w.data());
      parallel_for(n, threads, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) out[size_t(i)] = f32_to_bf16(w[size_t(i)]); });
      break;
    }
    default: throw std::runtime_error(fmt::format("{}: dtype {} not supported by the CUDA engine", name, st_dtype_name(t.dtype)));
  }
  return out;
}

DeviceBuffer upload_f32(const std::vector<float>& v) {
  DeviceBuffer b(v.size() * 4);
  b.upload(v.data(), v.size() * 4);
  return b;
}

// Uploads tensors stacked along their output dimension into one bf16 buffer.
DeviceBuffer upload_stacked(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::vector<std::pair<std::string, int64_t>>& parts,
                            int64_t cols, int threads, size_t& total) {
  int64_t rows = 0;
  for (const auto& p : parts) rows += p.second;
  DeviceBuffer b(size_t(rows * cols) * 2);
  size_t off = 0;
  for (const auto& [name, r] : parts) {
    auto w = to_bf16(ck, c, name, r, cols, threads);
    b.upload(w.data(), w.size() * 2, off);
    off += w.size() * 2;
  }
  total += b.bytes();
  return b;
}

DeviceBuffer upload_sliced(const SafetensorsCheckpoint& ck, const HfConfig& c, const std::vector<RowSlice>& parts, int64_t full_cols,
                           int64_t col0, int64_t cols, int threads, size_t& total) {
  int64_t rows = 0;
  for (const auto& p : parts) rows += p.rows;
  DeviceBuffer b(size_t(rows * cols) * 2);
  size_t off = 0;
  for (const auto& p : parts) {
    auto w = rows_of(to_bf16(ck, c, p.name, p.full_rows, full_cols, threads), full_cols, p.row0, p.rows);
    if (cols != full_cols) w = cols_of(w, p.rows, full_cols, col0, cols);
    b.upload(w.data(), w.size() * 2, off);
    off += w.size() * 2;
  }
  total += b.bytes();
  return b;
}

}  // namespace cuda_load

using cuda_load::RowSlice;
using cuda_load::upload_sliced;
using cuda_load::to_bf16;
using cuda_load::upload_f32;
using cuda_load::upload_stacked;

namespace {

// Block-FP8 row slices stacked along their output dimension, each restricted to the input columns [col0,
// col0 + cols) (a tensor-parallel rank's; slices on 128-blocks): e4m3 bytes as they are, and the checkpoint's
// [out/128 x in/128] scale grids (weight_scale_inv: w = code * scale) cut and concatenated the same way and
// written in the order the product reads them.
void upload_sliced_fp8(const SafetensorsCheckpoint& ck, const std::vector<RowSlice>& parts, int64_t full_cols, int64_t col0, int64_t cols,
                       const cuda::Fp8ScaleLayout& L, DeviceBuffer& w, DeviceBuffer& scales, size_t& total) {
  if (col0 % 128 || cols % 128) throw std::invalid_argument("FP8 weights are sliced on 128-column blocks");
  int64_t rows = 0;
  for (const auto& p : parts) {
    if (p.row0 % 128 || p.rows % 128) throw std::invalid_argument(p.name + ": FP8 weights are sliced on 128-row blocks");
    rows += p.rows;
  }
  const int64_t FKB = full_cols / 128, KB = cols / 128, kb0 = col0 / 128, NB = rows / 128;
  w.resize(size_t(rows * cols));
  std::vector<float> grid(size_t(L.weight_scale_count(NB, KB)), 0.0f);
  size_t off = 0;
  int64_t nb0 = 0;
  for (const auto& p : parts) {
    const StTensor& t = ck.get(p.name);
    if (t.dtype != StDtype::F8_E4M3 || t.shape.size() != 2 || t.shape[0] != p.full_rows || t.shape[1] != full_cols)
      throw std::runtime_error(fmt::format("{}: expected F8_E4M3 [{} x {}]", p.name, p.full_rows, full_cols));
    const auto* codes = static_cast<const uint8_t*>(t.data);
    std::vector<uint8_t> slice(size_t(p.rows * cols));
    for (int64_t r = 0; r < p.rows; ++r) std::memcpy(&slice[size_t(r * cols)], codes + (p.row0 + r) * full_cols + col0, size_t(cols));
    w.upload(slice.data(), slice.size(), off);
    off += slice.size();
    const auto s = ck.to_f32(p.name.substr(0, p.name.size() - 6) + "weight_scale_inv");
    if (int64_t(s.size()) != (p.full_rows / 128) * FKB) throw std::runtime_error(p.name + ": weight_scale_inv does not hold one scale per 128x128 block");
    for (int64_t nb = 0; nb < p.rows / 128; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb)
        grid[size_t(L.weight_index(nb0 + nb, kb, NB, KB))] = s[size_t((p.row0 / 128 + nb) * FKB + kb0 + kb)];
    nb0 += p.rows / 128;
  }
  scales.resize(grid.size() * 4);
  scales.upload(grid.data(), grid.size() * 4);
  total += w.bytes() + scales.bytes();
}

// Why the FP8 products cannot run for this checkpoint ("" when they can).
std::string fp8_unsupported(const HfConfig& c, const SafetensorsCheckpoint& ck) {
  if (!c.fp8) return "not an FP8 checkpoint";
  if (c.moe() || c.mla()) return "the MoE/MLA engine runs bf16 products";
  if (c.fp8_block_rows != 128 || c.fp8_block_cols != 128)
    return fmt::format("weight_block_size [{}, {}] (the products take [128, 128])", c.fp8_block_rows, c.fp8_block_cols);
  for (int64_t d : {c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim})
    if (d % 128) return fmt::format("a dimension of {} is not a multiple of 128", d);
  for (const char* n : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    if (ck.get(fmt::format("model.layers.0.{}.weight", n)).dtype != StDtype::F8_E4M3) return fmt::format("{} is not F8_E4M3", n);
  if (Tuning::from_env().fp8 == "0") return "PDBRIDGE_FP8=0";
  return "";
}

}  // namespace

CudaEngine::CudaEngine(const std::string& hf_dir, int threads, bool kv_fp8, cuda::TpComm* tp)
    : cfg_(HfConfig::load(hf_dir)), w_(std::make_unique<Weights>()), kv_fp8_(kv_fp8), tp_(tp) {
  const auto& c = cfg_;
  const int world = tp ? tp->world() : 1;
  if (world > 1 && c.mla()) throw std::runtime_error("CUDA engine: tensor parallel is not implemented for MLA (deepseek2) yet");
  // FP8 weights are cut on their 128x128 scale blocks
  if (!c.mla()) shard_ = tp_shard(c, tp ? tp->rank() : 0, world, world > 1 && c.fp8 ? 128 : 8);
  if (c.mla()) {
    if (c.qk_nope_head_dim != 128 || c.qk_rope_head_dim != 64 || c.v_head_dim != 128)
      throw std::runtime_error(fmt::format("CUDA engine: MLA head widths nope {} / rope {} / v {} not supported (128 / 64 / 128, DeepSeek-V2's)",
                                           c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim));
  } else if (c.head_dim != 64 && c.head_dim != 128) {
    throw std::runtime_error(fmt::format("CUDA engine: head_dim {} not supported (64, 128)", c.head_dim));
  }
  if (c.hidden_size % 8 || c.intermediate_size % 8) throw std::runtime_error("CUDA engine: hidden and intermediate sizes must be multiples of 8");
  if (c.attention_bias) throw std::runtime_error("CUDA engine: attention biases are not supported");
  if (cuda::device_count() == 0) throw std::runtime_error("CUDA engine: no CUDA device");
  if (kv_fp8 && c.mla()) throw std::runtime_error("CUDA engine: fp8 K/V is not implemented for MLA (deepseek2)");
  if (kv_fp8) {
    if (Tuning::from_env().fp8kv_fused == "1") fp8kv_fused_ = true;
    cuda::AttentionShape probe;
    probe.head_dim = int(c.head_dim);
    if (!cuda::wgmma_attention_supported(probe))
      throw std::runtime_error(fmt::format("CUDA engine: fp8 K/V needs head_dim 128 on an sm_90 GPU (this model: head_dim {}; {})", c.head_dim,
                                           cuda::device_summary()));
  }
  PDB_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gemm_ = std::make_unique<cuda::Gemm>();
  auto ck = SafetensorsCheckpoint::open(hf_dir);
  const int64_t H = c.hidden_size, hd = c.head_dim;
  const StDtype wdt = ck->get(c.mla() ? "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" : "model.layers.0.self_attn.k_proj.weight").dtype;
  weights_note_ = wdt == StDtype::BF16 ? "bf16 weights" : fmt::format("{} weights converted to bf16 on load", st_dtype_name(wdt));
  if (c.fp8) {
    std::string why = fp8_unsupported(c, *ck), report;
    if (why.empty()) {
      fp8_ = cuda::probe_fp8_layout(*gemm_, &report);
      if (!fp8_) why = report;
    }
    weights_note_ = fp8_ ? report : "block-FP8 weights dequantized to bf16 (" + why + ")";
  }
  size_t total = 0;
  {
    const StTensor& et = ck->get("model.embed_tokens.weight");
    if (et.shape.size() != 2 || et.shape[0] != c.vocab_size || et.shape[1] != H) throw std::runtime_error("model.embed_tokens.weight: shape does not match config.json");
    if (et.dtype == StDtype::F8_E4M3) throw std::runtime_error("model.embed_tokens.weight: FP8 embeddings are not supported");
    auto e = ck->to_f32("model.embed_tokens.weight");
    w_->embed = upload_f32(e);
    total += w_->embed.bytes();
  }
  if (c.mla()) load_mla(*ck, threads, total);
  for (int64_t l = 0; l < (c.mla() ? 0 : c.num_layers); ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    Weights::Layer L;
    L.in_norm = upload_f32(ck->to_f32(p + "input_layernorm.weight"));
    L.post_norm = upload_f32(ck->to_f32(p + "post_attention_layernorm.weight"));
    if (c.qk_norm()) {
      L.q_norm = upload_f32(ck->to_f32(p + "self_attn.q_norm.weight"));
      L.k_norm = upload_f32(ck->to_f32(p + "self_attn.k_norm.weight"));
    }
    // this rank's heads (q, then k, then v) and FFN columns (gate rows, then up rows): all of them without TP
    const TpShard& sh = shard_;
    const int64_t nh = c.num_heads, nkv = c.num_kv_heads, F = c.intermediate_size;
    const std::vector<RowSlice> qkv = {{p + "self_attn.q_proj.weight", nh * hd, sh.q_head0 * hd, sh.q_heads * hd},
                                       {p + "self_attn.k_proj.weight", nkv * hd, sh.kv_head0 * hd, sh.kv_heads * hd},
                                       {p + "self_attn.v_proj.weight", nkv * hd, sh.kv_head0 * hd, sh.kv_heads * hd}};
    const std::vector<RowSlice> o = {{p + "self_attn.o_proj.weight", H, 0, H}};
    const std::vector<RowSlice> gu = {{p + "mlp.gate_proj.weight", F, sh.ff0, sh.ff}, {p + "mlp.up_proj.weight", F, sh.ff0, sh.ff}};
    const std::vector<RowSlice> d = {{p + "mlp.down_proj.weight", H, 0, H}};
    if (fp8_) {
      upload_sliced_fp8(*ck, qkv, H, 0, H, *fp8_, L.wqkv, L.wqkv_s, total);
      upload_sliced_fp8(*ck, o, nh * hd, sh.q_head0 * hd, sh.q_heads * hd, *fp8_, L.wo, L.wo_s, total);
      upload_sliced_fp8(*ck, gu, H, 0, H, *fp8_, L.wgu, L.wgu_s, total);
      upload_sliced_fp8(*ck, d, F, sh.ff0, sh.ff, *fp8_, L.wd, L.wd_s, total);
    } else {
      L.wqkv = upload_sliced(*ck, c, qkv, H, 0, H, threads, total);
      L.wo = upload_sliced(*ck, c, o, nh * hd, sh.q_head0 * hd, sh.q_heads * hd, threads, total);
      if (c.moe()) {
        L.moe = std::make_unique<CudaMoeWeights>(load_cuda_moe(*ck, c, p, threads, sh.expert_ff0, sh.expert_ff));
        total += L.moe->bytes();
      } else {
        L.wgu = upload_sliced(*ck, c, gu, H, 0, H, threads, total);
        L.wd = upload_sliced(*ck, c, d, F, sh.ff0, sh.ff, threads, total);
      }
    }
    w_->layers.push_back(std::move(L));
  }
  if (!c.mla()) {  // MLA's RoPE angles come from numerics/mla_rope.h per chunk
    std::vector<float> inv;
    for (double f : c.inv_freq()) inv.push_back(float(f));
    w_->inv_freq = upload_f32(inv);
  }
  weight_bytes_ = total;
  if (world > 1) weights_note_ += fmt::format("; tensor parallel rank {} of {} ({} of {} heads)", shard_.rank, world, shard_.q_heads, c.num_heads);
  spdlog::info("cuda engine: {} layers, {:.2f} GiB of weights on {} ({})", c.num_layers, double(total) / (1 << 30), cuda::device_summary(), weights_note_);
}

CudaEngine::~CudaEngine() {
  w_.reset();
  gemm_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

size_t CudaEngine::bytes_for_prompt(int64_t T, int64_t chunk) const {
  const auto& c = cfg_;
  if (c.mla()) return bytes_for_prompt_mla(T, chunk);
  const int64_t H = c.hidden_size, F = shard_.ff, hd = c.head_dim, nh = shard_.q_heads, nkv = shard_.kv_heads;
  chunk = std::min(chunk, T);
  const size_t per_row = kv_fp8_ ? size_t(hd) + 4 : size_t(hd) * 2;  // fp8: codes + one scale per head row
  size_t kv = size_t(2) * size_t(std::max<int64_t>(c.num_layers - 1, 1)) * size_t(nkv * T) * per_row;
  if (kv_fp8_ && !fp8kv_fused_) kv += size_t(2) * size_t(nkv * T * hd) * 2;  // one layer's rows expanded to bf16
  size_t work = size_t(chunk) * size_t(4 + H * 4 + H * 2 + (nh + 2 * nkv) * hd * 2 + 2 * nh * hd * 2 + (c.moe() ? 0 : 2 * F * 2 + F * 2));
  if (c.moe()) work += CudaMoeFfn::bytes_for(c, chunk);  // (the whole experts' width: an upper bound for a rank)
  if (fp8_) {
    const int64_t K = std::max({H, nh * hd, F}), rows = fp8_->padded_rows(chunk);
    work += size_t(rows - chunk) * size_t(H * 4 + H * 2 + (nh + 2 * nkv) * hd * 2 + nh * hd * 2 + 2 * F * 2 + F * 2) + size_t(rows * K) +
            cuda::fp8_scale_bytes(rows, K, *fp8_) + size_t(rows * H) * 2;
  }
  return kv + work;
}

void CudaEngine::check_fits(int64_t T, int64_t chunk, size_t extra) const {
  const size_t need = bytes_for_prompt(T, chunk) + extra;
  const auto mem = cuda::device_memory();
  // What is already ours counts as available (the buffers are reused).
  const size_t ours = w_->buffer_bytes();
  const size_t margin = size_t(512) << 20;
  if (need + margin > mem.free + ours)
    throw std::runtime_error(fmt::format("prompt of {} tokens needs {:.1f} GiB of GPU memory for the engine's K/V and buffers; "
                                         "{:.1f} GiB is free on {} (weights take {:.1f} GiB): use a shorter prompt or a smaller chunk",
                                         T, double(need) / (1 << 30), double(mem.free + ours) / (1 << 30), cuda::device_summary(),
                                         double(weight_bytes_) / (1 << 30)));
}

namespace {
// The engine's K/V of positions [0, tokens) per cached layer, compact ([layer][kv head][position][head_dim]), in
// device memory of its own; fp8 K/V with their per-row scales.
struct CudaEngineState final : EngineState {
  cuda::DeviceBuffer k, v, ks, vs;
  int64_t layers = 0, nkv = 0, hd = 0, elem = 2;
  size_t bytes() const override { return k.bytes() + v.bytes() + ks.bytes() + vs.bytes(); }
};

// [layers][heads][rows of `row_bytes`]: the first `n` rows of every (layer, head) from a buffer of `src_rows`
// per head into one of `dst_rows` per head.
void copy_head_rows(void* dst, int64_t dst_rows, const void* src, int64_t src_rows, int64_t layers, int64_t heads, int64_t n,
                    int64_t row_bytes, cudaStream_t s) {
  if (n <= 0) return;
  PDB_CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(dst_rows * row_bytes), src, size_t(src_rows * row_bytes), size_t(n * row_bytes),
                                   size_t(layers * heads), cudaMemcpyDeviceToDevice, s));
}
}  // namespace

int64_t CudaEngine::prefill(const std::vector<int32_t>& tokens, int64_t chunk, const DeviceHook& hook,
                            const std::function<bool()>& cancelled, bool full_last_layer, bool skip_attention, ResumePoint resume,
                            std::shared_ptr<EngineState>* keep, size_t keep_max_bytes) {
  const auto& c = cfg_;
  const int64_t T = int64_t(tokens.size()), H = c.hidden_size, hd = c.head_dim, L = c.num_layers;
  // this rank's share (everything without tensor parallelism)
  const int64_t F = shard_.ff, nh = shard_.q_heads, nkv = shard_.kv_heads;
  if (T == 0) return 0;
  if (chunk <= 0) chunk = 2048;
  chunk = std::min(chunk, T);
  for (int32_t t : tokens)
    if (t < 0 || t >= c.vocab_size) throw std::invalid_argument(fmt::format("token id {} outside the vocabulary ({})", t, c.vocab_size));
  if (c.mla()) {
    if (resume.tokens > 0 || keep) throw std::invalid_argument("the deepseek2 forward does not resume from a prefix state");
    return prefill_mla(tokens, chunk, hook, cancelled, full_last_layer, skip_attention);
  }
  check_fits(T, chunk);
  auto& W = *w_;
  const int64_t cache_layers = full_last_layer ? L : std::max<int64_t>(L - 1, 1);
  const int64_t elem = kv_fp8_ ? 1 : 2;
  if (W.capacity < T || W.kcache.bytes() < size_t(cache_layers * nkv * T * hd * elem)) {
    W.kcache.release();
    W.vcache.release();
    W.kscale.release();
    W.vscale.release();
    W.kx.release();
    W.vx.release();
    W.kcache.resize(size_t(cache_layers * nkv * T * hd * elem));
    W.vcache.resize(size_t(cache_layers * nkv * T * hd * elem));
    if (kv_fp8_) {
      W.kscale.resize(size_t(cache_layers * nkv * T) * 4);
      W.vscale.resize(size_t(cache_layers * nkv * T) * 4);
      if (!fp8kv_fused_) {
        W.kx.resize(size_t(nkv * T * hd) * 2);
        W.vx.resize(size_t(nkv * T * hd) * 2);
      }
    }
    W.capacity = T;
  }
  const int64_t cap = W.capacity;
  const int64_t qkv_dim = (nh + 2 * nkv) * hd;
  // FP8 products may need their rows padded: the buffers they read and write hold the padded rows
  // (the extra rows carry stale values whose results are never read).
  const int64_t rows_cap = fp8_ ? fp8_->padded_rows(chunk) : chunk;
  W.tokens.resize(size_t(chunk) * 4);
  W.h.resize(size_t(rows_cap * H) * 4);
  W.x.resize(size_t(rows_cap * H) * 2);
  W.qkv.resize(size_t(rows_cap * qkv_dim) * 2);
  W.q.resize(size_t(chunk * nh * hd) * 2);
  W.att.resize(size_t(rows_cap * nh * hd) * 2);
  if (!c.moe()) {
    W.gu.resize(size_t(rows_cap * 2 * F) * 2);
    W.act.resize(size_t(rows_cap * F) * 2);
  }
  cudaStream_t s = stream_;
  auto& gemm = *gemm_;
  if (fp8_) {
    const int64_t K = std::max({H, nh * hd, F});
    W.xq.resize(size_t(rows_cap * K));
    W.xs.resize(cuda::fp8_scale_bytes(rows_cap, K, *fp8_));
    if (!fp8_->f32_accumulate) W.ybf.resize(size_t(rows_cap * H) * 2);
  }
  // Y = X W^T for a bf16 activation X [n x in]: a bf16 product, or on the FP8 path X quantized per
  // 1x128 block and a block-scaled FP8 product. beta = 1 adds into the f32 residual.
  auto mm = [&](const void* x, const DeviceBuffer& w, const DeviceBuffer& ws, int64_t n, int64_t in, int64_t out, cuda::DType yt, void* y,
                float beta) {
    if (!fp8_) return gemm.xwt(cuda::DType::BF16, x, w.get(), yt, y, n, in, out, beta, s);
    n = fp8_->padded_rows(n);
    cuda::quantize_rows_fp8(static_cast<const bf16*>(x), n, in, W.xq.as<uint8_t>(), W.xs.as<float>(), *fp8_, s);
    if (beta != 0.0f && !fp8_->f32_accumulate) {
      gemm.xwt_fp8(*fp8_, W.xq.as<uint8_t>(), W.xs.as<float>(), w.as<uint8_t>(), ws.as<float>(), cuda::DType::BF16, W.ybf.get(), n, in, out,
                   0.0f, s);
      return cuda::add_bf16_into_f32(W.ybf.as<bf16>(), static_cast<float*>(y), n * out, s);
    }
    gemm.xwt_fp8(*fp8_, W.xq.as<uint8_t>(), W.xs.as<float>(), w.as<uint8_t>(), ws.as<float>(), yt, y, n, in, out, beta, s);
  };
  const float eps = float(c.rms_norm_eps);
  // Tensor parallel: once a block's normed input is taken, rank 0 keeps the residual and the other ranks
  // zero theirs; each adds its heads' (its columns') part of o_proj's (down_proj's) product into it, and the
  // sum over the ranks is the unsharded residual, on every rank. The rows past n (FP8 padding) are never read.
  const bool tp = tp_ && tp_->world() > 1;
  int64_t rows_now = 0;
  auto partial_residual = [&] {
    if (tp && tp_->rank() != 0) PDB_CUDA_CHECK(cudaMemsetAsync(W.h.get(), 0, size_t(rows_now * H) * 4, s));
  };
  auto reduce_residual = [&] {
    if (tp) tp_->all_reduce_sum(W.h.as<float>(), size_t(rows_now * H), s);
  };
  // Kernel arguments that only change per chunk (rows, positions) or per layer (qwen3's norms).
  cuda::QkvRopeArgs ra;
  ra.n_heads = int(nh);
  ra.n_kv_heads = int(nkv);
  ra.head_dim = int(hd);
  ra.inv_freq = W.inv_freq.as<float>();
  ra.attn_scale = float(c.attention_scaling());
  ra.eps = eps;
  ra.kv_capacity = cap;
  cuda::AttentionShape as;
  as.n_heads = int(nh);
  as.n_kv_heads = int(nkv);
  as.head_dim = int(hd);
  as.kv_capacity = cap;
  as.scale = 1.0f / std::sqrt(float(hd));
  // A cached prefix's K/V back into the cache (the cache's rows per head are `cap`, the state's its tokens).
  const int64_t start = resume.tokens;
  if (start > 0) {
    const auto* st = dynamic_cast<const CudaEngineState*>(resume.state);
    if (!st || st->layers != cache_layers || st->nkv != nkv || st->hd != hd || st->elem != elem || st->tokens < start || start > T)
      throw std::invalid_argument("the resume state is not this engine's (layers, heads, K/V dtype)");
    copy_head_rows(W.kcache.get(), cap, st->k.get(), st->tokens, cache_layers, nkv, start, hd * elem, s);
    copy_head_rows(W.vcache.get(), cap, st->v.get(), st->tokens, cache_layers, nkv, start, hd * elem, s);
    if (kv_fp8_) {
      copy_head_rows(W.kscale.get(), cap, st->ks.get(), st->tokens, cache_layers, nkv, start, 4, s);
      copy_head_rows(W.vscale.get(), cap, st->vs.get(), st->tokens, cache_layers, nkv, start, 4, s);
    }
  }
  // The K/V of the positions processed, into device memory of their own (after the forward: nothing is kept
  // when that memory is not there).
  auto keep_state = [&](int64_t processed) {
    if (!keep || processed <= 0) return;
    // a state the prefix cache would refuse is not copied at all (a 1M-token prompt's K/V is tens of GB)
    if (size_t(cache_layers * nkv * processed) * size_t(hd * elem + (kv_fp8_ ? 4 : 0)) * 2 > keep_max_bytes) return;
    try {
      auto st = std::make_shared<CudaEngineState>();
      st->tokens = processed;
      st->layers = cache_layers;
      st->nkv = nkv;
      st->hd = hd;
      st->elem = elem;
      st->k.resize(size_t(cache_layers * nkv * processed * hd * elem));
      st->v.resize(st->k.bytes());
      copy_head_rows(st->k.get(), processed, W.kcache.get(), cap, cache_layers, nkv, processed, hd * elem, s);
      copy_head_rows(st->v.get(), processed, W.vcache.get(), cap, cache_layers, nkv, processed, hd * elem, s);
      if (kv_fp8_) {
        st->ks.resize(size_t(cache_layers * nkv * processed) * 4);
        st->vs.resize(st->ks.bytes());
        copy_head_rows(st->ks.get(), processed, W.kscale.get(), cap, cache_layers, nkv, processed, 4, s);
        copy_head_rows(st->vs.get(), processed, W.vscale.get(), cap, cache_layers, nkv, processed, 4, s);
      }
      PDB_CUDA_CHECK(cudaStreamSynchronize(s));
      *keep = std::move(st);
    } catch (const std::exception& e) {
      cudaGetLastError();
      spdlog::warn("cuda engine: the prompt's K/V ({} tokens) not kept for the prefix cache: {}", processed, e.what());
    }
  };
  for (int64_t p0 = start; p0 < T; p0 += chunk) {
    const int64_t n = std::min(chunk, T - p0);
    rows_now = n;
    ra.rows = as.n_q = n;
    ra.pos0 = as.pos0 = p0;
    PDB_CUDA_CHECK(cudaMemcpyAsync(W.tokens.get(), tokens.data() + p0, size_t(n) * 4, cudaMemcpyHostToDevice, s));
    float* h = W.h.as<float>();
    cuda::embed_rows(W.embed.as<float>(), W.tokens.as<int32_t>(), n, H, h, s);
    for (int64_t l = 0; l < L; ++l) {
      if (cancelled && cancelled()) {
        PDB_CUDA_CHECK(cudaStreamSynchronize(s));
        keep_state(p0);
        return p0;
      }
      if (hook) hook(int(l), h, n, p0, s);
      if (l == L - 1 && !full_last_layer) break;
      auto& Lw = W.layers[size_t(l)];
      bf16* x = W.x.as<bf16>();
      cuda::rmsnorm_rows_bf16(h, Lw.in_norm.as<float>(), x, n, H, eps, s);
      partial_residual();
      mm(x, Lw.wqkv, Lw.wqkv_s, n, H, qkv_dim, cuda::DType::BF16, W.qkv.get(), 0.0f);
      ra.q_norm = Lw.q_norm.bytes() ? Lw.q_norm.as<float>() : nullptr;
      ra.k_norm = Lw.k_norm.bytes() ? Lw.k_norm.as<float>() : nullptr;
      if (kv_fp8_) {
        ra.k_fp8 = W.kcache.as<uint8_t>() + l * nkv * cap * hd;
        ra.v_fp8 = W.vcache.as<uint8_t>() + l * nkv * cap * hd;
        ra.k_scale = W.kscale.as<float>() + l * nkv * cap;
        ra.v_scale = W.vscale.as<float>() + l * nkv * cap;
        cuda::qkv_rope_to_cache(W.qkv.as<bf16>(), W.q.as<bf16>(), nullptr, nullptr, ra, s);
        if (skip_attention) {
          // bench prefill's engine-no-attention: the expansion and the attention both left out
        } else if (fp8kv_fused_) {
          cuda::causal_attention_fp8kv(W.q.as<bf16>(), ra.k_fp8, ra.v_fp8, ra.k_scale, ra.v_scale, W.att.as<bf16>(), as, s);
        } else {
          // This layer's keys so far back to bf16, then the bf16 kernels unchanged. Converting inside the
          // attention's tile loop instead (the fused kernel) adds a phase behind a block barrier per tile:
          // measured 26% slower than bf16 K/V at 32K. Expanding moves ~7 bytes per fp8 element per layer
          // and chunk (read 1 + scale, write 2 per K and V), small beside the attention over the same keys.
          const int64_t keys = p0 + n;
          cuda::expand_fp8_rows(ra.k_fp8, ra.k_scale, int(nkv), cap, keys, int(hd), W.kx.as<bf16>(), s);
          cuda::expand_fp8_rows(ra.v_fp8, ra.v_scale, int(nkv), cap, keys, int(hd), W.vx.as<bf16>(), s);
          cuda::causal_attention(W.q.as<bf16>(), W.kx.as<bf16>(), W.vx.as<bf16>(), W.att.as<bf16>(), as, s);
        }
      } else {
        bf16* kc = W.kcache.as<bf16>() + l * nkv * cap * hd;
        bf16* vc = W.vcache.as<bf16>() + l * nkv * cap * hd;
        cuda::qkv_rope_to_cache(W.qkv.as<bf16>(), W.q.as<bf16>(), kc, vc, ra, s);
        if (!skip_attention) cuda::causal_attention(W.q.as<bf16>(), kc, vc, W.att.as<bf16>(), as, s);
      }
      mm(W.att.get(), Lw.wo, Lw.wo_s, n, nh * hd, H, cuda::DType::F32, h, 1.0f);
      reduce_residual();
      cuda::rmsnorm_rows_bf16(h, Lw.post_norm.as<float>(), x, n, H, eps, s);
      partial_residual();
      if (Lw.moe) {
        W.moe.forward(*Lw.moe, x, n, h, gemm, s);
      } else {
        mm(x, Lw.wgu, Lw.wgu_s, n, H, 2 * F, cuda::DType::BF16, W.gu.get(), 0.0f);
        cuda::swiglu_rows(W.gu.as<bf16>(), W.act.as<bf16>(), n, F, s);
        mm(W.act.get(), Lw.wd, Lw.wd_s, n, F, H, cuda::DType::F32, h, 1.0f);
      }
      reduce_residual();
    }
  }
  PDB_CUDA_CHECK(cudaStreamSynchronize(s));
  keep_state(T);
  return T;
}

}  // namespace pdb
