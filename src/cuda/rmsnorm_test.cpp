// CUDA kernels against their CPU twins. Runs where a GPU is present; skips (saying why) elsewhere.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cuda/device.h"
#include "numerics/rmsnorm.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include <cuda_fp16.h>

#include "cuda/common.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/rmsnorm.cuh"
#endif

namespace pdb {

TEST(CudaKernels, RmsNormMatchesCpuTwin) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  const int64_t rows = 257, dim = 4096;
  std::mt19937 g(3);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> x(static_cast<size_t>(rows * dim)), w(static_cast<size_t>(dim)), ref(x.size());
  for (auto& v : x) v = d(g);
  for (auto& v : w) v = 1.0f + 0.1f * d(g);
  rmsnorm_rows(x.data(), w.data(), ref.data(), rows, dim, 1e-5f);
  auto y = cuda::rmsnorm_rows_host(x, w, rows, dim, 1e-5f);
  double max_rel = 0;
  size_t identical = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    max_rel = std::max(max_rel, double(std::fabs(y[i] - ref[i]) / (std::fabs(ref[i]) + 1e-6f)));
    identical += y[i] == ref[i];
  }
  std::printf("rmsnorm GPU vs CPU: %.4f%% identical, max rel err %.3g\n", 100.0 * double(identical) / double(y.size()), max_rel);
  EXPECT_LT(max_rel, 1e-5);
#endif
}

// The recipe's norm written as f16 in one pass (rmsnorm_rows_f16) against the norm then f32_to_f16: the same bits, with
// and without weights, for rows of Llama's 4,096 and of a width that is no multiple of the block (1,000).
TEST(CudaKernels, RmsNormToF16IsTheTwoPassesBitForBit) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  for (const int64_t dim : {int64_t(4096), int64_t(1000)}) {
    const int64_t rows = 67;
    std::mt19937 g(11);
    std::normal_distribution<float> d(0.0f, 3.0f);
    std::vector<float> x(static_cast<size_t>(rows * dim)), w(static_cast<size_t>(dim));
    for (auto& v : x) v = d(g);
    for (auto& v : w) v = 1.0f + 0.2f * d(g);
    cuda::DeviceBuffer dx(x.size() * 4), dw(w.size() * 4), y32(x.size() * 4), a(x.size() * 2), b(x.size() * 2);
    dx.upload(x.data(), x.size() * 4);
    dw.upload(w.data(), w.size() * 4);
    for (const bool weighted : {true, false}) {
      const float* wp = weighted ? dw.as<float>() : nullptr;
      cuda::rmsnorm_rows_f16(dx.as<float>(), wp, a.as<__half>(), rows, dim, 1e-5f, nullptr);
      cuda::rmsnorm_rows(dx.as<float>(), wp, y32.as<float>(), rows, dim, 1e-5f, nullptr);
      cuda::f32_to_f16(y32.as<float>(), b.as<__half>(), rows * dim, nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<uint16_t> ha(x.size()), hb(x.size());
      a.download(ha.data(), ha.size() * 2);
      b.download(hb.data(), hb.size() * 2);
      EXPECT_EQ(ha, hb) << "dim " << dim << (weighted ? ", weighted" : ", no weights");
    }
  }
#endif
}

}  // namespace pdb
