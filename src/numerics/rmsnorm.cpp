#include "numerics/rmsnorm.h"

#include <cmath>

namespace pdb {

void rmsnorm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double sum = 0.0;
    for (int64_t i = 0; i < dim; ++i) sum += double(xr[i] * xr[i]);  // float product, double sum: ggml-cpu's order
    const float mean = float(sum / double(dim));
    const float scale = 1.0f / std::sqrt(mean + eps);
    // ggml: y = x*scale first (ggml_rms_norm), then the weight multiply (separate ggml_mul)
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * scale;
    if (w)
      for (int64_t i = 0; i < dim; ++i) yr[i] = yr[i] * w[i];
  }
}

}  // namespace pdb
