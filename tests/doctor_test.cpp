// doctor catches a wrong RoPE setting in each place it can live: the HF config the prefill engine
// runs, the decoder's GGUF, the prefill server's recipe GGUF, and the decoder's runtime flags.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "formats/gguf.h"
#include "support/stack.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// A copy of a GGUF with one metadata value changed (tensors byte for byte).
void copy_gguf_with(const std::string& src, const std::string& dst, const std::string& key, GgufValue v) {
  auto g = GgufFile::open(src);
  GgufWriter w;
  for (const auto& [k, val] : g->kv()) w.set(k, k == key ? v : val);
  for (const auto& t : g->tensors())
    w.add_tensor_bytes(t.name, t.type, t.ne, std::vector<uint8_t>(g->data(t), g->data(t) + t.n_bytes()));
  w.write(dst, g->alignment());
}

std::string tiny() { return test::models_dir() + "/llama-tiny"; }

}  // namespace

TEST(Doctor, HealthyDeploymentPasses) {
  test::StackOptions so;
  so.model_dir = tiny();
  test::Stack st(so);
  std::string out;
  EXPECT_EQ(st.run_doctor(&out), 0) << out;
  EXPECT_NE(out.find("decoder calibration"), std::string::npos) << out;
  EXPECT_NE(out.find("fingerprints"), std::string::npos) << out;
  // the decoder's fidelity class, and one bridge end to end with the first token's KL against the decoder's own
  EXPECT_NE(out.find("[ ok ] decoder fidelity class mirrored"), std::string::npos) << out;
  EXPECT_NE(out.find("[ ok ] bridge probe           complete"), std::string::npos) << out;
  EXPECT_NE(out.find("KL "), std::string::npos) << out;
}

TEST(Doctor, WrongRopeInTheDecodersRuntimeFlags) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.decoder_extra = {"--rope-freq-base", "250000"};
  test::Stack st(so);
  std::string out;
  EXPECT_NE(st.run_doctor(&out), 0);
  EXPECT_NE(out.find("[FAIL] decoder calibration"), std::string::npos) << out;
  EXPECT_NE(out.find("[FAIL] bridge probe"), std::string::npos) << out;  // declined, served natively
  // and the front door refuses to mount anything onto that decoder
  auto r = st.post_front("/completion", {{"prompt", test::random_text(9, 600)}, {"n_predict", 4}, {"temperature", 0}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.verdict().value("verdict", "").find("calibration"), std::string::npos) << r.verdict().dump();
  EXPECT_LT(r.json()["timings"]["cache_n"].get<int64_t>(), 10);
}

TEST(Doctor, WrongRopeInThePrefillRecipeGguf) {
  const std::string dir = test::temp_dir("rope-recipe");
  copy_gguf_with(tiny() + "/decoder-f32.gguf", dir + "/recipe.gguf", "llama.rope.freq_base", GgufValue::of_f32(250000.0f));
  test::StackOptions so;
  so.model_dir = tiny();
  so.recipe_gguf = dir + "/recipe.gguf";
  so.prefill_extra = {"--allow-config-mismatch"};
  test::Stack st(so);
  std::string out;
  EXPECT_NE(st.run_doctor(&out), 0);
  EXPECT_NE(out.find("[FAIL] fingerprints"), std::string::npos) << out;
  EXPECT_NE(out.find("rope_freq_base"), std::string::npos) << out;
}

TEST(Doctor, WrongRopeInTheHfConfig) {
  const std::string dir = test::temp_dir("rope-hf");
  fs::copy(tiny() + "/hf", dir + "/hf", fs::copy_options::recursive);
  json c = json::parse(std::ifstream(dir + "/hf/config.json"));
  c["rope_theta"] = 250000.0;
  std::ofstream(dir + "/hf/config.json") << c.dump(2);
  // the prefill server refuses to start on it...
  test::Child refuse({test::pdbridge_bin(), "prefill", "--model", dir + "/hf", "--recipe", tiny() + "/decoder-f32.gguf", "--port",
                      std::to_string(test::free_port())},
                     dir + "/refuse.log");
  EXPECT_NE(refuse.stop(0, 60), 0);
  EXPECT_NE(refuse.log().find("rope_theta"), std::string::npos) << refuse.log();
  // ...and, forced, doctor names the difference
  test::StackOptions so;
  so.model_dir = tiny();
  so.hf_dir = dir + "/hf";
  so.prefill_extra = {"--allow-config-mismatch"};
  test::Stack st(so);
  std::string out;
  EXPECT_NE(st.run_doctor(&out), 0);
  EXPECT_NE(out.find("rope_theta"), std::string::npos) << out;
}

TEST(Doctor, WrongRopeInTheDecoderGguf) {
  const std::string dir = test::temp_dir("rope-dec");
  fs::create_directories(dir + "/model");
  fs::copy(tiny() + "/hf", dir + "/model/hf", fs::copy_options::recursive);
  copy_gguf_with(tiny() + "/decoder-f32.gguf", dir + "/model/decoder-f32.gguf", "llama.rope.freq_base", GgufValue::of_f32(250000.0f));
  test::StackOptions so;
  so.model_dir = dir + "/model";  // decoder and front use the altered GGUF
  so.recipe_gguf = tiny() + "/decoder-f32.gguf";  // the prefill server the original
  test::Stack st(so);
  std::string out;
  EXPECT_NE(st.run_doctor(&out), 0);
  EXPECT_NE(out.find("[FAIL] fingerprints"), std::string::npos) << out;
  EXPECT_NE(out.find("[FAIL] HF config vs GGUF"), std::string::npos) << out;
}

}  // namespace pdb
