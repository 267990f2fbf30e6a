// Our Q8_0 / Q4_0 encoders against the real llama-quantize: byte-identical blocks on the same F32 tensors.
#include <gtest/gtest.h>

#include <filesystem>

#include "formats/gguf.h"
#include "formats/weight_source.h"
#include "tools/make_model.h"
#include "support/test_env.h"

namespace pdb {
namespace fs = std::filesystem;

class QuantizeIdentity : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizeIdentity, EncodersMatchLlamaQuantizeByteForByte) {
  const std::string dir = test::models_dir() + "/llama-tiny";
  const std::string qtype = GetParam();
  auto f32 = GgufFile::open(dir + "/decoder-f32.gguf");
  auto q = GgufFile::open(dir + "/decoder-" + qtype + ".gguf");
  const GgmlType want = *ggml_type_from_name(qtype);
  int compared = 0;
  size_t bytes = 0;
  for (const auto& t : q->tensors()) {
    if (t.type != want) continue;
    const auto& src = f32->tensor(t.name);
    ASSERT_EQ(src.type, GgmlType::F32) << t.name;
    ASSERT_EQ(src.ne, t.ne);
    const auto* x = reinterpret_cast<const float*>(f32->data(src));
    std::vector<uint8_t> ours(t.n_bytes());
    const size_t row_bytes = ggml_row_bytes(want, t.ne[0]);
    for (int64_t r = 0; r < t.rows(); ++r) quantize_row(want, x + r * t.ne[0], ours.data() + r * row_bytes, t.ne[0]);
    const uint8_t* theirs = q->data(t);
    size_t first_diff = ours.size();
    for (size_t i = 0; i < ours.size(); ++i) if (ours[i] != theirs[i]) { first_diff = i; break; }
    EXPECT_EQ(first_diff, ours.size()) << t.name << ": first differing byte " << first_diff << " of " << ours.size();
    ++compared;
    bytes += ours.size();
  }
  // every attention/ffn projection of every layer was quantized to this type
  EXPECT_GE(compared, 2 * 7) << "llama-quantize produced too few " << qtype << " tensors";
  std::printf("compared %d %s tensors, %zu bytes, all identical\n", compared, qtype.c_str(), bytes);
}

INSTANTIATE_TEST_SUITE_P(Types, QuantizeIdentity, ::testing::Values("q8_0", "q4_0"));

// make-model --no-hf --quantize-from q8_0 (the 30B MoE's K-quants on a 64 GB disk): no checkpoint, a Q8_0 GGUF written
// here whose every tensor equals llama-quantize's from the F32 GGUF, and the K-quant llama-quantize requantizes from it.
TEST(MakeModel, Q8SourceWithoutACheckpointIsLlamaQuantizesQ8) {
  for (const auto& [arch, seed, models] : {std::tuple<std::string, uint64_t, std::string>{"llama", 1, "llama-tiny"}, {"qwen3moe", 3, "qwen3moe-tiny"}}) {
    MakeModelOptions o;
    o.arch = arch;
    o.seed = seed;
    o.out = test::temp_dir("make-model-q8-" + arch);
    o.no_hf = true;
    o.quantize_from = "q8_0";
    o.gguf_types = {"q8_0", "q4_K_M"};
    o.threads = 2;
    o.vocab_dir = test::llama_src() + "/models";
    o.llama_bin = test::llama_bin();
    make_model(o);
    EXPECT_FALSE(fs::exists(o.out + "/hf")) << o.out;
    const auto diff = gguf_weight_differences(*GgufFile::open(o.out + "/decoder-q8_0.gguf"),
                                              *GgufFile::open(test::models_dir() + "/" + models + "/decoder-q8_0.gguf"));
    EXPECT_TRUE(diff.empty()) << arch << ": " << diff[0];
    // llama-quantize requantized it: Q4_K_M's file type (15), every tensor there, the projections no longer q8_0 (these
    // tiny rows of 128 are not whole K-quant super-blocks: it falls back to its 32-weight types for them)
    auto k = GgufFile::open(o.out + "/decoder-q4_K_M.gguf");
    EXPECT_EQ(k->get("general.file_type").u, 15u) << arch;
    EXPECT_EQ(k->tensors().size(), GgufFile::open(o.out + "/decoder-q8_0.gguf")->tensors().size()) << arch;
    int requantized = 0;
    for (const auto& t : k->tensors()) requantized += t.ne.size() >= 2 && t.type != GgmlType::Q8_0 && t.type != GgmlType::F32;
    EXPECT_GE(requantized, 4) << arch << ": llama-quantize left every matrix q8_0";
  }
  MakeModelOptions bad;
  bad.out = test::temp_dir("make-model-bad");
  bad.quantize_from = "q4_0";
  bad.vocab_dir = test::llama_src() + "/models";
  bad.llama_bin = test::llama_bin();
  bad.gguf_types = {"q4_K_M"};
  EXPECT_THROW(make_model(bad), std::invalid_argument);
}

}  // namespace pdb
