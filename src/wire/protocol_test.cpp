#include "wire/protocol.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <xxhash.h>  // the library's plain (portable) XXH3: what any other build of the wire computes

namespace pdb::wire {
namespace {

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = uint8_t(rng());
  return b;
}

FrameHeader header(FrameKind kind, uint32_t layer, uint32_t pos0, uint32_t rows) {
  FrameHeader h;
  h.kind = kind;
  h.type = uint8_t(GgmlType::F16);
  h.layer = layer;
  h.pos0 = pos0;
  h.n_rows = rows;
  return h;
}

// A K/V block's frames one after the other.
void frame_serially(const FrameHeader& kh, const std::vector<uint8_t>& k, const FrameHeader& vh, const std::vector<uint8_t>& v, Bytes& out) {
  encode_frame(kh, k.data(), k.size(), out);
  encode_frame(vh, v.data(), v.size(), out);
}

// The benchmark's peer, the capture's framing before encode_frames (session 32's code): into a std::vector, V
// hashed on a helper thread while K is hashed and copied, then V copied (the headers' bytes stand in).
std::vector<uint8_t> frame_as_before(const std::vector<uint8_t>& k, const std::vector<uint8_t>& v) {
  std::vector<uint8_t> out;
  out.reserve(k.size() + v.size() + 2 * kHeaderBytes);
  uint8_t header[kHeaderBytes] = {};
  uint64_t v_hash = 0;
  std::thread hasher([&] { v_hash = payload_hash(v.data(), v.size()); });
  const uint64_t k_hash = payload_hash(k.data(), k.size());
  std::memcpy(header + 32, &k_hash, 8);
  out.insert(out.end(), header, header + kHeaderBytes);
  out.insert(out.end(), k.begin(), k.end());
  hasher.join();
  std::memcpy(header + 32, &v_hash, 8);
  out.insert(out.end(), header, header + kHeaderBytes);
  out.insert(out.end(), v.begin(), v.end());
  return out;
}

}  // namespace

// Every payload size the framer treats apart (empty, within one hash piece, across pieces, on a thread of its own),
// after bytes already in the buffer: the same bytes as encode_frame's, and the parser gives each payload back.
TEST(WireFrames, EncodeFramesGivesTheOneByOneEncodersBytes) {
  const std::vector<size_t> sizes = {0, 17, size_t(256) << 10, (size_t(256) << 10) + 1, (size_t(1) << 20) - 1, size_t(1) << 20,
                                     (size_t(3) << 20) + 13, size_t(5) << 20};
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<FramePayload> parts;
  Bytes want;
  encode_json_frame(FrameKind::Hello, {{"n_tokens", 4}}, want);
  Bytes got = want;
  for (size_t i = 0; i < sizes.size(); ++i) {
    payloads.push_back(random_bytes(sizes[i], uint32_t(i + 1)));
    const FrameHeader h = header(i % 2 ? FrameKind::V : FrameKind::K, uint32_t(i), uint32_t(100 * i), uint32_t(i + 3));
    parts.push_back({h, payloads.back().data(), payloads.back().size()});
    encode_frame(h, payloads.back().data(), payloads.back().size(), want);
  }
  encode_frames(parts, got);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin()));

  size_t seen = 0;
  FrameParser parser([&](const FrameHeader& h, const uint8_t* payload) {
    if (h.kind == FrameKind::Hello) return;
    ASSERT_LT(seen, sizes.size());
    EXPECT_EQ(h.layer, seen);
    EXPECT_EQ(h.payload_bytes, sizes[seen]);
    EXPECT_TRUE(std::equal(payload, payload + h.payload_bytes, payloads[seen].begin()));
    ++seen;
  });
  parser.feed(got.data(), got.size());
  EXPECT_EQ(seen, sizes.size());
  EXPECT_TRUE(parser.idle());
}

