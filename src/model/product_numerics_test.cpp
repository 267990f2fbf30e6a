// The products' rounding under each decoder class (model/product_numerics.h): ggml-cpu's vec_dot_type table as the
// activations' blocks, ggml-cuda's q8_1 for every quantized type, Metal's half, and BF16 weights kept bf16.
#include "model/product_numerics.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace pdb {

TEST(ProductNumerics, EachDecoderClassRoundsTheActivationsItsOwnWay) {
  using T = GgmlType;
  using P = ProductNumerics;
  const WeightProducts bf16{}, half{true, 0}, q8_0{true, 32}, q8_k{true, 256};
  for (T t : {T::F32, T::F16, T::BF16, T::Q4_0, T::Q4_K, T::IQ2_XS}) EXPECT_EQ(weight_products(P::bf16, t), bf16) << ggml_type_name(t);
  for (P p : {P::half, P::cpu, P::cuda}) EXPECT_EQ(weight_products(p, T::BF16), bf16) << product_numerics_name(p);
  // ggml-cpu: type_traits_cpu[t].vec_dot_type (Q8_1's values are Q8_0's)
  for (T t : {T::Q4_0, T::Q4_1, T::Q5_0, T::Q5_1, T::Q8_0, T::IQ4_NL, T::MXFP4}) EXPECT_EQ(weight_products(P::cpu, t), q8_0) << ggml_type_name(t);
  for (T t : {T::Q2_K, T::Q3_K, T::Q4_K, T::Q5_K, T::Q6_K, T::IQ4_XS, T::IQ2_XXS, T::IQ2_XS, T::IQ2_S, T::IQ3_XXS, T::IQ3_S, T::IQ1_S, T::IQ1_M})
    EXPECT_EQ(weight_products(P::cpu, t), q8_k) << ggml_type_name(t);
  EXPECT_EQ(weight_products(P::cpu, T::F16), half);
  // ggml-cuda's MMQ: q8_1 blocks of 32 for every quantized type, K-quants included
  for (T t : {T::Q4_0, T::Q4_K, T::Q6_K, T::IQ3_XXS}) EXPECT_EQ(weight_products(P::cuda, t), q8_0) << ggml_type_name(t);
  EXPECT_EQ(weight_products(P::cuda, T::F16), half);
  // Metal's kernel_mul_mm: half weights and half activations whatever the type
  for (T t : {T::F16, T::Q4_0, T::Q4_K, T::IQ2_XS}) EXPECT_EQ(weight_products(P::half, t), half) << ggml_type_name(t);
}

TEST(ProductNumerics, NamesRoundTripAndUnknownOnesAreRefused) {
  for (const char* n : {"bf16", "half", "cpu", "cuda"}) EXPECT_STREQ(product_numerics_name(parse_product_numerics(n)), n);
  try {
    parse_product_numerics("metal");
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("bf16, half (Metal), cpu (ggml-cpu) or cuda (ggml-cuda)"), std::string::npos) << e.what();
  }
}

}  // namespace pdb
