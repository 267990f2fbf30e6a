// The bridge wire protocol (docs/WIRE.md): POST /v1/bridge/prefill with a JSON request; the response
// body is a stream of self-describing, checksummed binary frames: one HELLO, K/V row frames as the
// engine produces them, and one TRAILER that says complete / partial / error.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/ggml_types.h"

namespace pdb::wire {

constexpr uint32_t kWireVersion = 1;
constexpr uint32_t kFrameMagic = 0x46424450;  // "PDBF"
constexpr size_t kHeaderBytes = 40;
constexpr uint64_t kMaxPayload = 1ull << 31;

// K / V: one row per token (llama.cpp's plain KV cache). Window .. LidScoreRing: the sections of a pooled
// cache (DeepSeek-V4, formats/state_file_dsv4.h), in the order of Dsv4SectionKind; `pos0` is the first row
// of the section (a position for the window, a block index for the pools, 0 for a ring).
enum class FrameKind : uint8_t {
  Hello = 1, K = 2, V = 3, Trailer = 4,
  Window = 5, Csa = 6, Hca = 7, Lid = 8, CsaKvRing = 9, CsaScoreRing = 10, HcaKvRing = 11, HcaScoreRing = 12, LidKvRing = 13, LidScoreRing = 14,
  // A pooled capture sealed early: JSON {"tokens": P}; after it, every layer's window rows of [P-min(P,W), P) and
  // its rings at P (the sections a prefix needs beyond the pool rows already sent), then TRAILER partial P.
  Seal = 15,
};
constexpr uint8_t kFirstSectionKind = 5, kLastSectionKind = 14;
inline bool is_section_kind(FrameKind k) { return uint8_t(k) >= kFirstSectionKind && uint8_t(k) <= kLastSectionKind; }
const char* kind_name(FrameKind k);

struct FrameHeader {
  FrameKind kind = FrameKind::K;
  uint8_t type = 0;  // ggml type id of K/V rows
  uint32_t layer = 0, pos0 = 0, n_rows = 0;
  uint64_t payload_bytes = 0;
  uint64_t payload_hash = 0;  // XXH3-64 of the payload
};

// Encoded frames, one or more back to back: what a capture emits and the prefill server's queue holds. Unlike a
// std::vector<uint8_t>, growing it leaves the new bytes unwritten and moves the old ones with one memcpy: a
// frame's megabytes of payload are written once, by the encoder's copy.
class Bytes {
 public:
  Bytes() = default;
  Bytes(const Bytes& o) { append(o.data(), o.size()); }
  Bytes(Bytes&& o) noexcept { swap(o); }
  Bytes& operator=(Bytes o) noexcept {
    swap(o);
    return *this;
  }
  ~Bytes() { release(); }
  // `n` bytes at `p` (room for `cap`) that someone else owns, such as a backend's pinned buffer it laid out as
  // frames: `give_back` gets `p` when these bytes are done with; growing past `cap` first moves them into memory
  // of their own.
  static Bytes adopt(uint8_t* p, size_t n, size_t cap, std::function<void(uint8_t*)> give_back);
  uint8_t* data() { return p_; }
  const uint8_t* data() const { return p_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  uint8_t* begin() { return p_; }
  uint8_t* end() { return p_ + n_; }
  const uint8_t* begin() const { return p_; }
  const uint8_t* end() const { return p_ + n_; }
  uint8_t& operator[](size_t i) { return p_[i]; }
  uint8_t operator[](size_t i) const { return p_[i]; }
  uint8_t& back() { return p_[n_ - 1]; }
  void clear() { n_ = 0; }
  void reserve(size_t n);
  void resize(size_t n) {  // the bytes past the old size are left unwritten
    if (n > cap_) reserve(std::max(n, 2 * cap_));
    n_ = n;
  }
  void append(const uint8_t* p, size_t n);

 private:
  void swap(Bytes& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(cap_, o.cap_);
    std::swap(give_back_, o.give_back_);
  }
  void release() noexcept;
  uint8_t* p_ = nullptr;
  size_t n_ = 0, cap_ = 0;
  std::function<void(uint8_t*)> give_back_;  // null: p_ is ours (new[])
};

// Serializes header + payload into out (appends).
void encode_frame(FrameHeader h, const uint8_t* payload, size_t n, Bytes& out);
uint64_t payload_hash(const uint8_t* payload, size_t n);
void encode_json_frame(FrameKind kind, const nlohmann::json& j, Bytes& out);

// Frames of several payloads appended to out, the same bytes as encode_frame's one after the other. Each payload
// is read once: copied in pieces that its hash then reads from the cache. Payloads of a megabyte or more are
// framed on threads of their own (a K/V block's K and V at once): the last block of a capture is framed after
// the engine has finished, on the request's critical path.
struct FramePayload {
  FrameHeader header;
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};
void encode_frames(std::initializer_list<FramePayload> payloads, Bytes& out);
void encode_frames(const std::vector<FramePayload>& payloads, Bytes& out);
// Frames whose payloads already lie in `frames` (a backend copied its rows there, each behind kHeaderBytes of room
// at `at`): each payload hashed where it lies, large ones on threads of their own (or its hash taken as given: a
// backend that hashed its rows as they landed), and its header written. No byte of a payload is copied.
struct FrameInPlace {
  FrameHeader header;
  size_t at = 0;  // the header's offset in the buffer, the payload right after it
  size_t bytes = 0;
  bool hashed = false;  // header.payload_hash is the payload's payload_hash already (taken as it is)
};
void frame_in_place(std::initializer_list<FrameInPlace> frames, Bytes& buffer);

// Incremental parser: feed() any byte slices; complete frames go to the callback. Any corruption
// (magic, version, header or payload checksum, oversized payload) throws wire::Error; the stream
// must then be discarded.
struct Error : std::runtime_error { using std::runtime_error::runtime_error; };

class FrameParser {
 public:
  using OnFrame = std::function<void(const FrameHeader&, const uint8_t* payload)>;
  explicit FrameParser(OnFrame on_frame, uint64_t max_payload = kMaxPayload) : on_frame_(std::move(on_frame)), max_payload_(max_payload) {}
  void feed(const uint8_t* data, size_t n);
  bool idle() const { return buf_.empty(); }  // no partial frame pending
  uint64_t frames() const { return frames_; }
  uint64_t bytes() const { return bytes_; }

 private:
  OnFrame on_frame_;
  uint64_t max_payload_;
  std::vector<uint8_t> buf_;
  uint64_t frames_ = 0, bytes_ = 0;
};

// The request a front door sends.
struct PrefillRequest {
  std::vector<int32_t> tokens;
  std::string fingerprint;  // the recipe fingerprint the front expects
  GgmlType k_type = GgmlType::F16, v_type = GgmlType::F16;
  bool rot_k = false, rot_v = false;
  int simd_width = 8;  // the decoder's matmul summation width (see CacheSpec)
  int64_t chunk = 0;  // 0: server default
  // The decoder already holds the first tail_from tokens' rows (a conversation's earlier turns): the capture
  // sends rows for [tail_from, T) only; the server's prefix cache may spare it computing part of [0, tail_from).
  int64_t tail_from = 0;
  nlohmann::json to_json() const;
  static PrefillRequest parse(const nlohmann::json& j);  // throws std::invalid_argument with the reason
};

}  // namespace pdb::wire