// A K/V block's two frames, as the capture frames them, against the frames one by one; a flipped payload byte is caught.
TEST(WireFrames, KvBlockFramesMatchTheSerialFramingAndCarryTheirChecksums) {
  const auto k = random_bytes((size_t(2) << 20) + 40, 7), v = random_bytes((size_t(2) << 20) + 40, 8);
  const FrameHeader kh = header(FrameKind::K, 3, 4096, 1000), vh = header(FrameKind::V, 3, 4096, 1000);
  Bytes serial, framed;
  frame_serially(kh, k, vh, v, serial);
  encode_frames({{kh, k.data(), k.size()}, {vh, v.data(), v.size()}}, framed);
  ASSERT_EQ(framed.size(), serial.size());
  EXPECT_TRUE(std::equal(framed.begin(), framed.end(), serial.begin()));
  framed[kHeaderBytes + k.size() + kHeaderBytes + 12345] ^= 1;
  FrameParser parser([](const FrameHeader&, const uint8_t*) {});
  EXPECT_THROW(parser.feed(framed.data(), framed.size()), Error);
}

// The payloads' checksums are XXH3-64 whichever of libxxhash's entry points this build hashes with (the x86
// dispatching ones, common/xxhash_fast.h, where the library has them): the plain function's values at XXH3's size
// classes, the published value of the empty input, and a frame's hash made in pieces while its payload is copied.
TEST(WireFrames, PayloadHashIsXxh3WhicheverEntryPointHashes) {
  EXPECT_EQ(payload_hash(nullptr, 0), 0x2D06800538D394C2ull);
  const auto b = random_bytes((size_t(1) << 20) + 13, 21);
  for (size_t n : {size_t(1), size_t(3), size_t(4), size_t(8), size_t(9), size_t(16), size_t(17), size_t(128), size_t(129), size_t(240),
                   size_t(241), size_t(1024), size_t(1025), size_t(65543), b.size()})
    EXPECT_EQ(payload_hash(b.data(), n), XXH3_64bits(b.data(), n)) << n << " bytes";
  const auto k = random_bytes((size_t(2) << 20) + 40, 22);  // past the copy's 256 KB pieces
  Bytes framed;
  encode_frames({{header(FrameKind::K, 0, 0, 9), k.data(), k.size()}}, framed);
  uint64_t got = 0;
  FrameParser parser([&](const FrameHeader& h, const uint8_t*) { got = h.payload_hash; });
  parser.feed(framed.data(), framed.size());
  EXPECT_EQ(got, XXH3_64bits(k.data(), k.size()));
}

// Frames whose payloads a backend already put behind header room: the same bytes as encode_frames makes, no payload
// byte moved; a frame past the buffer's end is refused.
TEST(WireFrames, FramesInPlaceAreTheEncodersBytes) {
  const auto k = random_bytes((size_t(3) << 20) + 6, 11), v = random_bytes(1000, 12);
  const FrameHeader kh = header(FrameKind::K, 1, 0, 7), vh = header(FrameKind::V, 1, 0, 7);
  Bytes want;
  encode_frames({{kh, k.data(), k.size()}, {vh, v.data(), v.size()}}, want);
  Bytes laid;
  laid.resize(2 * kHeaderBytes + k.size() + v.size());
  std::memcpy(laid.data() + kHeaderBytes, k.data(), k.size());
  std::memcpy(laid.data() + 2 * kHeaderBytes + k.size(), v.data(), v.size());
  const uint8_t* payload_before = laid.data() + kHeaderBytes;
  frame_in_place({{kh, 0, k.size()}, {vh, kHeaderBytes + k.size(), v.size()}}, laid);
  EXPECT_EQ(laid.data() + kHeaderBytes, payload_before);
  ASSERT_EQ(laid.size(), want.size());
  EXPECT_TRUE(std::equal(laid.begin(), laid.end(), want.begin()));
  EXPECT_THROW(frame_in_place({{vh, kHeaderBytes + k.size() + 1, v.size()}}, laid), std::out_of_range);
}

