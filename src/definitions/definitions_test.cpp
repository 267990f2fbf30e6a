#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "definitions/definition.h"

namespace pdb {

TEST(Definitions, EveryArchitectureIsFoundByItsNameAndAnUnknownOneIsRefusedWithTheKnownNames) {
  const auto names = defined_architectures();
  ASSERT_EQ(names.size(), 4u);
  for (const auto& n : names) EXPECT_EQ(model_definition(n).name, n);
  try {
    model_definition("gemma3");
    FAIL() << "an unknown architecture was accepted";
  } catch (const std::invalid_argument& e) {
    for (const auto& n : names) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

// The rules the engines once read from the architecture's name, now the definitions' data.
TEST(Definitions, LayerPlansAndRulesAreTheArchitecturesOwn) {
  HfConfig c;
  c.intermediate_size = 384;
  c.moe_intermediate_size = 64;
  c.n_shared_experts = 2;
  c.first_k_dense_replace = 1;
  c.norm_topk_prob = false;
  const auto& llama = model_definition("llama");
  EXPECT_TRUE(llama.gguf_permutes_qk);
  EXPECT_FALSE(llama.qk_norm);
  EXPECT_EQ(llama.ffn(c, 3).kind, FfnKind::swiglu);
  EXPECT_EQ(llama.ffn(c, 3).swiglu_width, 384);
  const auto& qwen3 = model_definition("qwen3");
  EXPECT_TRUE(qwen3.qk_norm);
  EXPECT_EQ(qwen3.decoder_rope, RopeMode::Neox);
  EXPECT_FALSE(qwen3.gguf_permutes_qk);
  const auto& moe = model_definition("qwen3moe");
  EXPECT_EQ(moe.ffn(c, 0).kind, FfnKind::routed);
  EXPECT_TRUE(moe.renormalize_topk(c));  // llama.cpp's qwen3moe renormalizes whatever config.json says
  const auto& ds = model_definition("deepseek2");
  EXPECT_EQ(ds.attention, AttentionKind::mla);
  EXPECT_FALSE(ds.resumable);
  EXPECT_FALSE(ds.renormalize_topk(c));  // deepseek2 as its config says
  EXPECT_EQ(ds.ffn(c, 0).kind, FfnKind::swiglu);
  EXPECT_EQ(ds.ffn(c, 0).swiglu_width, 384);
  EXPECT_EQ(ds.ffn(c, 1).kind, FfnKind::shared_and_routed);
  EXPECT_EQ(ds.ffn(c, 1).swiglu_width, 128);
  EXPECT_EQ(ds.ffn(c, 1).swiglu_prefix, "mlp.shared_experts.");
}

}  // namespace pdb
