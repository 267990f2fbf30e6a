#include "cuda/grouped_gemm.cuh"
#include "common/tuning.h"

#include <cublas_v2.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace pdb::cuda {
namespace {

void check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(fmt::format("cuBLAS {} failed: status {}", what, int(st)));
}

cudaDataType_t cublas_type(DType t) { return t == DType::F32 ? CUDA_R_32F : t == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F; }

}  // namespace

GroupedGemm::GroupedGemm(bool per_expert) : loop_(per_expert) {
  cublasHandle_t h = nullptr;
  check(cublasCreate(&h), "create");
  handle_ = h;
  check(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "math mode");  // f32 accumulation, no TF32 (bf16 operands anyway)
  PDB_CUDA_CHECK(cudaEventCreateWithFlags(&ptrs_copied_, cudaEventDisableTiming));
  PDB_CUDA_CHECK(cudaEventRecord(ptrs_copied_, nullptr));
  const std::string choice = Tuning::from_env().moe_gemm;
  if (choice == "loop") loop_ = true;
  if (choice == "grouped") loop_ = false;
}

GroupedGemm::~GroupedGemm() {
  if (ptrs_copied_) cudaEventDestroy(ptrs_copied_);
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void* GroupedGemm::on_stream(cudaStream_t s) {
  check(cublasSetStream(static_cast<cublasHandle_t>(handle_), s), "set stream");
  return handle_;
}

void** GroupedGemm::staging(int64_t n) {
  PDB_CUDA_CHECK(cudaEventSynchronize(ptrs_copied_));
  host_ptrs_.resize(size_t(n) * sizeof(void*));
  dev_ptrs_.resize(size_t(n) * sizeof(void*));
  return host_ptrs_.as<void*>();
}

void** GroupedGemm::upload(int64_t n, cudaStream_t s) {
  PDB_CUDA_CHECK(cudaMemcpyAsync(dev_ptrs_.get(), host_ptrs_.as<void>(), size_t(n) * sizeof(void*), cudaMemcpyHostToDevice, s));
  PDB_CUDA_CHECK(cudaEventRecord(ptrs_copied_, s));
  return dev_ptrs_.as<void*>();
}

// Column-major view, as Gemm::xwt: Y^T[out x rows] = W^T(op T of the [in x out] column-major W) * X^T.
void GroupedGemm::xwt(const std::vector<GroupedProduct>& products, int64_t in, int64_t out, DType y_type, cudaStream_t s) {
  auto h = static_cast<cublasHandle_t>(on_stream(s));
  const cudaDataType_t yt = cublas_type(y_type);
  const float alpha = 1.0f, beta = 0.0f;
  std::vector<const GroupedProduct*> live;
  for (const auto& p : products)
    if (p.rows > 0) live.push_back(&p);
  if (live.empty()) return;
  if (in > INT32_MAX || out > INT32_MAX) throw std::invalid_argument("grouped product: dimensions past int32");
  if (loop_) {
    for (const auto* p : live)
      check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(out), int(p->rows), int(in), &alpha, p->w, CUDA_R_16BF, int(in), p->x, CUDA_R_16BF,
                         int(in), &beta, p->y, yt, int(out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "gemm");
    return;
  }
  const int g = int(live.size());
  const size_t G = static_cast<size_t>(g);
  const int in32 = static_cast<int>(in), out32 = static_cast<int>(out);
  std::vector<cublasOperation_t> ta(G, CUBLAS_OP_T), tb(G, CUBLAS_OP_N);
  std::vector<int> m(G, out32), n(G, 0), k(G, in32), lda(G, in32), ldb(G, in32), ldc(G, out32), size(G, 1);
  std::vector<float> alphas(G, alpha), betas(G, beta);
  void** hp = staging(3 * g);
  for (int i = 0; i < g; ++i) {
    const auto* p = live[size_t(i)];
    if (p->rows > INT32_MAX) throw std::invalid_argument("grouped product: rows past int32");
    n[size_t(i)] = int(p->rows);
    hp[i] = const_cast<void*>(p->w);
    hp[g + i] = const_cast<void*>(p->x);
    hp[2 * g + i] = p->y;
  }
  void** dp = upload(3 * g, s);
  check(cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m.data(), n.data(), k.data(), alphas.data(), const_cast<const void* const*>(dp),
                                   CUDA_R_16BF, lda.data(), const_cast<const void* const*>(dp + g), CUDA_R_16BF, ldb.data(), betas.data(),
                                   dp + 2 * g, yt, ldc.data(), g, size.data(), CUBLAS_COMPUTE_32F),
        "grouped gemm");
}

void GroupedGemm::xwt_padded(const void* x, const void* w, void* y, int64_t cap, int64_t experts, int64_t in, int64_t out, DType y_type,
                             cudaStream_t s) {
  if (cap <= 0 || experts <= 0) return;
  if (in > INT32_MAX || out > INT32_MAX || cap > INT32_MAX || experts > INT32_MAX) throw std::invalid_argument("padded products: dimensions past int32");
  auto h = static_cast<cublasHandle_t>(on_stream(s));
  const cudaDataType_t yt = cublas_type(y_type);
  const float alpha = 1.0f, beta = 0.0f;
  check(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(out), int(cap), int(in), &alpha, w, CUDA_R_16BF, int(in), in * out, x, CUDA_R_16BF,
                                   int(in), cap * in, &beta, y, yt, int(out), cap * out, int(experts), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "strided batched gemm");
}

void GroupedGemm::xwt_chunks(const void* x, const void* w, void* y, const std::vector<ChunkSpan>& sizes, int64_t in, int64_t out, DType y_type,
                             cudaStream_t s) {
  int64_t n = 0;
  for (const auto& c : sizes) {
    if (c.cap > INT32_MAX || c.n > INT32_MAX || c.cap <= 0) throw std::invalid_argument("chunked products: chunk sizes past int32 or empty");
    n += c.n;
  }
  if (n == 0) return;
  if (in > INT32_MAX || out > INT32_MAX) throw std::invalid_argument("chunked products: dimensions past int32");
  auto h = static_cast<cublasHandle_t>(on_stream(s));
  const cudaDataType_t yt = cublas_type(y_type);
  const size_t ysize = y_type == DType::F32 ? 4 : 2;
  // per size: its n weight pointers, then its n x pointers, then its n y pointers
  void** hp = staging(3 * n);
  int64_t at = 0;
  for (const auto& c : sizes) {
    for (int64_t i = 0; i < c.n; ++i) {
      hp[at + i] = static_cast<char*>(const_cast<void*>(w)) + size_t(c.expert[i]) * size_t(out * in) * 2;
      hp[at + c.n + i] = static_cast<char*>(const_cast<void*>(x)) + size_t(c.first_row[i]) * size_t(in) * 2;
      hp[at + 2 * c.n + i] = static_cast<char*>(y) + size_t(c.first_row[i]) * size_t(out) * ysize;
    }
    at += 3 * c.n;
  }
  void** dp = upload(3 * n, s);
  const float alpha = 1.0f, beta = 0.0f;
  for (const auto& c : sizes) {
    if (c.n == 0) continue;
    check(cublasGemmBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(out), int(c.cap), int(in), &alpha, const_cast<const void* const*>(dp), CUDA_R_16BF,
                              int(in), const_cast<const void* const*>(dp + c.n), CUDA_R_16BF, int(in), &beta, dp + 2 * c.n, yt, int(out), int(c.n),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "batched gemm");
    dp += 3 * c.n;
  }
}

}  // namespace pdb::cuda