// Adopted bytes go back to their owner exactly once: when dropped, or when growing moved them into memory of their own.
TEST(WireBytes, AdoptedBytesGoBackToTheirOwnerOnce) {
  std::vector<uint8_t*> back;
  auto give_back = [&](uint8_t* p) { back.push_back(p); };
  uint8_t owned[64];
  for (int i = 0; i < 64; ++i) owned[i] = uint8_t(i);
  {
    Bytes a = Bytes::adopt(owned, 16, 64, give_back);
    Bytes copy = a;  // a copy is memory of its own
    EXPECT_NE(copy.data(), owned);
    Bytes moved = std::move(a);
    EXPECT_EQ(moved.data(), owned);
    moved.resize(60);  // within its room: still the owner's
    EXPECT_EQ(moved.data(), owned);
    EXPECT_TRUE(back.empty());
  }
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0], owned);
  back.clear();
  Bytes grown = Bytes::adopt(owned, 16, 64, give_back);
  grown.append(owned, 64);  // past its room: moved out, given back at once
  ASSERT_EQ(back.size(), 1u);
  EXPECT_NE(grown.data(), owned);
  EXPECT_EQ(grown.size(), 80u);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(grown[size_t(i)], uint8_t(i));
  for (int i = 0; i < 64; ++i) EXPECT_EQ(grown[size_t(16 + i)], uint8_t(i));
}

// A benchmark, run on request (PDBRIDGE_BENCH=1; figures in docs/RESULTS.md): a K/V block's frames as a capture
// makes them after the engine's last layer (f16 rows, 4,096-token chunks; Qwen3-30B-A3B's 512-wide rows and
// Llama-8B's 1,024). Session 32's framing against encode_frames (into a fresh buffer) and frame_in_place (the
// backend's buffer handed over), each the median of 31.
TEST(WireBench, KvBlockFrames) {
  const char* on = std::getenv("PDBRIDGE_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "a benchmark: PDBRIDGE_BENCH=1 runs it";
  for (const size_t width : {size_t(512), size_t(1024)}) {
    const size_t n = 4096 * width * 2;
    const auto k = random_bytes(n, 1), v = random_bytes(n, 2);
    const FrameHeader kh = header(FrameKind::K, 0, 0, 4096), vh = header(FrameKind::V, 0, 0, 4096);
    size_t sink = 0;  // each run's frames dropped as the capture's emit hands them on (the bytes read, not optimized away)
    auto median_ms = [&](auto&& frame) {
      std::vector<double> ms;
      for (int r = 0; r < 31; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        sink += frame();
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      }
      std::nth_element(ms.begin(), ms.begin() + 15, ms.end());
      return ms[15];
    };
    const double before = median_ms([&] { return frame_as_before(k, v).size(); });
    const double framed = median_ms([&] {
      Bytes out;
      encode_frames({{kh, k.data(), k.size()}, {vh, v.data(), v.size()}}, out);
      return out.size();
    });
    Bytes laid;  // a backend's buffer laid out as the frames (the CUDA backend's pinned slots): hashed where it lies
    laid.resize(2 * kHeaderBytes + 2 * n);
    std::memcpy(laid.data() + kHeaderBytes, k.data(), n);
    std::memcpy(laid.data() + 2 * kHeaderBytes + n, v.data(), n);
    const double in_place = median_ms([&] {
      frame_in_place({{kh, 0, n}, {vh, kHeaderBytes + n, n}}, laid);
      return laid.size();
    });
    const double one_by_one = median_ms([&] {
      Bytes out;
      frame_serially(kh, k, vh, v, out);
      return out.size();
    });
    fmt::print("KvBlockFrames width {} ({} MB per block, {} hardware threads): before {:.3f} ms ({:.1f} GB/s), encode_frames {:.3f} ms "
               "({:.1f} GB/s, {:.2f}x), frame_in_place {:.3f} ms ({:.2f}x), encode_frame one by one {:.3f} ms\n",
               width, 2 * n >> 20, std::thread::hardware_concurrency(), before, 2e-6 * double(n) / before, framed,
               2e-6 * double(n) / framed, before / framed, in_place, before / in_place, one_by_one);
    EXPECT_EQ(sink, 124 * (2 * n + 2 * kHeaderBytes));
  }
}

}  // namespace pdb::wire
