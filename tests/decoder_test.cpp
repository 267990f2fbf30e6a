// make-model outputs load in the real llama-server (started by `pdbridge decoder`) and complete a prompt.
#include <gtest/gtest.h>

#include <signal.h>

#include <filesystem>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "formats/gguf.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "support/test_env.h"
#include "tools/make_model.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;

struct DecoderCase { std::string model, type; };
void PrintTo(const DecoderCase& c, std::ostream* os) { *os << c.model << "/" << c.type; }

class DecoderLoads : public ::testing::TestWithParam<DecoderCase> {};

TEST_P(DecoderLoads, LlamaServerCompletesAPrompt) {
  const auto& c = GetParam();
  const std::string gguf = test::models_dir() + "/" + c.model + "/decoder-" + c.type + ".gguf";
  ASSERT_TRUE(fs::exists(gguf)) << gguf;
  const int port = test::free_port();
  const std::string slots = test::temp_dir("slots");
  test::Child dec({test::pdbridge_bin(), "decoder", "--gguf", gguf, "--port", std::to_string(port), "--slot-dir", slots,
                   "--ctx", "1024", "--parallel", "2", "--threads", "2"},
                  slots + "/../decoder-" + c.model + "-" + c.type + ".log");
  ASSERT_TRUE(test::wait_http_ok("127.0.0.1", port, "/health", 120)) << dec.log();
  EXPECT_NE(dec.log().find("--slot-save-path"), std::string::npos) << "decoder must print the exact command";
  httplib::Client cli("127.0.0.1", port);
  cli.set_read_timeout(120, 0);
  json req = {{"prompt", "The quick brown fox jumps over the lazy dog."}, {"n_predict", 8}, {"temperature", 0}, {"id_slot", 1}};
  auto r = cli.Post("/completion", req.dump(), "application/json");
  ASSERT_TRUE(r) << "no response";
  ASSERT_EQ(r->status, 200) << r->body;
  auto j = json::parse(r->body);
  EXPECT_EQ(j["tokens_predicted"].get<int>(), 8) << r->body;
  EXPECT_GT(j["tokens_evaluated"].get<int>(), 5);
  EXPECT_EQ(j["id_slot"].get<int>(), 1);
  // The server saves the slot into the directory it was given.
  auto s = cli.Post("/slots/1?action=save", R"({"filename":"probe.bin"})", "application/json");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->status, 200) << s->body;
  EXPECT_TRUE(fs::exists(slots + "/probe.bin"));
  // SIGTERM to pdbridge reaches llama-server, which shuts down.
  const int rc = dec.stop(SIGTERM, 30);
  EXPECT_TRUE(rc == 0 || rc == 128 + SIGTERM) << "exit " << rc;
  EXPECT_FALSE(test::wait_http_ok("127.0.0.1", port, "/health", 1.0)) << "llama-server still serving after SIGTERM";
}

INSTANTIATE_TEST_SUITE_P(Models, DecoderLoads,
                         ::testing::Values(DecoderCase{"llama-tiny", "f32"}, DecoderCase{"llama-tiny", "f16"},
                                           DecoderCase{"llama-tiny", "q8_0"}, DecoderCase{"llama-tiny", "q4_0"},
                                           DecoderCase{"qwen3-tiny", "f32"}, DecoderCase{"qwen3-tiny", "f16"},
                                           DecoderCase{"qwen3-tiny", "q8_0"}),
                         [](const auto& info) {
                           std::string n = info.param.model + "_" + info.param.type;
                           for (auto& ch : n) if (ch == '-') ch = '_';
                           return n;
                         });

