#include "definitions/definition.h"
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

namespace pdb {

// Qwen3-30B-A3B's config.json fields, and what llama.cpp's qwen3moe cannot run.
TEST(HfConfig, ParsesQwen3MoeAndRefusesDenseLayersBetweenExperts) {
  json j = {{"model_type", "qwen3_moe"}, {"hidden_size", 2048}, {"intermediate_size", 6144}, {"num_hidden_layers", 48},
            {"num_attention_heads", 32}, {"num_key_value_heads", 4}, {"head_dim", 128}, {"vocab_size", 151936},
            {"num_experts", 128}, {"num_experts_per_tok", 8}, {"moe_intermediate_size", 768}, {"norm_topk_prob", true},
            {"decoder_sparse_step", 1}, {"mlp_only_layers", json::array()}, {"rope_theta", 1000000.0}};
  auto c = HfConfig::parse(j);
  EXPECT_EQ(c.arch, "qwen3moe");
  EXPECT_TRUE(c.moe());
  EXPECT_TRUE(model_definition(c.arch).qk_norm);  // its engines' blocks (definitions/qwen3moe.cpp)
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  const auto back = HfConfig::parse(c.to_json());  // what make-model writes reads back the same
  EXPECT_EQ(back.arch, "qwen3moe");
  EXPECT_EQ(back.num_experts, 128);
  EXPECT_EQ(back.moe_intermediate_size, 768);
  auto bad = j;
  bad["mlp_only_layers"] = {0, 47};
  EXPECT_THROW(HfConfig::parse(bad), std::runtime_error);
  bad = j;
  bad["decoder_sparse_step"] = 2;
  EXPECT_THROW(HfConfig::parse(bad), std::runtime_error);
  bad = j;
  bad["num_experts_per_tok"] = 129;
  EXPECT_THROW(HfConfig::parse(bad), std::runtime_error);
  bad = j;
  bad.erase("num_experts");
  EXPECT_THROW(HfConfig::parse(bad), std::runtime_error);
}

}  // namespace pdb

namespace pdb {
// A llama3-scaled model read from its GGUF keeps the GGUF's rope_freqs (the divisors llama.cpp applies) instead of
// config.json's four numbers: the frequencies agree with HF's formula to the factors' f32 rounding.
TEST(HfConfig, Llama3FrequenciesFromAGgufsRopeFreqsAgreeWithTheFormula) {
  auto j = base();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  const auto hf = HfConfig::parse(j);
  HfConfig from_gguf = HfConfig::parse(base());
  from_gguf.rope_scaling.type = RopeScalingType::Llama3;
  for (int64_t i = 0; i < hf.head_dim / 2; ++i) {  // the converter's factors (formats/hf_to_gguf.cpp), as f32
    const double base_f = 1.0 / std::pow(hf.rope_theta, double(2 * i) / double(hf.head_dim));
    from_gguf.rope_scaling.freq_factors.push_back(float(base_f / hf.inv_freq()[size_t(i)]));
  }
  const auto a = hf.inv_freq(), b = from_gguf.inv_freq();
  ASSERT_EQ(a.size(), b.size());
  int scaled = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(b[i] / a[i], 1.0, 1e-7) << i;
    scaled += from_gguf.rope_scaling.freq_factors[i] > 1.0f;
  }
  EXPECT_GT(scaled, 10);  // the low frequencies are divided
  from_gguf.rope_scaling.freq_factors.pop_back();
  EXPECT_THROW(from_gguf.inv_freq(), std::runtime_error);
}
}  // namespace pdb
