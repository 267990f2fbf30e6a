// A capture's frames where the backend offers its buffers laid out as them (the CUDA backend's pinned slots): the
// same frames as copied ones, every buffer given back once its frames are gone, and a copy wherever the buffer does
// not lie as the frames would (rows the decoder holds cut off, a layout that does not match, no buffer to spare).
#include "prefill/capture.h"

#include <map>

#include <gtest/gtest.h>

#include "formats/ggml_types.h"

namespace pdb {
namespace {

// Rows of every (layer, position) from a formula, in buffers laid out as frames when `offer` says so.
class FramedRowsBackend final : public PrefillBackend {
 public:
  enum class Offer { None, Frames, WrongLayout, NoSpare };
  // hashes: the blocks carry their payloads' hashes (as the CUDA backend's last block does); wrong_hashes: hashes that
  // are not the payloads', to show they are taken as given
  explicit FramedRowsBackend(Offer offer, bool hashes = false, bool wrong_hashes = false)
      : offer_(offer), hashes_(hashes), wrong_hashes_(wrong_hashes) {
    info_.arch = "llama";
    info_.n_layer = 2;
    info_.n_embd = 256;
    info_.n_head_kv = 2;
    info_.head_dim = 64;
  }
  const HfConfig& config() const override { return config_; }
  const RecipeInfo& info() const override { return info_; }
  std::string device() const override { return "test"; }

  static uint8_t byte_of(int layer, int64_t pos, size_t i, bool v) { return uint8_t(layer * 31 + pos * 7 + int64_t(i) * 3 + (v ? 101 : 0)); }
  size_t row_bytes() const { return ggml_row_bytes(GgmlType::F16, info_.n_embd_kv()); }

  int64_t capture(const std::vector<int32_t>& tokens, int64_t chunk, const CacheSpec&, const KvSink& sink, const std::function<bool()>&,
                  CaptureReuse*) override {
    const int64_t T = int64_t(tokens.size());
    const size_t hb = wire::kHeaderBytes;
    for (int64_t p0 = 0; p0 < T; p0 += chunk) {
      const int64_t rows = std::min(chunk, T - p0);
      for (int layer = 0; layer < info_.n_layer; ++layer) {
        const size_t kb = row_bytes() * size_t(rows);
        auto* buf = new uint8_t[2 * hb + 2 * kb];
        ++outstanding_;
        for (size_t i = 0; i < kb; ++i) {
          const int64_t pos = p0 + int64_t(i / row_bytes());
          buf[hb + i] = byte_of(layer, pos, i % row_bytes(), false);
          buf[2 * hb + kb + i] = byte_of(layer, pos, i % row_bytes(), true);
        }
        KvBlock b{layer, p0, rows, buf + hb, kb, buf + 2 * hb + kb, kb};
        if (hashes_) {
          b.hashed = true;
          b.k_hash = wire::payload_hash(b.k, kb) + (wrong_hashes_ ? 1 : 0);
          b.v_hash = wire::payload_hash(b.v, kb);
        }
        bool taken = false;
        auto give_back = [this](uint8_t* p) {
          delete[] p;
          --outstanding_;
          ++given_back_;
        };
        if (offer_ != Offer::None)
          b.take_frames = [&] {
            taken = true;
            if (offer_ == Offer::NoSpare) return wire::Bytes();
            const size_t n = offer_ == Offer::WrongLayout ? 2 * hb + 2 * kb - 1 : 2 * hb + 2 * kb;
            return wire::Bytes::adopt(buf, n, 2 * hb + 2 * kb, give_back);
          };
        const bool more = sink(b);
        if (!taken || offer_ == Offer::NoSpare) give_back(buf);  // not handed over: still the backend's
        if (taken && offer_ != Offer::NoSpare) ++handed_over_;
        if (!more) return p0;
      }
    }
    return T;
  }
  int64_t forward_only(const std::vector<int32_t>& tokens, int64_t, bool, bool) override { return int64_t(tokens.size()); }

  int outstanding_ = 0, given_back_ = 0, handed_over_ = 0;

