// Builds without CUDA: the CUDA backend is absent and says so.
#include <stdexcept>

#include "arch/backends.h"

namespace pdb {

bool cuda_backend_available() { return false; }

std::unique_ptr<PrefillBackend> make_cuda_backend(const std::string&, std::shared_ptr<const Recipe>, int, int64_t, bool, int, bool, double, bool,
                                                  ProductNumerics) {
  throw std::runtime_error("--device cuda: this build has no CUDA (nvcc was not found at configure time); use --device cpu");
}

std::unique_ptr<PrefillBackend> make_cuda_dsv4_backend(const std::string&, const std::string&) {
  throw std::runtime_error("--device cuda: this build has no CUDA (nvcc was not found at configure time); use --device cpu");
}

}  // namespace pdb
