// Our Q8_0 / Q4_0 encoders against the real llama-quantize: byte-identical blocks on the same F32 tensors.
#include <gtest/gtest.h>

#include <filesystem>

#include "formats/gguf.h"
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

}  // namespace pdb
