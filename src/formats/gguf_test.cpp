#include "formats/gguf.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "support/test_env.h"

namespace pdb {
namespace fs = std::filesystem;

namespace {
std::vector<uint8_t> slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void spit(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

GgufWriter sample_writer() {
  GgufWriter w;
  GgufValue v;
  w.set("general.architecture", GgufValue::of_str("llama"));
  v = {}; v.type = GgufType::U8; v.u = 200; w.set("t.u8", v);
  v = {}; v.type = GgufType::I8; v.i = -100; w.set("t.i8", v);
  v = {}; v.type = GgufType::U16; v.u = 60000; w.set("t.u16", v);
  v = {}; v.type = GgufType::I16; v.i = -30000; w.set("t.i16", v);
  w.set("t.u32", GgufValue::of_u32(4000000000u));
  w.set("t.i32", GgufValue::of_i32(-2000000000));
  w.set("t.f32", GgufValue::of_f32(1.5f));
  w.set("t.bool", GgufValue::of_bool(true));
  w.set("t.u64", GgufValue::of_u64(1ull << 40));
  v = {}; v.type = GgufType::I64; v.i = -(1ll << 40); w.set("t.i64", v);
  v = {}; v.type = GgufType::F64; v.f = 3.25; w.set("t.f64", v);
  w.set("t.str_array", GgufValue::of_array(GgufType::STRING, {GgufValue::of_str("a"), GgufValue::of_str(""), GgufValue::of_str("ünï")}));
  w.set("t.nested", GgufValue::of_array(GgufType::ARRAY, {GgufValue::of_array(GgufType::I32, {GgufValue::of_i32(1), GgufValue::of_i32(-2)})}));
  std::vector<uint8_t> f32(4 * 6);
  for (int i = 0; i < 6; ++i) { float x = float(i) - 2.5f; std::memcpy(f32.data() + 4 * i, &x, 4); }
  w.add_tensor_bytes("a.weight", GgmlType::F32, {3, 2}, f32);
  w.add_tensor_bytes("q.weight", GgmlType::Q8_0, {32, 1}, std::vector<uint8_t>(34, 7));
  w.add_tensor_bytes("h.weight", GgmlType::F16, {5}, std::vector<uint8_t>(10, 1));
  return w;
}
}  // namespace

TEST(Gguf, RoundTripsEveryMetadataTypeAndTensors) {
  const std::string dir = test::temp_dir("gguf"), p = dir + "/a.gguf";
  sample_writer().write(p);
  auto g = GgufFile::open(p);
  EXPECT_EQ(g->version(), 3u);
  EXPECT_EQ(g->get_int("t.u8"), 200);
  EXPECT_EQ(g->get_int("t.i8"), -100);
  EXPECT_EQ(g->get_int("t.u16"), 60000);
  EXPECT_EQ(g->get_int("t.i16"), -30000);
  EXPECT_EQ(g->get_int("t.u32"), 4000000000ll);
  EXPECT_EQ(g->get_int("t.i32"), -2000000000);
  EXPECT_EQ(g->get_float("t.f32"), 1.5);
  EXPECT_EQ(g->get("t.bool").u, 1u);
  EXPECT_EQ(g->get_int("t.u64"), 1ll << 40);
  EXPECT_EQ(g->get_int("t.i64"), -(1ll << 40));
  EXPECT_EQ(g->get_float("t.f64"), 3.25);
  EXPECT_EQ(g->get("t.str_array").arr.at(2).s, "ünï");
  EXPECT_EQ(g->get("t.nested").arr.at(0).arr.at(1).i, -2);
  ASSERT_EQ(g->tensors().size(), 3u);
  const auto& a = g->tensor("a.weight");
  EXPECT_EQ(a.ne, (std::vector<int64_t>{3, 2}));
  auto af = g->to_f32(a);
  EXPECT_EQ(af[5], 2.5f);
  EXPECT_EQ(g->tensor("q.weight").offset % 32, 0u);
  EXPECT_EQ(g->data(g->tensor("q.weight"))[33], 7);
  // A rewrite of what was read is byte-identical.
  GgufWriter w2;
  for (const auto& [k, v] : g->kv()) w2.set(k, v);
  for (const auto& t : g->tensors()) w2.add_tensor_bytes(t.name, t.type, t.ne, std::vector<uint8_t>(g->data(t), g->data(t) + t.n_bytes()));
  w2.write(dir + "/b.gguf");
  EXPECT_EQ(slurp(p), slurp(dir + "/b.gguf"));
  EXPECT_FALSE(fs::exists(p + ".tmp"));
}

TEST(Gguf, RejectsMalformedFilesWithAReason) {
  const std::string dir = test::temp_dir("gguf-bad"), p = dir + "/a.gguf";
  sample_writer().write(p);
  const auto good = slurp(p);
  auto expect_error = [&](std::vector<uint8_t> bytes, const std::string& needle) {
    spit(dir + "/bad.gguf", bytes);
    try {
      GgufFile::open(dir + "/bad.gguf");
      ADD_FAILURE() << "accepted a file that should fail with: " << needle;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto b = good; b[0] = 'X'; expect_error(b, "bad magic");
  b = good; b[4] = 9; expect_error(b, "unsupported GGUF version");
  expect_error(std::vector<uint8_t>(good.begin(), good.begin() + 250), "truncated");
  expect_error(std::vector<uint8_t>(good.begin(), good.end() - 30), "runs past the end");
  b = good; std::memset(b.data() + 8, 0xff, 8); expect_error(b, "tensor count");
  // first key's value type is at 24 + 8 + len("general.architecture")
  b = good; b[24 + 8 + 20] = 77; expect_error(b, "unknown value type");
  // corrupt the tensor type of the last tensor info: find "h.weight" in the header
  b = good;
  auto it = std::search(b.begin(), b.end(), std::begin("h.weight"), std::end("h.weight") - 1);
  ASSERT_NE(it, b.end());
  const size_t type_pos = size_t(it - b.begin()) + 8 + 4 + 8;
  b[type_pos] = 4;  // removed type id
  expect_error(b, "unknown ggml type");
  b = good; b[type_pos] = 8;  // Q8_0 with ne[0]=5
  expect_error(b, "not a multiple");
  b = good; b[type_pos + 4] = 3;  // misaligned offset
  expect_error(b, "not aligned");
  expect_error({}, "too small");
}

TEST(Gguf, ReadsEveryVocabFileInTheLlamaCppTree) {
  const fs::path models = fs::path(test::llama_src()) / "models";
  if (!fs::exists(models)) GTEST_FAIL() << "llama.cpp source not found at " << models << " (run scripts/setup.sh)";
  int n = 0;
  for (const auto& e : fs::directory_iterator(models)) {
    if (e.path().extension() != ".gguf") continue;
    SCOPED_TRACE(e.path().string());
    auto g = GgufFile::open(e.path());
    const GgufValue& toks = g->get("tokenizer.ggml.tokens");
    EXPECT_EQ(toks.type, GgufType::ARRAY);
    EXPECT_GT(toks.arr.size(), 1000u);
    EXPECT_FALSE(g->get_string("tokenizer.ggml.model").empty());
    // Our writer reproduces each v3 file byte for byte from what the reader parsed.
    if (g->version() != 3) { ++n; continue; }
    GgufWriter w;
    for (const auto& [k, v] : g->kv()) w.set(k, v);
    for (const auto& t : g->tensors()) w.add_tensor_bytes(t.name, t.type, t.ne, std::vector<uint8_t>(g->data(t), g->data(t) + t.n_bytes()));
    const std::string out = test::temp_dir("vocab") + "/v.gguf";
    w.write(out, g->alignment());
    EXPECT_EQ(slurp(e.path()), slurp(out));
    ++n;
  }
  EXPECT_GE(n, 10);
}

}  // namespace pdb
