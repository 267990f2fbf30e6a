// RMSNorm, CPU: y = x / sqrt(mean(x^2) + eps) * w. The sum of squares is accumulated in double,
// as ggml-cpu does, so the recipe's normalized input matches the decoder's.
#pragma once
#include <cstdint>

namespace pdb {

void rmsnorm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps);

}  // namespace pdb