 private:
  Offer offer_;
  bool hashes_ = false, wrong_hashes_ = false;
  RecipeInfo info_;
  HfConfig config_;
};

struct Captured {
  CaptureResult result;
  std::map<std::pair<int, int>, std::vector<uint8_t>> rows;  // (layer, kind K=0/V=1) -> rows from position 0, as received
  int64_t first_pos = -1;
  int outstanding_while_held = 0;  // buffers still out while the frames were held
};

Captured capture(FramedRowsBackend& be, int64_t T, int64_t tail_from) {
  wire::PrefillRequest req;
  req.tokens.assign(size_t(T), 1);
  req.fingerprint = recipe_fingerprint(be.info());
  req.tail_from = tail_from;
  std::vector<wire::Bytes> held;  // frames kept, as the prefill server's queue keeps them until the wire takes them
  Captured c;
  c.result = run_capture(be, req, 64, EmitFn([&](wire::Bytes&& f, bool) {
    held.push_back(std::move(f));
    return Emit::Ok;
  }));
  c.outstanding_while_held = be.outstanding_;
  wire::FrameParser parser([&](const wire::FrameHeader& h, const uint8_t* payload) {
    if (h.kind != wire::FrameKind::K && h.kind != wire::FrameKind::V) return;
    if (c.first_pos < 0) c.first_pos = h.pos0;
    auto& rows = c.rows[{int(h.layer), h.kind == wire::FrameKind::V}];
    rows.insert(rows.end(), payload, payload + h.payload_bytes);
  });
  for (const auto& f : held) parser.feed(f.data(), f.size());
  held.clear();
  return c;
}

void expect_rows(const FramedRowsBackend& be, const Captured& c, int64_t from, int64_t T) {
  EXPECT_EQ(c.result.status, "complete");
  EXPECT_EQ(c.first_pos, from);
  const size_t rb = be.row_bytes();
  for (int layer = 0; layer < 2; ++layer)
    for (int v = 0; v < 2; ++v) {
      const auto& rows = c.rows.at({layer, v});
      ASSERT_EQ(rows.size(), size_t(T - from) * rb);
      for (size_t i = 0; i < rows.size(); ++i)
        ASSERT_EQ(rows[i], FramedRowsBackend::byte_of(layer, from + int64_t(i / rb), i % rb, v)) << "layer " << layer << " v " << v << " byte " << i;
    }
}

}  // namespace

TEST(CaptureFrames, BuffersHandedOverAsFramesCarryTheRowsAndComeBackWhenTheFramesGo) {
  FramedRowsBackend be(FramedRowsBackend::Offer::Frames);
  const Captured c = capture(be, 200, 0);
  expect_rows(be, c, 0, 200);
  EXPECT_EQ(be.handed_over_, 8);  // 4 chunks x 2 layers, none copied
  EXPECT_EQ(c.outstanding_while_held, 8);  // the frames were the backend's buffers
  EXPECT_EQ(be.outstanding_, 0);
  EXPECT_EQ(be.given_back_, 8);
}

TEST(CaptureFrames, RowsAreCopiedWhereTheBufferDoesNotLieAsTheFrames) {
  for (const auto offer : {FramedRowsBackend::Offer::None, FramedRowsBackend::Offer::WrongLayout, FramedRowsBackend::Offer::NoSpare}) {
    FramedRowsBackend be(offer);
    const Captured c = capture(be, 200, 0);
    expect_rows(be, c, 0, 200);
    EXPECT_EQ(c.outstanding_while_held, 0);  // every buffer back before the frames went: they are copies
    EXPECT_EQ(be.outstanding_, 0);
    EXPECT_EQ(be.given_back_, 8);
  }
}

// A tail capture: the rows the decoder holds are cut from the first block, which then no longer lies as frames.
TEST(CaptureFrames, ATailCapturesCutBlockIsCopiedAndTheRestHandedOver) {
  FramedRowsBackend be(FramedRowsBackend::Offer::Frames);
  const Captured c = capture(be, 200, 100);
  expect_rows(be, c, 100, 200);
  EXPECT_EQ(be.handed_over_, 4);  // chunks at 128 and 192; the one at 64 cut, the one at 0 not sent at all
  EXPECT_EQ(be.outstanding_, 0);
  EXPECT_EQ(be.given_back_, 8);
}

// Blocks whose payloads the backend hashed as they landed: the frames take those hashes (a wrong one reaches the wire,
// so they are not made again), the same frames as hashed here; a cut block's rows are hashed again.
TEST(CaptureFrames, HashesTheBackendMadeAreTheFramesHashes) {
  {
    FramedRowsBackend be(FramedRowsBackend::Offer::Frames, true);
    expect_rows(be, capture(be, 200, 0), 0, 200);
    EXPECT_EQ(be.handed_over_, 8);
  }
  {
    FramedRowsBackend be(FramedRowsBackend::Offer::Frames, true);
    expect_rows(be, capture(be, 200, 100), 100, 200);
  }
  for (const auto offer : {FramedRowsBackend::Offer::None, FramedRowsBackend::Offer::NoSpare}) {  // copied: hashed as copied
    FramedRowsBackend be(offer, true, true);
    expect_rows(be, capture(be, 200, 0), 0, 200);
  }
  FramedRowsBackend wrong(FramedRowsBackend::Offer::Frames, true, true);
  EXPECT_THROW(capture(wrong, 200, 0), wire::Error);
  EXPECT_EQ(wrong.outstanding_, 0);
}

}  // namespace pdb
