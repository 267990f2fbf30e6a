#include "model/cuda_moe_ffn.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "common/tuning.h"
#include "cuda/elementwise.cuh"
#include "cuda/grouped_gemm_cudnn.h"
#include "cuda/moe.cuh"
#include "formats/hf_config.h"
#include "model/cuda_blocks.h"
#include "model/cuda_engine_load.h"
#include "model/moe_padding.h"
#include "model/tensor_parallel.h"

namespace pdb {

using bf16 = __nv_bfloat16;

namespace {
// A checkpoint's experts (a rank's columns [ff0, ff0 + ff) of each) into one bf16 buffer each for gate|up and down.
void upload_checkpoint_experts(const CudaLoad& ld, const std::string& prefix, int64_t ff0, CudaMoeWeights& w) {
  const int64_t full_ff = ld.c.moe_intermediate_size;
  const size_t gu_bytes = size_t(2 * w.ff * w.hidden) * 2, d_bytes = size_t(w.hidden * w.ff) * 2;
  cuda::DeviceBuffer gu(gu_bytes * size_t(w.n_expert)), down(d_bytes * size_t(w.n_expert));
  for (int64_t e = 0; e < w.n_expert; ++e) {
    const std::string x = fmt::format("{}mlp.experts.{}.", prefix, e);
    auto g = rows_of(cuda_load::to_bf16(*ld.ck, ld.c, x + "gate_proj.weight", full_ff, w.hidden, ld.threads), w.hidden, ff0, w.ff);
    auto u = rows_of(cuda_load::to_bf16(*ld.ck, ld.c, x + "up_proj.weight", full_ff, w.hidden, ld.threads), w.hidden, ff0, w.ff);
    auto d = cols_of(cuda_load::to_bf16(*ld.ck, ld.c, x + "down_proj.weight", w.hidden, full_ff, ld.threads), w.hidden, full_ff, ff0, w.ff);
    gu.upload(g.data(), g.size() * 2, size_t(e) * gu_bytes);
    gu.upload(u.data(), u.size() * 2, size_t(e) * gu_bytes + g.size() * 2);
    down.upload(d.data(), d.size() * 2, size_t(e) * d_bytes);
  }
  w.gu = std::move(gu);
  w.down = std::move(down);
}
}  // namespace

CudaMoeWeights load_cuda_moe(const CudaLoad& ld, int64_t layer, const std::string& prefix, bool renormalize, int64_t ff0, int64_t ff) {
  const HfConfig& c = ld.c;
  CudaMoeWeights w;
  w.n_expert = c.num_experts;
  w.n_used = c.num_experts_per_tok;
  w.hidden = c.hidden_size;
  const int64_t full_ff = c.moe_intermediate_size;
  w.ff = ff < 0 ? full_ff : ff;
  if (ff0 < 0 || ff0 + w.ff > full_ff) throw std::invalid_argument("load_cuda_moe: expert columns outside the expert");
  w.renormalize = renormalize;
  w.scale = c.routed_scaling_factor > 0 ? float(c.routed_scaling_factor) : 1.0f;
  if (w.n_expert > 256 || w.n_used > 32) throw std::runtime_error(fmt::format("CUDA engine: {} of {} experts (at most 32 of 256)", w.n_used, w.n_expert));
  if (w.ff % 8 || w.hidden % 8) throw std::runtime_error("CUDA engine: expert widths must be multiples of 8");
  size_t total = 0;
  w.router = cuda_load::weight(ld, layer, {{prefix + "mlp.gate.weight", w.n_expert, 0, w.n_expert}}, w.hidden, 0, w.hidden, total);
  if (ld.ck) {
    upload_checkpoint_experts(ld, prefix, ff0, w);
    return w;
  }
  // a GGUF's stacked experts: per expert its gate rows then its up rows, and its down rows (quantized rows stay so)
  std::vector<cuda_load::RowSlice> gu, down;
  for (int64_t e = 0; e < w.n_expert; ++e) {
    const std::string x = fmt::format("{}mlp.experts.{}.", prefix, e);
    gu.push_back({x + "gate_proj.weight", full_ff, 0, full_ff});
    gu.push_back({x + "up_proj.weight", full_ff, 0, full_ff});
    down.push_back({x + "down_proj.weight", w.hidden, 0, w.hidden});
  }
  w.gu = cuda_load::weight(ld, layer, gu, w.hidden, 0, w.hidden, total);
  w.down = cuda_load::weight(ld, layer, down, full_ff, 0, full_ff, total);
  return w;
}

// The grouped rows are padded at most this much (model/moe_padding.h) before the grouped products run instead.
constexpr int64_t kPadNum = 3, kPadDen = 2;

size_t CudaMoeFfn::bytes_for(const HfConfig& c, int64_t rows) {
  const int64_t E = c.num_experts, k = c.num_experts_per_tok, H = c.hidden_size, F = c.moe_intermediate_size;
  const int64_t g = std::max(padded_rows(rows * k), rows * k * kPadNum / kPadDen + 1);
  return size_t(rows * E) * 4 + size_t(g) * (4 + 4 + 4 + 4) + size_t(E) * 12 + size_t(g) * size_t(H * 2 + 2 * F * 2 + F * 2 + H * 2);
}

size_t CudaMoeFfn::scratch_bytes() const {
  return logits_.bytes() + experts_.bytes() + weights_.bytes() + counts_.bytes() + offsets_.bytes() + pad_offsets_.bytes() + slot_of_.bytes() +
         token_of_.bytes() + xg_.bytes() + gu_.bytes() + act_.bytes() + y_.bytes();
}

// cuDNN's plans are per row count: the grouped rows are padded to a multiple of 256 (the padding rows are computed
// as the last expert's and never read), so a prompt's ragged last chunk rarely needs a plan of its own.
int64_t CudaMoeFfn::padded_rows(int64_t g) { return (g + 255) / 256 * 256; }

int64_t CudaMoeFfn::full_products_chunk(int64_t n_expert, int64_t n_used) {
  int64_t chunk = 4096;
  if (n_used > 0)
    while (chunk < 16384 && chunk * n_used < 512 * n_expert) chunk *= 2;
  return chunk;
}

bool CudaMoeFfn::use_cudnn(const std::string& choice, bool& gather) {
  gather = choice == "cudnn-gather";
  if (!(choice == "cudnn" || gather) || !cudnn_refused_.empty()) return false;
  std::string why;
  if (cuda::cudnn_available(&why)) return true;
  cudnn_refused_ = why;
  return false;
}

void CudaMoeFfn::forward(const CudaMoeWeights& w, const bf16* x, int64_t rows, float* h, cuda::Gemm& gemm, cudaStream_t s) {
  if (rows <= 0) return;
  const int64_t E = w.n_expert, k = w.n_used, H = w.hidden, F = w.ff, g = rows * k, gp = padded_rows(g);
  logits_.resize(size_t(rows * E) * 4);
  experts_.resize(size_t(g) * 4);
  weights_.resize(size_t(g) * 4);
  counts_.resize(size_t(E) * 4);
  offsets_.resize(size_t(E) * 4);
  slot_of_.resize(size_t(g) * 4);
  token_of_.resize(size_t(gp) * 4);
  xg_.resize(size_t(gp * H) * 2);
  gu_.resize(size_t(gp * 2 * F) * 2);
  act_.resize(size_t(gp * F) * 2);
  y_.resize(size_t(gp * H) * 2);
  gemm.xwt(cuda::DType::BF16, x, w.router.get(), cuda::DType::F32, logits_.get(), rows, H, E, 0.0f, s);
  cuda::MoeRouteArgs ra;
  ra.rows = rows;
  ra.n_expert = int(E);
  ra.n_used = int(k);
  ra.renormalize = w.renormalize;
  ra.scale = w.scale;
  cuda::moe_route(logits_.as<float>(), experts_.as<int32_t>(), weights_.as<float>(), ra, s);
  // counted here, placed once: at the experts' packed offsets, or at the padded ones (experts_padded)
  cuda::moe_count(experts_.as<int32_t>(), rows, int(k), int(E), counts_.as<int32_t>(), offsets_.as<int32_t>(), s);
  auto place_packed = [&] {
    cuda::moe_place(experts_.as<int32_t>(), rows, int(k), int(E), offsets_.as<int32_t>(), slot_of_.as<int32_t>(), token_of_.as<int32_t>(), s);
  };
  const std::string choice = Tuning::from_env().moe_gemm;
  bool gather = false;
  if (use_cudnn(choice, gather)) {
    place_packed();
    try {
      experts_cudnn(w, x, rows, gather, s);
      last_way_ = gather ? "cudnn-gather" : "cudnn";
      cuda::moe_combine(y_.as<bf16>(), slot_of_.as<int32_t>(), weights_.as<float>(), rows, int(k), H, h, s);
      return;
    } catch (const std::runtime_error& e) {
      cudnn_refused_ = e.what();
      std::fprintf(stderr, "MoE products: cuDNN's grouped matmul refused (%s); cuBLAS's products run instead\n", e.what());
    }
  }
  // cuBLAS takes the group sizes (and the chunks' pointers) on the host: one small synchronizing read
  counts_host_ = counts_back_.fetch(counts_.as<int32_t>(), E, s);
  PaddedExperts pad;
  if (choice.empty()) pad = pad_experts(counts_host_, E, kPadNum, kPadDen);
  if (choice == "padded") pad = pad_experts(counts_host_, E, INT32_MAX, 1);
  if (pad.cap() > 0) {
    experts_padded(w, x, rows, pad, s);
    last_way_ = "padded";
  } else {
    place_packed();
    experts_cublas(w, x, rows, s);
    last_way_ = choice == "loop" ? "loop" : "grouped";
  }
  cuda::moe_combine(y_.as<bf16>(), slot_of_.as<int32_t>(), weights_.as<float>(), rows, int(k), H, h, s);
}

// The rows placed again at padded offsets (every expert's rows in whole chunks), then gate|up and down as one batched
// product per chunk size; the padding rows read token 0 and are never read back.
void CudaMoeFfn::experts_padded(const CudaMoeWeights& w, const bf16* x, int64_t rows, const PaddedExperts& pad, cudaStream_t s) {
  const int64_t E = w.n_expert, H = w.hidden, F = w.ff, R = pad.rows;
  token_of_.resize(size_t(R) * 4);
  xg_.resize(size_t(R * H) * 2);
  gu_.resize(size_t(R * 2 * F) * 2);
  act_.resize(size_t(R * F) * 2);
  y_.resize(size_t(R * H) * 2);
  pad_offsets_.resize(size_t(E) * 4);
  pad_offsets_host_.resize(size_t(E) * 4);
  std::copy(pad.offsets.begin(), pad.offsets.end(), pad_offsets_host_.as<int32_t>());
  PDB_CUDA_CHECK(cudaMemcpyAsync(pad_offsets_.get(), pad_offsets_host_.as<int32_t>(), size_t(E) * 4, cudaMemcpyHostToDevice, s));
  PDB_CUDA_CHECK(cudaMemsetAsync(token_of_.get(), 0, size_t(R) * 4, s));
  cuda::moe_place(experts_.as<int32_t>(), rows, int(w.n_used), int(E), pad_offsets_.as<int32_t>(), slot_of_.as<int32_t>(), token_of_.as<int32_t>(), s);
  cuda::gather_rows(x, token_of_.as<int32_t>(), R, H, xg_.as<bf16>(), s);
  padded_products(grouped_, pad, E, xg_.get(), w.gu.get(), gu_.get(), H, 2 * F, s);
  cuda::swiglu_rows(gu_.as<bf16>(), act_.as<bf16>(), R, F, s);
  padded_products(grouped_, pad, E, act_.get(), w.down.get(), y_.get(), F, H, s);
}

// gate|up, SwiGLU, down through cuDNN: the experts' first rows stay on the device (no download, no sync).
void CudaMoeFfn::experts_cudnn(const CudaMoeWeights& w, const bf16* x, int64_t rows, bool gather, cudaStream_t s) {
  const int64_t E = w.n_expert, H = w.hidden, F = w.ff, g = rows * w.n_used, gp = padded_rows(g);
  const int32_t* first = offsets_.as<int32_t>();
  cuda::MoeGroupedShape up{gp, E, H, 2 * F, rows}, down{gp, E, F, H, 0};
  if (gather) {
    if (gp > g) PDB_CUDA_CHECK(cudaMemsetAsync(token_of_.as<int32_t>() + g, 0, size_t(gp - g) * 4, s));  // padding rows read token 0
    cuda::moe_grouped_xwt_cudnn(x, token_of_.as<int32_t>(), w.gu.as<bf16>(), first, gu_.as<bf16>(), up, s);
  } else {
    cuda::gather_rows(x, token_of_.as<int32_t>(), g, H, xg_.as<bf16>(), s);
    cuda::moe_grouped_xwt_cudnn(xg_.as<bf16>(), nullptr, w.gu.as<bf16>(), first, gu_.as<bf16>(), up, s);
  }
  cuda::swiglu_rows(gu_.as<bf16>(), act_.as<bf16>(), g, F, s);
  cuda::moe_grouped_xwt_cudnn(act_.as<bf16>(), nullptr, w.down.as<bf16>(), first, y_.as<bf16>(), down, s);
}

// The same through cuBLAS's grouped call (or one product per expert), its group sizes the downloaded counts.
void CudaMoeFfn::experts_cublas(const CudaMoeWeights& w, const bf16* x, int64_t rows, cudaStream_t s) {
  const int64_t E = w.n_expert, H = w.hidden, F = w.ff, g = rows * w.n_used;
  cuda::gather_rows(x, token_of_.as<int32_t>(), g, H, xg_.as<bf16>(), s);
  const int32_t* cnt = counts_host_;
  std::vector<cuda::GroupedProduct> up(static_cast<size_t>(E)), down(static_cast<size_t>(E));
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = cnt[e];
    up[size_t(e)] = {xg_.as<bf16>() + off * H, w.gu.as<bf16>() + e * 2 * F * H, gu_.as<bf16>() + off * 2 * F, n};
    down[size_t(e)] = {act_.as<bf16>() + off * F, w.down.as<bf16>() + e * H * F, y_.as<bf16>() + off * H, n};
    off += n;
  }
  if (off != g) throw std::runtime_error(fmt::format("MoE grouping placed {} of {} token choices", off, g));
  grouped_.xwt(up, H, 2 * F, cuda::DType::BF16, s);
  cuda::swiglu_rows(gu_.as<bf16>(), act_.as<bf16>(), g, F, s);
  grouped_.xwt(down, F, H, cuda::DType::BF16, s);
}

}  // namespace pdb
