#include "model/cuda_engine.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "common/tuning.h"
#include "cuda/common.cuh"
#include "cuda/device.h"
#include "cuda/elementwise.cuh"
#include "cuda/fp8.cuh"
#include "cuda/rmsnorm.cuh"
#include "cuda/tp_comm.cuh"
#include "cuda/dequant.cuh"
#include "formats/safetensors.h"
#include "formats/weight_source.h"
#include "model/cuda_engine_load.h"

namespace pdb {

using cuda::DeviceBuffer;
using bf16 = __nv_bfloat16;

CudaEngine::CudaEngine(const std::string& model, int threads, bool kv_fp8, cuda::TpComm* tp, ProductNumerics numerics)
    : cfg_(model_config(model)), def_(model_definition(cfg_.arch)), numerics_(numerics), kv_fp8_(kv_fp8), tp_(tp) {
  const auto& c = cfg_;
  const int world = tp ? tp->world() : 1;
  if (const std::string why = cuda_blocks_unsupported(def_, c, kv_fp8, world); !why.empty()) throw std::runtime_error("CUDA engine: " + why);
  const bool gguf = is_gguf_path(model);
  if (gguf && world > 1) throw std::runtime_error("CUDA engine: tensor parallel from a GGUF is not implemented (give the HF checkpoint)");
  if (decoder_numerics() && !gguf)
    throw std::invalid_argument(fmt::format("--numerics {}: the decoder's numerics need its GGUF as --model (a checkpoint's weights are not the decoder's)",
                                            product_numerics_name(numerics)));
  // FP8 weights are cut on their 128x128 scale blocks
  shard_ = tp_shard(c, tp ? tp->rank() : 0, world, world > 1 && c.fp8 ? 128 : 8);
  if (cuda::device_count() == 0) throw std::runtime_error("CUDA engine: no CUDA device");
  if (kv_fp8 && Tuning::from_env().fp8kv_fused == "1") fp8kv_fused_ = true;
  PDB_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  gemm_ = std::make_unique<cuda::Gemm>();
  std::unique_ptr<SafetensorsCheckpoint> ck;
  GgufModel g;
  if (gguf) {
    g = gguf_weights(model);
    quant_ = std::make_unique<CudaQuantStore>();
    weights_note_ = "the decoder's GGUF (" + g.weights->type_summary() + ")";
  } else {
    ck = SafetensorsCheckpoint::open(model);
    const StDtype wdt = ck->get("model.layers.0.self_attn.o_proj.weight").dtype;
    weights_note_ = wdt == StDtype::BF16 ? "bf16 weights" : fmt::format("{} weights converted to bf16 on load", st_dtype_name(wdt));
    if (c.fp8) {
      std::string why = cuda_fp8_unsupported(def_, c, *ck), report;
      if (why.empty()) {
        fp8_ = cuda::probe_fp8_layout(*gemm_, &report);
        if (!fp8_) why = report;
      }
      weights_note_ = fp8_ ? report : "block-FP8 weights dequantized to bf16 (" + why + ")";
    }
  }
  if (decoder_numerics()) weights_note_ += "; " + product_numerics_description(numerics_);
  matmul_ = std::make_unique<CudaMatmul>(*gemm_, fp8_, numerics_);
  const CudaLoad ld{ck.get(), g.weights.get(), quant_.get(), c, def_, shard_, world, threads, fp8_, numerics_};
  size_t total = load_embedding(ld);
  attention_ = load_cuda_attention(ld, CudaAttentionOptions{kv_fp8, fp8kv_fused_}, *matmul_);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    in_norm_.push_back(cuda_load::upload_f32(cuda_load::vector(ld, p + "input_layernorm.weight", c.hidden_size)));
    post_norm_.push_back(cuda_load::upload_f32(cuda_load::vector(ld, p + "post_attention_layernorm.weight", c.hidden_size)));
    attention_->load_layer(ld, l);
    ffns_.push_back(load_cuda_ffn(ld, l));
    total += ffns_.back()->weight_bytes();
  }
  total += attention_->weight_bytes();
  if (quant_) {
    quant_->finish();
    total += quant_->scratch_bytes();
    weights_note_ += fmt::format("; {:.2f} GiB quantized, expanded per layer into {:.0f} MiB", double(quant_->quant_bytes()) / (1 << 30),
                                 double(quant_->scratch_bytes()) / (1 << 20));
  }
  weight_bytes_ = total;
  if (world > 1) weights_note_ += fmt::format("; tensor parallel rank {} of {} ({} of {} heads)", shard_.rank, world, shard_.q_heads, c.num_heads);
  spdlog::info("cuda engine: {} layers, {:.2f} GiB of weights on {} ({})", c.num_layers, double(total) / (1 << 30), cuda::device_summary(), weights_note_);
}

