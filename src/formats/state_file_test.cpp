// The state-file owner on layouts with and without V sections: what the writer lays out, the parser
// reads back byte for byte, and the assembler refuses rows for sections the decoder's state lacks.
#include "formats/state_file.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <thread>

#include "cache/assembler.h"
#include "support/test_env.h"
#include "wire/protocol.h"

namespace pdb {
namespace {

std::string scratch(const std::string& name) {
  static const std::string dir = test::temp_dir("state");
  return dir + "/" + name;
}

// deepseek2 with MLA: one 576-wide K row per token per layer, no V tensors.
StateLayout mla_layout(uint32_t n_layer, uint32_t n_stream) {
  StateLayout lay;
  lay.n_stream = n_stream;
  for (uint32_t l = 0; l < n_layer; ++l) {
    StateLayerTypes t;
    t.k_type = GgmlType::F16;
    t.n_embd_k = 576;
    t.k_row_bytes = 576 * 2;
    lay.layers.push_back(t);
  }
  return lay;
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = uint8_t(i * 131 + seed);
  return b;
}

}  // namespace

TEST(StateFile, LayoutWithoutVSectionsRoundTrips) {
  for (uint32_t n_stream : {1u, 3u}) {
    const StateLayout lay = mla_layout(3, n_stream);
    EXPECT_FALSE(lay.has_v());
    ASSERT_EQ(lay.sections().size(), 3u);  // K sections only
    const uint32_t cells = 37;
    std::vector<int32_t> tokens(cells);
    std::iota(tokens.begin(), tokens.end(), 100);
    const std::string path = scratch("mla.bin");
    {
      StateFileWriter w(path, lay, tokens, cells);
      for (uint32_t l = 0; l < 3; ++l) {
        const auto rows = pattern(lay.layers[l].k_row_bytes * cells, uint8_t(l));
        w.write_k_rows(l, 0, cells, rows.data());
      }
      std::vector<uint8_t> v(1152);
      EXPECT_THROW(w.write_v_rows(0, 0, 1, v.data()), std::out_of_range);
      // llama.cpp's arithmetic (fact sheet §3): header, tokens, stream counts, 12 B of metadata per
      // cell, v_trans + n_layer, then per layer a 12-byte K header and the rows; nothing for V.
      EXPECT_EQ(w.geometry().total_bytes(), 12 + 4 * cells + 4 + 4 * n_stream + 12 * cells + 8 + 3 * (12 + 1152 * cells));
      w.commit();
    }
    const ParsedState s = parse_state_file(path);
    EXPECT_EQ(s.cell_count, cells);
    EXPECT_EQ(s.tokens, tokens);
    ASSERT_EQ(s.layout.n_layer(), 3u);
    EXPECT_FALSE(s.layout.has_v()) << s.layout.describe();
    EXPECT_TRUE(s.v_data.empty());
    for (uint32_t l = 0; l < 3; ++l) {
      EXPECT_EQ(s.layout.layers[l].n_embd_k, 576u);
      const auto rows = pattern(1152 * cells, uint8_t(l));
      EXPECT_EQ(0, std::memcmp(s.k_data[l], rows.data(), rows.size())) << "layer " << l;
    }
  }
}

TEST(StateFile, LayoutWithVSectionsStillHasThem) {
  StateLayout lay;
  for (int l = 0; l < 2; ++l) {
    StateLayerTypes t;
    t.n_embd_k = t.n_embd_v = 128;
    t.k_row_bytes = t.v_row_bytes = 256;
    lay.layers.push_back(t);
  }
  ASSERT_EQ(lay.sections().size(), 4u);
  EXPECT_EQ(lay.sections()[2].kind, SectionKind::V);
  std::vector<int32_t> tokens(5, 7);
  const std::string path = scratch("kv.bin");
  {
    StateFileWriter w(path, lay, tokens, 5);
    const auto rows = pattern(256 * 5, 9);
    for (uint32_t l = 0; l < 2; ++l) { w.write_k_rows(l, 0, 5, rows.data()); w.write_v_rows(l, 0, 5, rows.data()); }
    w.commit();
  }
  const ParsedState s = parse_state_file(path);
  EXPECT_TRUE(s.layout.has_v());
  ASSERT_EQ(s.v_data.size(), 2u);
  EXPECT_EQ(s.layout.layers[1].v_row_bytes, 256u);
}

// Rows written through the file's mapping (several threads at once, as a tail's prefix copy beside the frames)
// give the same bytes as pwrite, transposed V included; reads back through either.
TEST(StateFile, MappedWritesFromSeveralThreadsEqualPwrittenOnes) {
  for (bool v_trans : {false, true}) {
    StateLayout lay;
    lay.v_trans = v_trans;
    for (int l = 0; l < 4; ++l) {
      StateLayerTypes t;
      t.n_embd_k = t.n_embd_v = 128;
      t.k_row_bytes = t.v_row_bytes = 256;
      lay.layers.push_back(t);
    }
    const uint32_t cells = 300;
    std::vector<int32_t> tokens(cells);
    std::iota(tokens.begin(), tokens.end(), 3);
    auto write = [&](const std::string& name, StateFileWriter::WriteMode mode, bool threads) {
      const std::string path = scratch(name);
      StateFileWriter w(path, lay, tokens, cells, mode);
      EXPECT_EQ(w.mapped(), mode == StateFileWriter::WriteMode::Auto) << "the scratch filesystem has room: rows go through the mapping";
      auto layer = [&](uint32_t l) {
        const auto k = pattern(256 * cells, uint8_t(l)), v = pattern(256 * cells, uint8_t(l + 50));
        for (uint32_t c = 0; c < cells; c += 64) {
          const uint32_t n = std::min(64u, cells - c);
          w.write_k_rows(l, c, n, k.data() + size_t(c) * 256);
          w.write_v_rows(l, c, n, v.data() + size_t(c) * 256);
        }
        std::vector<uint8_t> back(256 * 10);
        w.read_v_rows(l, 7, 10, back.data());
        EXPECT_EQ(0, std::memcmp(back.data(), v.data() + 7 * 256, back.size()));
      };
      std::vector<std::thread> ts;
      for (uint32_t l = 0; l < 4; ++l) {
        if (threads) ts.emplace_back(layer, l);
        else layer(l);
      }
      for (auto& t : ts) t.join();
      EXPECT_THROW(w.write_k_rows(0, cells - 1, 2, pattern(512, 1).data()), std::out_of_range);
      w.commit();
      std::ifstream f(path, std::ios::binary);
      return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
    };
    const auto a = write("pwrite.bin", StateFileWriter::WriteMode::Pwrite, false), b = write("mapped.bin", StateFileWriter::WriteMode::Auto, true);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_TRUE(a == b) << "v_trans " << v_trans;
    EXPECT_EQ(parse_state_file(scratch("mapped.bin")).cell_count, cells);
  }
}

TEST(StateFile, AssemblerRefusesVRowsForALayoutWithoutThem) {
  const StateLayout lay = mla_layout(1, 1);
  std::vector<int32_t> tokens(4, 3);
  CaptureAssembler as(scratch("asm.bin"), lay, tokens, "fp");
  wire::Bytes frames;
  wire::encode_json_frame(wire::FrameKind::Hello, {{"fingerprint", "fp"}, {"n_tokens", 4}, {"k_row_bytes", 1152}, {"v_row_bytes", 0}}, frames);
  as.feed(frames.data(), frames.size());
  const auto rows = pattern(1152 * 4, 1);
  wire::Bytes v;
  wire::FrameHeader h;
  h.kind = wire::FrameKind::V;
  h.type = uint8_t(GgmlType::F16);
  h.n_rows = 4;
  wire::encode_frame(h, rows.data(), rows.size(), v);
  EXPECT_THROW(as.feed(v.data(), v.size()), wire::Error);
}

TEST(StateFile, KOnlyCaptureCommitsWhenEveryKSectionIsCovered) {
  const StateLayout lay = mla_layout(2, 1);
  std::vector<int32_t> tokens(4, 3);
  const std::string path = scratch("asm2.bin");
  CaptureAssembler as(path, lay, tokens, "fp");
  wire::Bytes f;
  wire::encode_json_frame(wire::FrameKind::Hello, {{"fingerprint", "fp"}, {"n_tokens", 4}, {"k_row_bytes", 1152}, {"v_row_bytes", 0}}, f);
  const auto rows = pattern(1152 * 4, 2);
  for (uint32_t l = 0; l < 2; ++l) {
    wire::FrameHeader h;
    h.kind = wire::FrameKind::K;
    h.type = uint8_t(GgmlType::F16);
    h.layer = l;
    h.n_rows = 4;
    wire::encode_frame(h, rows.data(), rows.size(), f);
  }
  wire::encode_json_frame(wire::FrameKind::Trailer, {{"status", "complete"}, {"tokens", 4}}, f);
  as.feed(f.data(), f.size());
  ASSERT_NO_THROW(as.finish());
  const ParsedState s = parse_state_file(path);
  EXPECT_FALSE(s.layout.has_v());
  EXPECT_EQ(0, std::memcmp(s.k_data[1], rows.data(), rows.size()));
}

}  // namespace pdb

