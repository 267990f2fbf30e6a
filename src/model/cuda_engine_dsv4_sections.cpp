// DeepSeek-V4's cache rows on the GPU, from the decoder's own weights: the window row, the compressors' pools and rings
// and the indexer's rows of each layer and chunk (recipes/deepseek4.h's arithmetic, its CPU twin), handed to the hook
// as the decoder stores them and kept, as the engine reads them, for the layer's attention.
#include "model/cuda_engine_dsv4_run.h"

namespace pdb {

// The decoder's Hadamard rotation of `count` rows of `width` (its groups: recipes/recipe.h k_rotation_size).
void rotate_rows(float* rows, int64_t count, int64_t width, cudaStream_t s) {
  const int64_t g = k_rotation_size(width);
  if (g) cuda::hadamard_groups(rows, count * width / g, int(g), s);
}

void Deepseek4CudaEngine::PromptRun::as_stored(float* rows_, int64_t count, int64_t width, bool rotated, bf16* out) {
  if (count <= 0) return;
  if (quantized) {
    cuda::q8_0_round_trip(rows_, count * width, s);
    if (rotated) rotate_rows(rows_, count, width, s);
  } else {
    cuda::round_as_cached(rows_, count * width, round_kind, s);
  }
  cuda::f32_to_bf16(rows_, out, count * width, s);
}

// An f32-accurate product y [rows x n_out] = x [rows x k] . w^T as three TF32 tensor-core products
// (cuda/f32_tensor.cuh), its k split where the chunk's tiles alone do not fill the GPU (the server's 4,096-row
// chunks); false where it does not run (PDBRIDGE_DSV4_F32=fp32, a shape it does not take): the caller's f32 path.
bool Deepseek4CudaEngine::PromptRun::f32_on_tensor_cores(const float* x_, const float* w, int64_t k, int64_t n_out, float* y) {
  if (tuning.dsv4_f32 == "fp32" || !cuda::f32_tensor_supported(x_, w, y, k, n_out)) return false;
  const int splits = cuda::f32_tensor_splits(rows, n_out, k);
  if (splits > 1) Impl::grow(I.mix_parts, size_t(splits * rows * n_out) * sizeof(float));
  cuda::f32_tensor_xwt(x_, w, y, rows, k, n_out, s, I.mix_parts.as<float>(), splits);
  return true;
}

// The mixes' products on the tensor cores (above; unless PDBRIDGE_DSV4_MIX names a path), else by the narrow f32 kernel where it takes the shape and the
// chunk fills the GPU (cuBLAS's f32 products ran these at 17 TFLOP/s: docs/RESULTS.md); PDBRIDGE_DSV4_MIX=cublas for
// cuBLAS, =narrow for the kernel at any row count, =split for the kernel with k split until its tiles fill the GPU
// (the server's 4,096-row chunks; not yet measured). All are f32 sums of the same products (the kernel's in k order,
// split: each split's in order).
void Deepseek4CudaEngine::PromptRun::mix_product(const float* x_, const DeviceBuffer& fn, int64_t n_out, float* m) {
  if (tuning.dsv4_mix.empty() && f32_on_tensor_cores(x_, fn.as<float>(), 4 * E, n_out, m)) return;
  const std::string& way = tuning.dsv4_mix;
  if (way != "cublas" && cuda::f32_narrow_supported(x_, fn.as<float>(), 4 * E, n_out)) {
    if (way == "split") {
      const int splits = cuda::f32_narrow_splits(rows, 4 * E);
      if (splits > 1) Impl::grow(I.mix_parts, size_t(splits * rows * n_out) * sizeof(float));
      return cuda::f32_narrow_xwt(x_, fn.as<float>(), m, rows, 4 * E, n_out, s, I.mix_parts.as<float>(), splits);
    }
    if (way == "narrow" || cuda::f32_narrow_fills_gpu(rows)) return cuda::f32_narrow_xwt(x_, fn.as<float>(), m, rows, 4 * E, n_out, s);
  }
  I.gemm.xwt(cuda::DType::F32, x_, fn.get(), cuda::DType::F32, m, rows, 4 * E, n_out, 0.0f, s);
}

// The streams' pre-sum by the mix, then its rms norm (and the normed rows' bf16 copy where y_bf16, their Q8_0 blocks
// where q8): one pass where the rows fit the fused kernel (the same bits), else the passes apart.
void Deepseek4CudaEngine::PromptRun::pre_sum_norm(const float* streams, const float* mix, const DeviceBuffer& norm, float* y, bf16* y_bf16, int8_t* q8,
                                                  float* q8_scales) {
  if (cuda::dsv4_hc_pre_sum_norm_supported(E) && (!q8 || E % 32 == 0))
    return cuda::dsv4_hc_pre_sum_norm(streams, mix, rows, E, norm.as<float>(), eps, y, y_bf16, s, q8, q8_scales);
  cuda::dsv4_hc_pre_sum(streams, mix, rows, E, I.pre.as<float>(), s);
  cuda::rmsnorm_rows(I.pre.as<float>(), norm.as<float>(), y, rows, E, eps, s);
  if (y_bf16) cuda::f32_to_bf16(y, y_bf16, rows * E, s);
  if (q8) cuda::quantize_rows_q8(y, rows, E, q8, q8_scales, s);
}

void Deepseek4CudaEngine::PromptRun::sections(Deepseek4LayerSections& S) {
  Impl::Layer& L = *layer_;
  // the pre-mixes: the decoder's (its pre feeds the sections and the layer) and the engine's (its post and comb
  // make the residual), from one f32 product of the raw streams scaled by their inv-rms (two products of 24 columns
  // made this step 1.9 ms slower per 32K layer, though cuBLAS alone ran the 24 faster: docs/RESULTS.md session 35)
  x = I.x.as<float>();
  inv_x = I.inv_x.as<float>();
  constexpr int64_t kMix = cuda::kDsv4MixFloats;
  mix_product(x, L.hc_attn_fns, 2 * kMix, I.m.as<float>());
  cuda::dsv4_hc_coefs(I.m.as<float>(), 2 * kMix, inv_x, L.r_hc_base.as<float>(), L.r_hc_scale.as<float>(), rows, c.hc_eps,
                      int(c.hc_iterations), I.mix_r.as<float>(), s);
  cuda::dsv4_hc_coefs(I.m.as<float>() + kMix, 2 * kMix, inv_x, L.hc_attn_base.as<float>(), L.hc_attn_scale.as<float>(), rows, c.hc_eps,
                      int(c.hc_iterations), I.mix_e.as<float>(), s);
  cur = I.cur.as<float>();
  // cur_b: the layer's q path and indexer; qx / dx: the sections' Q8_0 products
  pre_sum_norm(x, I.mix_r.as<float>(), L.attn_norm, cur, I.cur_b.as<bf16>(), any_q8 ? I.qx.as<int8_t>() : nullptr, I.dx.as<float>());
  qx = I.qx.as<int8_t>();
  dx = I.dx.as<float>();
  mark(13);
  S.ratio = L.ratio;
  const int64_t handed = std::min(rows, W);  // the window rows handed over: the chunk's last W (all a seal and the wire use)
  S.window_first = p0 + rows - handed;
  float* kv = I.kvrow.as<float>();
  I.project(L.wkv, cur, qx, dx, rows, kv);
  cuda::rmsnorm_rows(kv, L.kv_norm.as<float>(), kv, rows, D, eps, s);
  cuda::rope_tail(kv, cs, rows, 1, int(D), int(r), D, s);
  if (quantized) rotate_rows(kv, rows, D, s);
  I.download(S.window, kv + (rows - handed) * D, handed * D);
  PDB_CUDA_CHECK(cudaMemcpyAsync(I.kvtmp.get(), kv, size_t(rows * D) * 4, cudaMemcpyDeviceToDevice, s));
  I.keep_last(L.win, L.win_rows, std::min(W, L.win_rows), size_t(D) * 2);  // what this chunk's queries reach back to
  L.win_first = p0 - L.win_rows;
  as_stored(I.kvtmp.as<float>(), rows, D, true, L.win.as<bf16>() + L.win_rows * D);
  L.win_rows += rows;
  mark(14);
  if (L.ratio)
    compress(L.ckv, L.cgate, L.cape, L.cnorm, D, int(L.ratio), quantized, L.hp, L.pool, L.n_pool, S.pool, S.pool_first, S.ring_kv, S.ring_score);
  mark(15);
  if (L.ratio == 4) {
    const int64_t had = L.n_lid;
    compress(L.ikv, L.igate, L.iape, L.inorm, Id, 4, true, L.hl, L.lid, L.n_lid, S.lid, S.lid_first, S.lid_kv, S.lid_score);
    if (fp8_idx)  // the FP8 operand of the rows the decoder caches (as stored, then e4m3)
      cuda::indexer_fp8_rows(L.lid.as<bf16>() + had * Id, L.n_lid - had, int(Id), L.lid8.as<uint8_t>() + had * Id, L.lid8_s.as<float>() + had, s);
  }
  mark(1);
  PDB_CUDA_CHECK(cudaEventRecord(I.dl.copied, s));  // the hook's rows are on the host past here (take_downloads)
}

// the compressors: their projections after the carried tokens, the blocks finishing in this chunk, the rings
void Deepseek4CudaEngine::PromptRun::compress(const SectionProjection& wa, const SectionProjection& wg, const DeviceBuffer& ape,
                                              const DeviceBuffer& norm, int64_t width, int ratio, bool hadamard, Impl::Layer::History& h,
                                              DeviceBuffer& rows_out, int64_t& n_out, std::vector<float>& pooled, int64_t& first_block,
                                              std::vector<float>& ring_kv, std::vector<float>& ring_score) {
  Impl::Layer& L = *layer_;
  const GgmlRopeParams& rp = *rope_;
  const int64_t cw = (ratio == 4 ? 2 : 1) * width, ring = ratio == 4 ? 8 : 128;
  const int64_t keep = std::min(ring, h.rows);
  if (h.rows > keep) {
    int64_t ra = h.rows, rg = h.rows;
    I.keep_last(h.a, ra, keep, size_t(cw) * 4);
    I.keep_last(h.g, rg, keep, size_t(cw) * 4);
    h.first += h.rows - keep;
    h.rows = keep;
  }
  if (h.rows == 0) h.first = p0;
  if (h.first + h.rows != p0) throw std::logic_error("DSV4 GPU compressor: chunks out of order");
  float* a = h.a.as<float>() + h.rows * cw;
  float* g = h.g.as<float>() + h.rows * cw;
  I.project(wa, cur, qx, dx, rows, a);
  I.project(wg, cur, qx, dx, rows, g);
  cuda::dsv4_add_ape(g, ape.as<float>(), rows, cw, p0, ratio, s);
  h.rows += rows;
  const int64_t b0 = p0 / ratio, nb = (p0 + rows) / ratio - b0;
  first_block = b0;
  float* out = I.pooled.as<float>();
  if (nb > 0) {
    cuda::dsv4_pool(h.a.as<float>(), h.g.as<float>(), h.first, b0, nb, ratio, width, out, s);
    cuda::rmsnorm_rows(out, norm.as<float>(), out, nb, width, eps, s);
    // each block is roped at its first position: a row of the chunk's table (every ratio-th), except a block
    // that began in the previous chunk
    const int64_t lead = ratio * b0 < p0 ? 1 : 0;
    if (lead) {
      const auto csb = rope_table(rp, 1, [&](int64_t) { return ratio * b0; });
      PDB_CUDA_CHECK(cudaMemcpyAsync(I.csb.get(), csb.data(), csb.size() * 4, cudaMemcpyHostToDevice, s));
      cuda::rope_tail(out, I.csb.as<float>(), 1, 1, int(width), int(r), width, s);
    }
    cuda::rope_tail(out + lead * width, I.cs_comp.as<float>() + (ratio * (b0 + lead) - p0) * r, nb - lead, 1, int(width), int(r), width, s,
                    ratio * r);
    if (hadamard) rotate_rows(out, nb, width, s);
    I.download(pooled, out, nb * width);  // queued before as_stored changes `out`: the stream keeps the order
    // the LID rows stay rotated (the indexer's query is rotated to match); pool rows as the window's
    as_stored(out, nb, width, hadamard && &rows_out != &L.lid, rows_out.as<bf16>() + n_out * width);
    n_out += nb;
  } else {
    pooled.clear();
  }
  // the rings after this chunk's last token: position t in slot t % ring
  const int64_t end = p0 + rows, from = std::max(h.first, end - ring);
  auto to_ring = [from, end, ring, cw](std::vector<float>& out) {
    return [&out, from, end, ring, cw](const float* tail) {
      out.assign(size_t(ring * cw), 0.0f);
      for (int64_t t = from; t < end; ++t) std::copy_n(tail + (t - from) * cw, cw, out.data() + (t % ring) * cw);
    };
  };
  I.download(h.a.as<float>() + (from - h.first) * cw, (end - from) * cw, to_ring(ring_kv));
  I.download(h.g.as<float>() + (from - h.first) * cw, (end - from) * cw, to_ring(ring_score));
}

}  // namespace pdb
