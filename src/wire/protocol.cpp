#include "wire/protocol.h"

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>

#include <fmt/format.h>
#include "common/xxhash_fast.h"

namespace pdb::wire {

const char* kind_name(FrameKind k) {
  switch (k) {
    case FrameKind::Hello: return "HELLO";
    case FrameKind::K: return "K";
    case FrameKind::V: return "V";
    case FrameKind::Trailer: return "TRAILER";
    case FrameKind::Window: return "window";
    case FrameKind::Csa: return "csa";
    case FrameKind::Hca: return "hca";
    case FrameKind::Lid: return "lid";
    case FrameKind::CsaKvRing: return "csa-kv-ring";
    case FrameKind::CsaScoreRing: return "csa-score-ring";
    case FrameKind::HcaKvRing: return "hca-kv-ring";
    case FrameKind::HcaScoreRing: return "hca-score-ring";
    case FrameKind::LidKvRing: return "lid-kv-ring";
    case FrameKind::LidScoreRing: return "lid-score-ring";
    case FrameKind::Seal: return "SEAL";
  }
  return "?";
}

// Header layout (little-endian, 40 bytes):
//   0 u32 magic | 4 u16 version | 6 u8 kind | 7 u8 type | 8 u32 layer | 12 u32 pos0 | 16 u32 n_rows
//  20 u32 header_hash (XXH32 of bytes 0..19 and 24..39, seed 0) | 24 u64 payload_bytes | 32 u64 payload_hash
namespace {
uint32_t header_hash(const uint8_t* h) {
  uint8_t tmp[36];
  std::memcpy(tmp, h, 20);
  std::memcpy(tmp + 20, h + 24, 16);
  return XXH32(tmp, sizeof tmp, 0);
}

void write_header(FrameHeader h, uint8_t* b) {
  std::memset(b, 0, kHeaderBytes);
  const uint16_t ver = uint16_t(kWireVersion);
  std::memcpy(b, &kFrameMagic, 4);
  std::memcpy(b + 4, &ver, 2);
  b[6] = uint8_t(h.kind);
  b[7] = h.type;
  std::memcpy(b + 8, &h.layer, 4);
  std::memcpy(b + 12, &h.pos0, 4);
  std::memcpy(b + 16, &h.n_rows, 4);
  std::memcpy(b + 24, &h.payload_bytes, 8);
  std::memcpy(b + 32, &h.payload_hash, 8);
  const uint32_t hh = header_hash(b);
  std::memcpy(b + 20, &hh, 4);
}

// Pieces small enough to be hashed from the core's cache right after their copy (one read of the source).
constexpr size_t kHashPiece = size_t(256) << 10;
constexpr size_t kOwnThreadBytes = size_t(1) << 20;

uint64_t copy_and_hash(uint8_t* dst, const uint8_t* src, size_t n) {
  if (n <= kHashPiece) {
    if (n) std::memcpy(dst, src, n);
    return XXH3_64bits(dst, n);
  }
  XXH3_state_t st;
  XXH3_INITSTATE(&st);
  XXH3_64bits_reset(&st);
  for (size_t at = 0; at < n; at += kHashPiece) {
    const size_t m = std::min(kHashPiece, n - at);
    std::memcpy(dst + at, src + at, m);
    XXH3_64bits_update(&st, dst + at, m);
  }
  return XXH3_64bits_digest(&st);
}

// One frame to finish: its header at `at`, its payload copied from `src` right behind it (null: already there).
struct FrameJob {
  FrameHeader header;
  uint8_t* at;
  const uint8_t* src;
  size_t bytes;
  bool hashed = false;  // in place, header.payload_hash given
};

void finish(FrameJob& j) {
  j.header.payload_bytes = j.bytes;
  uint8_t* payload = j.at + kHeaderBytes;
  if (!j.hashed) j.header.payload_hash = j.src ? copy_and_hash(payload, j.src, j.bytes) : XXH3_64bits(payload, j.bytes);
  write_header(j.header, j.at);
}

void finish_all(std::vector<FrameJob>& jobs) {
  std::vector<std::thread> helpers;
  std::vector<char> on_helper(jobs.size(), 0);
  bool first_large = true;  // stays on this thread
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (jobs[i].bytes < kOwnThreadBytes || jobs[i].hashed) continue;
    if (first_large) { first_large = false; continue; }
    try {
      helpers.emplace_back([&jobs, i] { finish(jobs[i]); });
      on_helper[i] = 1;
    } catch (const std::system_error&) {  // no thread to be had: framed here
    }
  }
  for (size_t i = 0; i < jobs.size(); ++i)
    if (!on_helper[i]) finish(jobs[i]);
  for (auto& t : helpers) t.join();
}

void encode_payloads(const FramePayload* p, size_t count, Bytes& out) {
  std::vector<size_t> at(count);
  size_t end = out.size();
  for (size_t i = 0; i < count; ++i) {
    at[i] = end;
    end += kHeaderBytes + p[i].bytes;
  }
  out.resize(end);
  std::vector<FrameJob> jobs;
  jobs.reserve(count);
  for (size_t i = 0; i < count; ++i) jobs.push_back({p[i].header, out.data() + at[i], p[i].data, p[i].bytes});
  finish_all(jobs);
}
}  // namespace