namespace pdb {

// llama.cpp's state version 2 (releases before August 2026, node-llama-cpp 3.19.1) differs from 3 only in the
// version word and the server's token encoding: a layout learned from a version-2 file writes version 2, which
// parses back with its rows; a version pdbridge does not know is refused by name, never read as another.
TEST(StateFile, WritesTheVersionItLearnedAndRefusesUnknownOnesByName) {
  for (uint32_t version : {2u, 3u}) {
    StateLayout lay = mla_layout(2, 1);
    lay.file_version = version;
    std::vector<int32_t> tokens(9);
    std::iota(tokens.begin(), tokens.end(), 500);
    const std::string path = scratch("v" + std::to_string(version) + ".bin");
    {
      StateFileWriter w(path, lay, tokens, 9);
      const auto rows = pattern(9 * 576 * 2, uint8_t(version));
      for (uint32_t l = 0; l < 2; ++l) w.write_k_rows(l, 0, 9, rows.data());
      w.commit();
    }
    const ParsedState s = parse_state_file(path);
    EXPECT_EQ(s.layout.file_version, version);
    EXPECT_EQ(s.tokens, tokens);
    EXPECT_FALSE(s.packed_tokens);
    EXPECT_EQ(std::memcmp(s.k_data[1], pattern(9 * 576 * 2, uint8_t(version)).data(), 9 * 576 * 2), 0);
  }
  for (uint32_t version : {1u, 4u}) {
    std::vector<uint8_t> b;
    std::ifstream f(scratch("v3.bin"), std::ios::binary);
    b.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    std::memcpy(b.data() + 4, &version, 4);
    try {
      parse_state_bytes(b, "x.bin");
      FAIL() << "version " << version << " was read";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("state version " + std::to_string(version)), std::string::npos) << m;
      EXPECT_NE(m.find("versions 2"), std::string::npos) << m;
      EXPECT_NE(m.find(version > 3 ? "newer" : "older"), std::string::npos) << m;
    }
  }
  try {
    decode_state_tokens({-1, 2, 1, 7, 0}, nullptr);
    FAIL() << "a packed token list of version 2 was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("token encoding"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("version 2"), std::string::npos) << e.what();
  }
  bool packed = false;
  EXPECT_EQ(decode_state_tokens({-1, 1, 2, 7, 8, 0}, &packed), (std::vector<int32_t>{7, 8}));
  EXPECT_TRUE(packed);
}

}  // namespace pdb
