#include "model/product_numerics.h"

#include <stdexcept>

#include <fmt/format.h>

#include "numerics/decoder_numerics.h"

namespace pdb {

ProductNumerics parse_product_numerics(const std::string& name) {
  if (name == "bf16") return ProductNumerics::bf16;
  if (name == "half") return ProductNumerics::half;
  if (name == "cpu") return ProductNumerics::cpu;
  if (name == "cuda") return ProductNumerics::cuda;
  throw std::invalid_argument(fmt::format("--numerics {}: bf16, half (Metal), cpu (ggml-cpu) or cuda (ggml-cuda)", name));
}

const char* product_numerics_name(ProductNumerics n) {
  switch (n) {
    case ProductNumerics::bf16: return "bf16";
    case ProductNumerics::half: return "half";
    case ProductNumerics::cpu: return "cpu";
    case ProductNumerics::cuda: return "cuda";
  }
  return "?";
}

std::string product_numerics_description(ProductNumerics n) {
  switch (n) {
    case ProductNumerics::bf16: return "bf16 products";
    case ProductNumerics::half: return "half products (Metal's: half weights, half activations)";
    case ProductNumerics::cpu: return "ggml-cpu's products (activations as the weight type's vec_dot_type, half weights)";
    case ProductNumerics::cuda: return "ggml-cuda's products (activations as q8_1 for quantized weights, half weights)";
  }
  return "?";
}

namespace {
bool float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }
}  // namespace

WeightProducts weight_products(ProductNumerics n, GgmlType t) {
  if (n == ProductNumerics::bf16 || t == GgmlType::BF16) return {};
  switch (n) {
    case ProductNumerics::half: return {true, 0};
    case ProductNumerics::cpu:
      switch (ggmlnum::act_quant_for(t)) {  // ggml-cpu's vec_dot_type
        case ggmlnum::ActQuant::q8_0: return {true, 32};
        case ggmlnum::ActQuant::q8_k: return {true, 256};
        case ggmlnum::ActQuant::none: return {true, 0};
      }
      return {true, 0};
    case ProductNumerics::cuda: return {true, float_type(t) ? 0 : 32};
    case ProductNumerics::bf16: break;
  }
  return {};
}

}  // namespace pdb