TEST(MakeModel, HfCheckpointAndGgufHoldTheSameMasterWeights) {
  const std::string dir = test::models_dir() + "/llama-tiny";
  auto cfg = HfConfig::load(dir + "/hf");
  auto ck = SafetensorsCheckpoint::open(dir + "/hf");
  auto g = GgufFile::open(dir + "/decoder-f32.gguf");
  EXPECT_EQ(cfg.vocab_size, int64_t(g->get("tokenizer.ggml.tokens").arr.size()));
  EXPECT_EQ(g->get_int("llama.block_count"), cfg.num_layers);
  // V is stored unpermuted; K rows are permuted (llama converter): gguf row h*hd+2i+a = hf row h*hd+a*hd/2+i.
  auto hv = ck->to_f32("model.layers.1.self_attn.v_proj.weight");
  auto gv = g->to_f32(g->tensor("blk.1.attn_v.weight"));
  EXPECT_EQ(hv, gv);
  auto hk = ck->to_f32("model.layers.0.self_attn.k_proj.weight");
  auto gk = g->to_f32(g->tensor("blk.0.attn_k.weight"));
  const int64_t hd = cfg.head_dim, H = cfg.hidden_size;
  EXPECT_NE(hk, gk);
  for (int64_t h = 0; h < cfg.num_kv_heads; ++h)
    for (int64_t i = 0; i < hd / 2; ++i)
      for (int a = 0; a < 2; ++a)
        for (int64_t col = 0; col < H; col += 17)
          ASSERT_EQ(gk[(h * hd + 2 * i + a) * H + col], hk[(h * hd + a * hd / 2 + i) * H + col]);
  // norms carry non-trivial weights
  auto n = ck->to_f32("model.layers.0.input_layernorm.weight");
  EXPECT_NE(n[0], 1.0f);
}

TEST(MakeModel, Fp8CheckpointDequantizesCloseToMaster) {
  const std::string dir = test::temp_dir("fp8");
  MakeModelOptions o;
  o.arch = "qwen3"; o.preset = "tiny"; o.seed = 5; o.out = dir; o.hf_dtype = "fp8"; o.gguf_types = {};
  o.vocab_dir = test::llama_src() + "/models";
  make_model(o);
  auto cfg = HfConfig::load(dir + "/hf");
  ASSERT_TRUE(cfg.fp8);
  auto ck = SafetensorsCheckpoint::open(dir + "/hf");
  const auto& w = ck->get("model.layers.0.self_attn.q_proj.weight");
  ASSERT_EQ(w.dtype, StDtype::F8_E4M3);
  auto s = ck->to_f32("model.layers.0.self_attn.q_proj.weight_scale_inv");
  std::vector<float> deq(size_t(w.n_elements()));
  dequantize_block_fp8(w.data, w.shape[0], w.shape[1], s.data(), 128, 128, deq.data());
  double err = 0, ref = 0;
  const double std = 1.0 / std::sqrt(double(w.shape[1]));
  for (int64_t i = 0; i < w.n_elements(); ++i) {
    const double m = std * master_weight(5, "model.layers.0.self_attn.q_proj.weight", i, cfg.num_layers);
    err += (deq[i] - m) * (deq[i] - m);
    ref += m * m;
  }
  EXPECT_LT(std::sqrt(err / ref), 0.05);  // e4m3 has 3 mantissa bits: ~2-4% relative error
  EXPECT_EQ(ck->get("model.embed_tokens.weight").dtype, StDtype::BF16);
}

TEST(MakeModel, ContextLengthOverrideReachesConfigAndGguf) {
  const std::string dir = test::temp_dir("ctxlen");
  MakeModelOptions o;
  o.arch = "llama"; o.preset = "tiny"; o.seed = 3; o.out = dir; o.hf_dtype = "bf16"; o.gguf_types = {"f16"};
  o.vocab_dir = test::llama_src() + "/models";
  o.context_length = 1100000;
  make_model(o);
  EXPECT_EQ(HfConfig::load(dir + "/hf").max_position_embeddings, 1100000);
  EXPECT_EQ(GgufFile::open(dir + "/decoder-f16.gguf")->get_int("llama.context_length"), 1100000);
  o.context_length = -1;
  EXPECT_THROW(make_model(o), std::invalid_argument);
}

}  // namespace pdb
