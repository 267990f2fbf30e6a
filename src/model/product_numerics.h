// How the CUDA engine rounds the operands of its weight products when it runs the decoder's GGUF: the residual stream
// then follows the decoder's own arithmetic class instead of bf16's (issue 35's "numerics that follow the decoder").
//   bf16 — bf16 weights and activations (the engine's fastest; the only mode for a checkpoint)
//   half — Metal's prompt products (llama.cpp's kernel_mul_mm): weights dequantized to half, activations cast to half
//   cpu  — ggml-cpu's: activations quantized to the weight type's vec_dot_type (Q8_0, Q8_1, Q8_K, F16) as ggml-cpu's
//          x86 quantizers round them, then multiplied with the weights' exact values in half precision
//   cuda — ggml-cuda's MMQ: activations as q8_1 (32-value blocks) for every quantized type; half for F16/F32 weights
// Every mode keeps f32 sums and an f32 residual; BF16 weights keep bf16 products (every decoder multiplies them so).
#pragma once
#include <string>

#include "formats/ggml_types.h"

namespace pdb {

enum class ProductNumerics { bf16, half, cpu, cuda };

// "bf16", "half", "cpu", "cuda"; throws std::invalid_argument naming them.
ProductNumerics parse_product_numerics(const std::string& name);
const char* product_numerics_name(ProductNumerics n);
std::string product_numerics_description(ProductNumerics n);

// How one weight's products run under a mode: half-precision weights (else bf16), and the block in which the
// activations are quantized first (0: none; 32: Q8_0/Q8_1 values; 256: Q8_K values).
struct WeightProducts {
  bool half = false;
  int act_block = 0;
  bool operator==(const WeightProducts&) const = default;
};
WeightProducts weight_products(ProductNumerics n, GgmlType weight_type);

}  // namespace pdb
