// CPU twins of the CUDA kernels (src/cuda/*.cuh): plain, readable f32/f64 versions of the same
// functions, for the tests that compare each kernel against its twin on random inputs.
#pragma once
#include <cstdint>
#include <vector>

namespace pdb::ref {

// Causal GQA attention in f64. q: [n_q x H x D]; k: [KV x cap x D]; v: [KV x cap x DV]; out: [n_q x H x DV]
// (DV 0: D; MLA decompressed has D 192, DV 128).
void causal_attention(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v, std::vector<float>& out,
                      int64_t n_q, int64_t pos0, int H, int KV, int D, int64_t cap, float scale, int DV = 0);

// The engine's QKV split + optional per-head RMSNorm + HF rotate-half RoPE + cache write.
void qkv_rope_to_cache(const std::vector<float>& qkv, std::vector<float>& q_out, std::vector<float>& k_cache, std::vector<float>& v_cache,
                       int64_t rows, int64_t pos0, int H, int KV, int D, const std::vector<float>& inv_freq, float attn_scale,
                       const float* q_norm, const float* k_norm, float eps, int64_t cap);

// out[r][i] = silu(gu[r][i]) * gu[r][ff + i]
void swiglu_rows(const std::vector<float>& gu, std::vector<float>& out, int64_t rows, int64_t ff);

// y[rows x out] = x[rows x in] W[out x in]^T in f64
void matmul_xwt(const std::vector<float>& x, const std::vector<float>& w, std::vector<float>& y, int64_t rows, int64_t in, int64_t out);

// Activations into FP8 e4m3 per row and 128 columns: scale = amax / 448 (1 for an all-zero block),
// code = e4m3(x / scale) (nearest, ties to even, saturating). scales: [rows x k/128] row-major.
void quantize_rows_fp8(const std::vector<float>& x, int64_t rows, int64_t k, std::vector<uint8_t>& q, std::vector<float>& scales);

// ||a - b|| / ||b||; NaN anywhere gives +inf
double rel_error(const std::vector<float>& a, const std::vector<float>& b);

}  // namespace pdb::ref
