// Matrix products through cuBLASLt: Y[rows x out] = X[rows x in] * W[out x in]^T (+ beta * Y),
// row-major, the layout of HF weights and of our activations. One heuristic query per shape, cached.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pdb::cuda {

enum class DType { BF16, F16, F32 };

// How the FP8 product's scale grids are laid out in memory. cuBLASLt documents the scaling modes
// (VEC128_32F: one f32 per row and 128 columns of X; BLK128x128_32F: one per 128x128 block of W) but
// the grids' order is established by a probe product against a host reference (probe_fp8_layout).
struct Fp8ScaleLayout {
  bool act_row_major = false;     // X scales s[r * KB + kb]; else column-major s[kb * ld + r]
  int act_ld_align = 1;           // column-major ld = rows rounded up to this
  bool weight_kb_fastest = true;  // W scales s[nb * ld + kb] (the checkpoint's order when ld = KB); else s[kb * ld + nb]
  int weight_ld_align = 1;        // that ld: the fastest grid dimension rounded up to this (16-byte columns)
  bool f32_accumulate = true;     // f32 output with beta = 1 works (else bf16 output, added by the caller)
  int row_multiple = 1;           // X's rows must be padded to a multiple of this (the library's kernels)
  std::string describe() const;
  int64_t act_ld(int64_t rows) const { return (rows + act_ld_align - 1) / act_ld_align * act_ld_align; }
  int64_t padded_rows(int64_t rows) const { return (rows + row_multiple - 1) / row_multiple * row_multiple; }
  // Element offset of X's scale for (row r, k-block kb) and of W's for (n-block nb, k-block kb).
  int64_t act_index(int64_t r, int64_t kb, int64_t rows, int64_t kblocks) const {
    return act_row_major ? r * kblocks + kb : kb * act_ld(rows) + r;
  }
  int64_t weight_ld(int64_t nblocks, int64_t kblocks) const {
    const int64_t fast = weight_kb_fastest ? kblocks : nblocks;
    return (fast + weight_ld_align - 1) / weight_ld_align * weight_ld_align;
  }
  int64_t weight_index(int64_t nb, int64_t kb, int64_t nblocks, int64_t kblocks) const {
    return weight_kb_fastest ? nb * weight_ld(nblocks, kblocks) + kb : kb * weight_ld(nblocks, kblocks) + nb;
  }
  // Elements of W's scale grid, padding included.
  int64_t weight_scale_count(int64_t nblocks, int64_t kblocks) const {
    return weight_ld(nblocks, kblocks) * (weight_kb_fastest ? nblocks : kblocks);
  }
};

class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes = size_t(64) << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // X and W share `ab` (bf16/f16: f32 accumulation; f32: true f32, no TF32). Y is `y_type`;
  // beta = 1 accumulates into Y (the residual add, fused into the product).
  void xwt(DType ab, const void* x, const void* w, DType y_type, void* y, int64_t rows, int64_t in, int64_t out, float beta,
           cudaStream_t stream);

  // The library's first `count` algorithms for this product (the heuristic's order), each timed on the caller's
  // operands over `reps` runs after a warm-up (y is scratch: it is written), with a hash of its output's bits for y
  // zeroed first: what the heuristic's first choice leaves on the table, and whether the others give the same bits.
  struct AlgorithmTiming {
    int rank = 0;
    std::string config;  // the algorithm's id, tile, stages, split-k, swizzle, cluster
    float ms = 0;        // median per product
    uint64_t bits = 0;   // xor-fold of the output's 32-bit words
  };
  std::vector<AlgorithmTiming> time_algorithms(DType ab, const void* x, const void* w, DType y_type, void* y, int64_t rows, int64_t in, int64_t out,
                                               float beta, int count, int reps, cudaStream_t stream);

  // FP8 e4m3 X [rows x in] and W [out x in] with their block scales (layout L), f32 accumulation;
  // Y is bf16 or f32 (beta = 1 accumulates, f32 only). `in` and `out` are multiples of 128.
  void xwt_fp8(const Fp8ScaleLayout& L, const uint8_t* xq, const float* xs, const uint8_t* wq, const float* ws, DType y_type, void* y,
               int64_t rows, int64_t in, int64_t out, float beta, cudaStream_t stream);

 private:
  struct Plan;
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, bool>;
  Plan& plan(DType ab, DType y_type, int64_t rows, int64_t in, int64_t out, bool accumulate);
  Plan* plan_fp8(DType y_type, int64_t rows, int64_t in, int64_t out, bool accumulate);  // nullptr: no algorithm
  bool pick_algorithm(Plan& p, int ab_type, int y_type, int64_t rows, int64_t in, int64_t out);  // cudaDataType_t values
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::mutex mu_;
  std::map<Key, std::unique_ptr<Plan>> plans_, fp8_plans_;
};

// Finds the scale-grid order of this cuBLASLt's block-scaled FP8 product on this GPU with a small
// product of known operands against a host reference; nullopt (and why, in *report) when no order
// reproduces it or the library has no such kernel here.
std::optional<Fp8ScaleLayout> probe_fp8_layout(Gemm& gemm, std::string* report);

}  // namespace pdb::cuda