// The token table: a checkpoint's as f32 (exact for every dtype); a GGUF's as it stores it, rows decoded per chunk.
size_t CudaEngine::load_embedding(const CudaLoad& ld) {
  const auto& c = cfg_;
  const std::string name = "model.embed_tokens.weight";
  if (ld.gguf) {
    auto raw = ld.gguf->raw_rows(name, c.vocab_size, c.hidden_size);
    if (!raw) throw std::runtime_error(name + ": the GGUF holds no token table");
    if (c.hidden_size % cuda::dequant_group_elements(raw->type)) throw std::runtime_error(name + ": rows are not whole blocks of its type");
    embed_type_ = raw->type;
    embed_row_bytes_ = int64_t(ggml_row_bytes(raw->type, c.hidden_size));
    embed_.resize(raw->bytes.size());
    embed_.upload(raw->bytes.data(), raw->bytes.size());
    return embed_.bytes();
  }
  const StTensor& et = ld.ck->get(name);
  if (et.shape.size() != 2 || et.shape[0] != c.vocab_size || et.shape[1] != c.hidden_size) throw std::runtime_error(name + ": shape does not match config.json");
  if (et.dtype == StDtype::F8_E4M3) throw std::runtime_error(name + ": FP8 embeddings are not supported");
  embed_ = cuda_load::upload_f32(ld.ck->to_f32(name));
  return embed_.bytes();
}

