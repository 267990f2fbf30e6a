#include "formats/hf_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

namespace pdb {
using json = nlohmann::json;

namespace {
json base() {
  return {{"model_type", "llama"}, {"hidden_size", 4096}, {"intermediate_size", 14336}, {"num_hidden_layers", 32},
          {"num_attention_heads", 32}, {"num_key_value_heads", 8}, {"vocab_size", 128256}, {"rope_theta", 500000.0},
          {"rms_norm_eps", 1e-5}, {"max_position_embeddings", 131072}};
}
}  // namespace

TEST(HfConfig, ParsesLlamaDefaultsAndHeadDim) {
  auto c = HfConfig::parse(base());
  EXPECT_EQ(c.arch, "llama");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::None);
  auto j = base();
  j["model_type"] = "qwen3";
  j["head_dim"] = 64;
  j["tie_word_embeddings"] = true;
  c = HfConfig::parse(j);
  EXPECT_EQ(c.arch, "qwen3");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(HfConfig::parse(c.to_json()).head_dim, 64);
}

TEST(HfConfig, RopeScalingTypes) {
  auto j = base();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  auto c = HfConfig::parse(j);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::Llama3);
  auto f = c.inv_freq();
  // highest frequency untouched, lowest divided by the factor
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  EXPECT_NEAR(f[63], 1.0 / std::pow(500000.0, 126.0 / 128.0) / 8.0, 1e-18);
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  c = HfConfig::parse(j);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::Linear);
  EXPECT_DOUBLE_EQ(c.inv_freq()[0], 0.5);
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  c = HfConfig::parse(j);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::Yarn);
  EXPECT_NEAR(c.attention_scaling(), 0.1 * std::log(4.0) + 1.0, 1e-12);
  f = c.inv_freq();
  EXPECT_DOUBLE_EQ(f[0], 1.0);                                                   // extrapolated
  EXPECT_NEAR(f[63], 1.0 / std::pow(500000.0, 126.0 / 128.0) / 4.0, 1e-18);     // interpolated
  j["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(HfConfig::parse(j).rope_scaling.type, RopeScalingType::None);
  j["rope_scaling"] = nullptr;
  EXPECT_EQ(HfConfig::parse(j).rope_scaling.type, RopeScalingType::None);
}

TEST(HfConfig, ClearErrors) {
  auto j = base();
  j["model_type"] = "mamba";
  EXPECT_THROW(HfConfig::parse(j), std::runtime_error);
  j = base();
  j["hidden_size"] = "big";
  EXPECT_THROW(HfConfig::parse(j), std::runtime_error);
  j = base();
  j["rope_scaling"] = {{"rope_type", "longrope"}};
  try { HfConfig::parse(j); FAIL(); } catch (const std::runtime_error& e) { EXPECT_NE(std::string(e.what()).find("longrope"), std::string::npos); }
  j = base();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  EXPECT_TRUE(HfConfig::parse(j).fp8);
}

}  // namespace pdb
