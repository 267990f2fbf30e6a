#include "formats/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "formats/numeric.h"
#include "support/test_env.h"

namespace pdb {
namespace fs = std::filesystem;

namespace {
std::vector<uint8_t> f32_bytes(std::vector<float> v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}
}  // namespace

TEST(Safetensors, RoundTripSingleFile) {
  const std::string dir = test::temp_dir("st");
  SafetensorsWriter w;
  w.add_bytes("x", StDtype::F32, {2, 3}, f32_bytes({1, 2, 3, 4, 5, 6}));
  std::vector<uint8_t> bf(4);
  uint16_t a = f32_to_bf16(1.5f), b = f32_to_bf16(-2.0f);
  std::memcpy(bf.data(), &a, 2);
  std::memcpy(bf.data() + 2, &b, 2);
  w.add_bytes("y", StDtype::BF16, {2}, bf);
  w.add_bytes("z", StDtype::F8_E4M3, {2}, {0x38, 0xb8});
  w.write(dir);
  auto ck = SafetensorsCheckpoint::open(dir);
  EXPECT_EQ(ck->get("x").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ck->to_f32("x")[5], 6.0f);
  EXPECT_EQ(ck->to_f32("y"), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(ck->to_f32("z"), (std::vector<float>{1.0f, -1.0f}));
  EXPECT_EQ(ck->find("nope"), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(ck->get("x").data) % 8, 0u);
}

TEST(Safetensors, ShardedCheckpointWithIndex) {
  const std::string dir = test::temp_dir("st-shard");
  SafetensorsWriter w;
  for (int i = 0; i < 5; ++i) w.add_bytes("t" + std::to_string(i), StDtype::F32, {4}, f32_bytes({float(i), 0, 0, 1}));
  w.write(dir, 40, 2);  // 16 bytes per tensor, 40 per shard -> 3 shards
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dir + "/model-00003-of-00003.safetensors"));
  auto ck = SafetensorsCheckpoint::open(dir);
  EXPECT_EQ(ck->names().size(), 5u);
  EXPECT_EQ(ck->to_f32("t4")[0], 4.0f);
}

TEST(Safetensors, RejectsMalformedHeaders) {
  const std::string dir = test::temp_dir("st-bad");
  auto write_raw = [&](const std::string& header, size_t data_bytes) {
    std::ofstream o(dir + "/model.safetensors", std::ios::binary);
    uint64_t n = header.size();
    o.write(reinterpret_cast<const char*>(&n), 8);
    o << header << std::string(data_bytes, '\0');
  };
  auto expect_error = [&](const std::string& needle) {
    try { SafetensorsCheckpoint::open(dir); ADD_FAILURE() << "accepted: " << needle; }
    catch (const std::runtime_error& e) { EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what(); }
  };
  write_raw("{not json", 0); expect_error("not JSON");
  write_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8); expect_error("outside the data");
  write_raw(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8); expect_error("bytes for");
  write_raw(R"({"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,8]}})", 8); expect_error("unsupported dtype");
  write_raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  expect_error("overlap");
}

}  // namespace pdb