CudaEngine::~CudaEngine() {
  attention_.reset();
  ffns_.clear();
  matmul_.reset();
  gemm_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

int64_t CudaEngine::widest_swiglu() const {
  int64_t f = 0;
  for (const auto& ffn : ffns_) f = std::max(f, ffn->swiglu_width());
  return f;
}

bool CudaEngine::any_routed() const {
  return std::any_of(ffns_.begin(), ffns_.end(), [](const auto& f) { return f->routed(); });
}

// The FFNs' own widths count: a MoE model's shard has no dense columns (shard_.ff = 0), yet deepseek2's leading dense
// layers (10,944 wide in V2-Lite) and its shared experts multiply through the same scratch.
int64_t CudaEngine::widest_product_input() const { return std::max({cfg_.hidden_size, shard_.q_heads * cfg_.head_dim, shard_.ff, widest_swiglu()}); }

int64_t CudaEngine::widest_bf16_product() const { return (shard_.q_heads + 2 * shard_.kv_heads) * cfg_.head_dim; }

size_t CudaEngine::buffer_bytes() const {
  return tokens_.bytes() + h_.bytes() + x_.bytes() + xf_.bytes() + xh_.bytes() + attention_->buffer_bytes() + ffn_scratch_.bytes() + matmul_->scratch_bytes();
}

size_t CudaEngine::bytes_for_prompt(int64_t T, int64_t chunk) const {
  const int64_t H = cfg_.hidden_size, F = widest_swiglu();
  chunk = std::min(chunk, T);
  const int64_t rows = matmul_->padded_rows(chunk);
  size_t b = attention_->prompt_bytes(T, chunk, std::max<int64_t>(cfg_.num_layers - 1, 1));
  const size_t act = decoder_numerics() ? 4 : 2;  // the SwiGLU's gate|up and output: f32 under the decoder's numerics
  b += size_t(chunk) * size_t(4 + H * 4 + H * 2) + size_t(rows - chunk) * size_t(H * 4 + H * 2) + size_t(rows) * size_t(3 * F) * act;
  if (decoder_numerics()) b += size_t(chunk * H) * 6;  // the f32 rows (xf_) and the half ones (xh_)
  if (any_routed()) b += CudaMoeFfn::bytes_for(cfg_, chunk);  // (the whole experts' width: an upper bound for a rank)
  return b + matmul_->scratch_bytes_for(chunk, widest_product_input(), H, widest_bf16_product());
}

int64_t CudaEngine::default_chunk() const {
  int64_t chunk = 4096;  // fills a dense layer's products
  for (const auto& f : ffns_) chunk = std::max(chunk, f->full_products_chunk());
  return chunk;
}

void CudaEngine::check_fits(int64_t T, int64_t chunk, size_t extra) const {
  const size_t need = bytes_for_prompt(T, chunk) + extra;
  const auto mem = cuda::device_memory();
  // What is already ours counts as available (the buffers are reused).
  const size_t ours = buffer_bytes();
  const size_t margin = size_t(512) << 20;
  size_t available = mem.free + ours;
  std::string where = cuda::device_summary();
  if (memory_cap_) {
    const size_t held = mem.total - mem.free - std::min(ours, mem.total - mem.free);  // what stays allocated beside our buffers
    available = std::min(available, memory_cap_ > held ? memory_cap_ - held : 0);
    where += fmt::format(" under the {:.1f} GiB cap", double(memory_cap_) / (1 << 30));
  }
  if (need + margin > available)
    throw std::runtime_error(fmt::format("prompt of {} tokens needs {:.1f} GiB of GPU memory for the engine's K/V and buffers; "
                                         "{:.1f} GiB is free on {} (weights take {:.1f} GiB): use a shorter prompt or a smaller chunk",
                                         T, double(need) / (1 << 30), double(available) / (1 << 30), where, double(weight_bytes_) / (1 << 30)));
}

void CudaEngine::set_memory_cap(size_t bytes) {
  const auto mem = cuda::device_memory();
  if (bytes && mem.total - mem.free > bytes)
    throw std::runtime_error(fmt::format("--max-gpu-mem {:.1f} GiB: {:.1f} GiB is in use on {} once the weights are loaded ({:.1f} GiB of them)",
                                         double(bytes) / (1 << 30), double(mem.total - mem.free) / (1 << 30), cuda::device_summary(),
                                         double(weight_bytes_) / (1 << 30)));
  memory_cap_ = bytes;
}

void CudaEngine::reserve(int64_t T, int64_t chunk, int64_t cache_layers) {
  const int64_t H = cfg_.hidden_size, F = widest_swiglu(), rows_cap = matmul_->padded_rows(chunk);
  attention_->reserve(T, chunk, cache_layers);
  tokens_.resize(size_t(chunk) * 4);
  h_.resize(size_t(rows_cap * H) * 4);
  x_.resize(size_t(rows_cap * H) * 2);
  if (decoder_numerics()) {
    xf_.resize(size_t(rows_cap * H) * 4);
    xh_.resize(size_t(rows_cap * H) * 2);
  }
  const size_t act = decoder_numerics() ? 4 : 2;
  if (F > 0) {
    ffn_scratch_.gu.resize(size_t(rows_cap * 2 * F) * act);
    ffn_scratch_.act.resize(size_t(rows_cap * F) * act);
  }
  matmul_->reserve(chunk, widest_product_input(), H, widest_bf16_product());
}

namespace {
// The engine's K/V of positions [0, tokens) per cached layer, compact ([layer][head][position][row]), in device
// memory of its own; fp8 K/V with their per-row scales.
struct CudaEngineState final : EngineState {
  cuda::DeviceBuffer k, v, ks, vs;
  int64_t layers = 0, heads = 0, k_row_bytes = 0, v_row_bytes = 0;
  bool scales = false;
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

// A cached prefix's K/V back into the cache (the cache's rows per head are its capacity, the state's its tokens).
void CudaEngine::resume_from(ResumePoint resume, int64_t T) {
  const int64_t start = resume.tokens;
  if (start <= 0) return;
  CudaKvCache& kv = attention_->kv();
  const auto* st = dynamic_cast<const CudaEngineState*>(resume.state);
  if (!st || st->layers != kv.layers || st->heads != kv.heads || st->k_row_bytes != kv.k_row_bytes || st->v_row_bytes != kv.v_row_bytes ||
      st->scales != kv.scales || st->tokens < start || start > T)
    throw std::invalid_argument("the resume state is not this engine's (layers, heads, K/V dtype)");
  const int64_t cap = kv.capacity;
  copy_head_rows(kv.k.get(), cap, st->k.get(), st->tokens, kv.layers, kv.heads, start, kv.k_row_bytes, stream_);
  copy_head_rows(kv.v.get(), cap, st->v.get(), st->tokens, kv.layers, kv.heads, start, kv.v_row_bytes, stream_);
  if (kv.scales) {
    copy_head_rows(kv.ks.get(), cap, st->ks.get(), st->tokens, kv.layers, kv.heads, start, 4, stream_);
    copy_head_rows(kv.vs.get(), cap, st->vs.get(), st->tokens, kv.layers, kv.heads, start, 4, stream_);
  }
}

// The K/V of the positions processed, into device memory of their own (after the forward: nothing is kept when that
// memory is not there).
void CudaEngine::keep_state(int64_t processed, std::shared_ptr<EngineState>* keep, size_t keep_max_bytes) {
  if (!keep || processed <= 0) return;
  const CudaKvCache& kv = attention_->kv();
  const size_t per_position = size_t(kv.k_row_bytes + kv.v_row_bytes + (kv.scales ? 8 : 0));
  // a state the prefix cache would refuse is not copied at all (a 1M-token prompt's K/V is tens of GB)
  if (size_t(kv.layers * kv.heads * processed) * per_position > keep_max_bytes) return;
  try {
    auto st = std::make_shared<CudaEngineState>();
    st->tokens = processed;
    st->layers = kv.layers;
    st->heads = kv.heads;
    st->k_row_bytes = kv.k_row_bytes;
    st->v_row_bytes = kv.v_row_bytes;
    st->scales = kv.scales;
    const int64_t cap = kv.capacity;
    st->k.resize(size_t(kv.layers * kv.heads * processed * kv.k_row_bytes));
    st->v.resize(size_t(kv.layers * kv.heads * processed * kv.v_row_bytes));
    copy_head_rows(st->k.get(), processed, kv.k.get(), cap, kv.layers, kv.heads, processed, kv.k_row_bytes, stream_);
    copy_head_rows(st->v.get(), processed, kv.v.get(), cap, kv.layers, kv.heads, processed, kv.v_row_bytes, stream_);
    if (kv.scales) {
      st->ks.resize(size_t(kv.layers * kv.heads * processed) * 4);
      st->vs.resize(st->ks.bytes());
      copy_head_rows(st->ks.get(), processed, kv.ks.get(), cap, kv.layers, kv.heads, processed, 4, stream_);
      copy_head_rows(st->vs.get(), processed, kv.vs.get(), cap, kv.layers, kv.heads, processed, 4, stream_);
    }
    PDB_CUDA_CHECK(cudaStreamSynchronize(stream_));
    *keep = std::move(st);
  } catch (const std::exception& e) {
    cudaGetLastError();
    spdlog::warn("cuda engine: the prompt's K/V ({} tokens) not kept for the prefix cache: {}", processed, e.what());
  }
}

// A block's normed rows: bf16 for the products; under the decoder's numerics f32 first (CudaChunk::xf), what the
// decoder rounds its activations from, and bf16 from them for the blocks that keep bf16 products; or, for a block
// whose products all take half rows (half_rows), those alone (CudaChunk::xh: the same bits as rounding the f32 rows).
void CudaEngine::norm_rows(const float* h, const cuda::DeviceBuffer& w, CudaChunk& ch, bool half_rows) {
  const int64_t H = cfg_.hidden_size;
  const float eps = float(cfg_.rms_norm_eps);
  if (!decoder_numerics()) return cuda::rmsnorm_rows_bf16(h, w.as<float>(), x_.as<bf16>(), ch.n, H, eps, ch.s);
  ch.xh = half_rows ? xh_.as<__half>() : nullptr;
  ch.xf = half_rows ? nullptr : xf_.as<float>();
  if (half_rows) return cuda::rmsnorm_rows_f16(h, w.as<float>(), xh_.as<__half>(), ch.n, H, eps, ch.s);
  cuda::rmsnorm_rows(h, w.as<float>(), xf_.as<float>(), ch.n, H, eps, ch.s);
  cuda::f32_to_bf16(xf_.as<float>(), x_.as<bf16>(), ch.n * H, ch.s);
}

void CudaEngine::enable_kv_rows() {
  if (const std::string why = attention_->enable_kv_rows(); !why.empty())
    throw std::invalid_argument(fmt::format("--kv-rows engine: {} ({})", why, def_.name));
  kv_rows_ = true;
}

CudaEngine::KvRowsStats CudaEngine::take_kv_rows_stats() { return KvRowsStats{kv_rows_spans_.take_ms(), last_layer_spans_.take_ms()}; }

void CudaEngine::set_kv_tap(KvTap tap) {
  if (tap && !kv_rows_) throw std::logic_error("set_kv_tap before enable_kv_rows");
  kv_tap_ = std::move(tap);
  kv_rows_stats_ = Tuning::from_env().capture_stats == "1";
}

int64_t CudaEngine::prefill(const std::vector<int32_t>& tokens, int64_t chunk, const DeviceHook& hook,
                            const std::function<bool()>& cancelled, bool full_last_layer, bool skip_attention, ResumePoint resume,
                            std::shared_ptr<EngineState>* keep, size_t keep_max_bytes) {
  const auto& c = cfg_;
  const int64_t T = int64_t(tokens.size()), H = c.hidden_size, L = c.num_layers;
  if (T == 0) return 0;
  if (chunk <= 0) chunk = 2048;
  chunk = std::min(chunk, T);
  for (int32_t t : tokens)
    if (t < 0 || t >= c.vocab_size) throw std::invalid_argument(fmt::format("token id {} outside the vocabulary ({})", t, c.vocab_size));
  if (!def_.resumable && (resume.tokens > 0 || keep))
    throw std::invalid_argument(fmt::format("the {} forward does not resume from a prefix state", def_.name));
  check_fits(T, chunk);
  reserve(T, chunk, full_last_layer ? L : std::max<int64_t>(L - 1, 1));
  resume_from(resume, T);
  cudaStream_t s = stream_;
  // Tensor parallel: once a block's normed input is taken, rank 0 keeps the residual and the other ranks
  // zero theirs; each adds its heads' (its columns') part of o_proj's (down_proj's) product into it, and the
  // sum over the ranks is the unsharded residual, on every rank. The rows past n (FP8 padding) are never read.
  const bool tp = tp_ && tp_->world() > 1;
  float* h = h_.as<float>();
  bf16* x = x_.as<bf16>();
  CudaChunk ch;
  ch.s = s;
  ch.skip_attention = skip_attention;
  ch.xf = decoder_numerics() ? xf_.as<float>() : nullptr;
  auto partial_residual = [&] {
    if (tp && tp_->rank() != 0) PDB_CUDA_CHECK(cudaMemsetAsync(h, 0, size_t(ch.n * H) * 4, s));
  };
  auto reduce_residual = [&] {
    if (tp) tp_->all_reduce_sum(h, size_t(ch.n * H), s);
  };
  for (int64_t p0 = resume.tokens; p0 < T; p0 += chunk) {
    ch.n = std::min(chunk, T - p0);
    ch.p0 = p0;
    PDB_CUDA_CHECK(cudaMemcpyAsync(tokens_.get(), tokens.data() + p0, size_t(ch.n) * 4, cudaMemcpyHostToDevice, s));
    attention_->begin_chunk(ch);
    if (embed_row_bytes_)
      cuda::dequantize_rows_f32(embed_type_, embed_.as<uint8_t>(), embed_row_bytes_, tokens_.as<int32_t>(), ch.n, H, h, s);
    else
      cuda::embed_rows(embed_.as<float>(), tokens_.as<int32_t>(), ch.n, H, h, s);
    for (int64_t l = 0; l < L; ++l) {
      if (cancelled && cancelled()) {
        PDB_CUDA_CHECK(cudaStreamSynchronize(s));
        keep_state(p0, keep, keep_max_bytes);
        return p0;
      }
      if (hook) hook(int(l), h, ch.n, p0, s);
      const bool last = l == L - 1 && !full_last_layer;
      if (last && !kv_tap_) break;
      if (last && kv_rows_stats_) last_layer_spans_.begin(s);
      if (quant_) quant_->expand(l, s, last ? attention_->kv_rows_weights_end(l) : SIZE_MAX);  // the last: its K/V rows only
      norm_rows(h, in_norm_[size_t(l)], ch, attention_->takes_half_rows(l));
      if (kv_tap_) {
        const float *k = nullptr, *v = nullptr;
        int64_t ld = 0;
        if (kv_rows_stats_) kv_rows_spans_.begin(s);
        attention_->kv_rows(l, x, ch, &k, &v, &ld);
        if (kv_rows_stats_) kv_rows_spans_.end(s);
        if (last && kv_rows_stats_) last_layer_spans_.end(s);
        kv_tap_(int(l), k, v, ld, ch.n, p0, s);
        if (last) break;
      }
      partial_residual();
      attention_->forward(l, x, h, ch);
      reduce_residual();
      norm_rows(h, post_norm_[size_t(l)], ch, ffns_[size_t(l)]->takes_half_rows());
      partial_residual();
      ffns_[size_t(l)]->forward(x, h, ffn_scratch_, *matmul_, ch);
      reduce_residual();
    }
  }
  PDB_CUDA_CHECK(cudaStreamSynchronize(s));
  keep_state(T, keep, keep_max_bytes);
  return T;
}

}  // namespace pdb