uint64_t payload_hash(const uint8_t* payload, size_t n) { return XXH3_64bits(payload, n); }

Bytes Bytes::adopt(uint8_t* p, size_t n, size_t cap, std::function<void(uint8_t*)> give_back) {
  Bytes b;
  b.p_ = p;
  b.n_ = n;
  b.cap_ = cap;
  b.give_back_ = std::move(give_back);
  return b;
}

void Bytes::release() noexcept {
  if (!p_) return;
  if (give_back_) give_back_(p_);
  else delete[] p_;
  p_ = nullptr;
}

void Bytes::reserve(size_t n) {
  if (n <= cap_) return;
  std::unique_ptr<uint8_t[]> p(new uint8_t[n]);  // not value-initialized: written by whoever grew it
  if (n_) std::memcpy(p.get(), p_, n_);
  release();
  p_ = p.release();
  give_back_ = nullptr;
  cap_ = n;
}

void Bytes::append(const uint8_t* p, size_t n) {
  const size_t at = n_;
  resize(n_ + n);
  if (n) std::memcpy(p_ + at, p, n);
}

void encode_frames(std::initializer_list<FramePayload> payloads, Bytes& out) { encode_payloads(payloads.begin(), payloads.size(), out); }
void encode_frames(const std::vector<FramePayload>& payloads, Bytes& out) { encode_payloads(payloads.data(), payloads.size(), out); }

void frame_in_place(std::initializer_list<FrameInPlace> frames, Bytes& buffer) {
  std::vector<FrameJob> jobs;
  for (const auto& f : frames) {
    if (f.at + kHeaderBytes + f.bytes > buffer.size())
      throw std::out_of_range(fmt::format("frame_in_place: a frame at {} of {} payload bytes past the buffer's {}", f.at, f.bytes, buffer.size()));
    jobs.push_back({f.header, buffer.data() + f.at, nullptr, f.bytes, f.hashed});
  }
  finish_all(jobs);
}

void encode_frame(FrameHeader h, const uint8_t* payload, size_t n, Bytes& out) {
  h.payload_bytes = n;
  h.payload_hash = XXH3_64bits(payload, n);
  uint8_t b[kHeaderBytes];
  write_header(h, b);
  out.reserve(out.size() + kHeaderBytes + n);
  out.append(b, kHeaderBytes);
  out.append(payload, n);
}

void encode_json_frame(FrameKind kind, const nlohmann::json& j, Bytes& out) {
  const std::string s = j.dump();
  FrameHeader h;
  h.kind = kind;
  encode_frame(h, reinterpret_cast<const uint8_t*>(s.data()), s.size(), out);
}

