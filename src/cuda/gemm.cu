#include "cuda/gemm.cuh"

#include <cublasLt.h>

#include <stdexcept>

#include <fmt/format.h>

#include "cuda/common.cuh"
#include "cuda/device.h"

#include <algorithm>
#include <vector>
#include <cuda_bf16.h>

namespace pdb::cuda {
namespace {

void check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(fmt::format("cuBLASLt {} failed: status {}", what, int(st)));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::F32: return CUDA_R_32F;
  }
  return CUDA_R_32F;
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

Gemm::Gemm(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  cublasLtHandle_t h = nullptr;
  check(cublasLtCreate(&h), "create");
  handle_ = h;
  PDB_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

Gemm::~Gemm() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

// Column-major view: Y^T[out x rows] = W^T(op T of the [in x out] column-major W) * X^T([in x rows]).
Gemm::Plan& Gemm::plan(DType ab, DType yt, int64_t rows, int64_t in, int64_t out, bool accumulate) {
  std::lock_guard<std::mutex> lock(mu_);
  const Key key{int(ab), int(yt), rows, in, out, accumulate};
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;  // f32 accumulation; never TF32
  check(cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F), "desc");
  const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT), "transa");
  check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN), "transb");
  check(cublasLtMatrixLayoutCreate(&p->a, cuda_type(ab), uint64_t(in), uint64_t(out), in), "layout a");
  check(cublasLtMatrixLayoutCreate(&p->b, cuda_type(ab), uint64_t(in), uint64_t(rows), in), "layout b");
  check(cublasLtMatrixLayoutCreate(&p->c, cuda_type(yt), uint64_t(out), uint64_t(rows), out), "layout c");
  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "preference");
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof workspace_bytes_),
        "workspace");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), p->desc, p->a, p->b, p->c, p->c,
                                                           pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0)
    throw std::runtime_error(fmt::format("cuBLASLt has no algorithm for {}x{}x{} (types {} -> {})", rows, in, out, int(ab), int(yt)));
  p->algo = result.algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void Gemm::xwt(DType ab, const void* x, const void* w, DType yt, void* y, int64_t rows, int64_t in, int64_t out, float beta,
               cudaStream_t stream) {
  if (rows == 0) return;
  if (ab == DType::F32 && yt != DType::F32) throw std::invalid_argument("f32 products write f32");
  Plan& p = plan(ab, yt, rows, in, out, beta != 0.0f);
  const float alpha = 1.0f;
  check(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.desc, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c, &p.algo,
                       workspace_, workspace_bytes_, stream),
        "matmul");
}

namespace {
__global__ void fill_random_bf16(__nv_bfloat16* x, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    x[i] = __float2bfloat16_rn(float(h & 0xffff) / 32768.0f - 1.0f);
  }
}
}  // namespace

double measure_bf16_gemm_tflops(int64_t n) {
  if (device_count() == 0) return 0.0;
  Gemm gemm;
  DeviceBuffer a(size_t(n * n) * 2), b(size_t(n * n) * 2), c(size_t(n * n) * 2);
  fill_random_bf16<<<1024, 256>>>(a.as<__nv_bfloat16>(), n * n, 17u);
  fill_random_bf16<<<1024, 256>>>(b.as<__nv_bfloat16>(), n * n, 91u);
  PDB_CUDA_LAUNCHED();
  cudaEvent_t e0, e1;
  PDB_CUDA_CHECK(cudaEventCreate(&e0));
  PDB_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 13; ++i) {
    PDB_CUDA_CHECK(cudaEventRecord(e0));
    gemm.xwt(DType::BF16, a.get(), b.get(), DType::BF16, c.get(), n, n, n, 0.0f, nullptr);
    PDB_CUDA_CHECK(cudaEventRecord(e1));
    PDB_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    PDB_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 3) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return 2.0 * double(n) * double(n) * double(n) / (double(ms[ms.size() / 2]) * 1e-3) / 1e12;
}

}  // namespace pdb::cuda
