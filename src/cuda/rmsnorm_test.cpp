// CUDA kernels against their CPU twins. Runs where a GPU is present; skips (saying why) elsewhere.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cuda/device.h"
#include "numerics/rmsnorm.h"
#ifdef PDBRIDGE_HAVE_CUDA
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

}  // namespace pdb