void FrameParser::feed(const uint8_t* data, size_t n) {
  bytes_ += n;
  buf_.insert(buf_.end(), data, data + n);
  size_t off = 0;
  while (buf_.size() - off >= kHeaderBytes) {
    const uint8_t* b = buf_.data() + off;
    uint32_t magic, stored_hh;
    uint16_t ver;
    std::memcpy(&magic, b, 4);
    std::memcpy(&ver, b + 4, 2);
    std::memcpy(&stored_hh, b + 20, 4);
    if (magic != kFrameMagic) throw Error(fmt::format("frame {}: bad magic 0x{:08x}", frames_, magic));
    if (header_hash(b) != stored_hh) throw Error(fmt::format("frame {}: header checksum mismatch", frames_));
    if (ver != kWireVersion) throw Error(fmt::format("frame {}: wire version {} (expected {})", frames_, ver, kWireVersion));
    FrameHeader h;
    if (b[6] < 1 || b[6] > uint8_t(FrameKind::Seal)) throw Error(fmt::format("frame {}: unknown kind {}", frames_, b[6]));
    h.kind = FrameKind(b[6]);
    h.type = b[7];
    std::memcpy(&h.layer, b + 8, 4);
    std::memcpy(&h.pos0, b + 12, 4);
    std::memcpy(&h.n_rows, b + 16, 4);
    std::memcpy(&h.payload_bytes, b + 24, 8);
    std::memcpy(&h.payload_hash, b + 32, 8);
    if (h.payload_bytes > max_payload_) throw Error(fmt::format("frame {}: payload of {} bytes exceeds the limit", frames_, h.payload_bytes));
    if (buf_.size() - off - kHeaderBytes < h.payload_bytes) break;
    const uint8_t* payload = b + kHeaderBytes;
    if (XXH3_64bits(payload, h.payload_bytes) != h.payload_hash)
      throw Error(fmt::format("frame {} ({} layer {} pos {}): payload checksum mismatch", frames_, kind_name(h.kind), h.layer, h.pos0));
    ++frames_;
    on_frame_(h, payload);
    off += kHeaderBytes + h.payload_bytes;
  }
  if (off) buf_.erase(buf_.begin(), buf_.begin() + long(off));
}

nlohmann::json PrefillRequest::to_json() const {
  return {{"wire_version", kWireVersion}, {"tokens", tokens}, {"fingerprint", fingerprint},
          {"k_type", ggml_type_name(k_type)}, {"v_type", ggml_type_name(v_type)},
          {"rot_k", rot_k}, {"rot_v", rot_v}, {"simd_width", simd_width}, {"chunk", chunk}, {"tail_from", tail_from}};
}

PrefillRequest PrefillRequest::parse(const nlohmann::json& j) {
  auto bad = [](const std::string& m) { throw std::invalid_argument(m); };
  if (!j.is_object()) bad("request body must be a JSON object");
  if (!j.contains("wire_version") || !j["wire_version"].is_number_integer()) bad("'wire_version' is required");
  if (j["wire_version"].get<int64_t>() != kWireVersion) bad(fmt::format("wire_version {} is not supported (server speaks {})", j["wire_version"].dump(), kWireVersion));
  PrefillRequest r;
  if (!j.contains("tokens") || !j["tokens"].is_array() || j["tokens"].empty()) bad("'tokens' must be a non-empty array of token ids");
  r.tokens.reserve(j["tokens"].size());
  for (const auto& t : j["tokens"]) {
    if (!t.is_number_integer()) bad("'tokens' must contain integers");
    const int64_t v = t.get<int64_t>();
    if (v < 0 || v > INT32_MAX) bad(fmt::format("token id {} is out of range", v));
    r.tokens.push_back(int32_t(v));
  }
  if (!j.contains("fingerprint") || !j["fingerprint"].is_string()) bad("'fingerprint' (string) is required");
  r.fingerprint = j["fingerprint"].get<std::string>();
  auto type = [&](const char* key) {
    if (!j.contains(key) || !j[key].is_string()) bad(fmt::format("'{}' (cache type name) is required", key));
    auto t = ggml_type_from_name(j[key].get<std::string>());
    if (!t || !can_quantize(*t)) bad(fmt::format("'{}' {} is not a cache type pdbridge can write", key, j[key].dump()));
    return *t;
  };
  r.k_type = type("k_type");
  r.v_type = type("v_type");
  r.rot_k = j.value("rot_k", false);
  r.rot_v = j.value("rot_v", false);
  r.simd_width = j.value("simd_width", 8);
  if (r.simd_width != 0 && r.simd_width != 4 && r.simd_width != 8 && r.simd_width != 16) bad("'simd_width' must be 0, 4, 8 or 16");
  r.chunk = j.value("chunk", int64_t(0));
  if (r.chunk < 0) bad("'chunk' must be >= 0");
  if (j.contains("tail_from") && !j["tail_from"].is_number_integer()) bad("'tail_from' must be an integer");
  r.tail_from = j.value("tail_from", int64_t(0));
  if (r.tail_from < 0 || r.tail_from >= int64_t(r.tokens.size()))
    bad(fmt::format("'tail_from' {} must be in [0, {}): the decoder holds the first tail_from tokens, the capture sends the rest", r.tail_from,
                    r.tokens.size()));
  return r;
}

}  // namespace pdb::wire
