#include "cache/assembler.h"

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "common/parallel.h"

namespace pdb {
using json = nlohmann::json;

namespace {
// What every capture's HELLO must say, whatever the cache: first, JSON, this decoder's fingerprint and token count.
json parse_hello(const wire::FrameHeader& h, const uint8_t* payload, bool seen, const std::string& fingerprint, int64_t T) {
  if (seen) throw wire::Error("second HELLO");
  json j;
  try { j = json::parse(payload, payload + h.payload_bytes); } catch (const std::exception& e) { throw wire::Error(std::string("HELLO is not JSON: ") + e.what()); }
  if (j.value("fingerprint", "") != fingerprint) throw wire::Error("fingerprint mismatch: capture " + j.value("fingerprint", "") + ", decoder " + fingerprint);
  if (j.value("n_tokens", int64_t(-1)) != T) throw wire::Error("HELLO token count differs from the request");
  return j;
}
}  // namespace

CaptureAssembler::CaptureAssembler(const std::string& path, const StateLayout& layout, const std::vector<int32_t>& tokens,
                                   std::string fingerprint, int64_t tail_from)
    : path_(path), layout_(layout), T_(int64_t(tokens.size())), fingerprint_(std::move(fingerprint)),
      writer_(path, layout, tokens, uint32_t(tokens.size())),
      parser_([this](const wire::FrameHeader& h, const uint8_t* p) { on_frame(h, p); }),
      k_next_(layout.layers.size(), tail_from), v_next_(layout.layers.size(), tail_from), tail_from_(tail_from), tokens_(tokens) {
  if (tail_from < 0 || tail_from >= T_) throw std::invalid_argument(fmt::format("tail from {} of a {}-token prompt", tail_from, T_));
}

namespace {
// Whether a slot's saved state holds rows exactly as the decoder's probe did (the new file's layout).
bool same_rows(const StateLayout& H, const StateLayout& layout) {
  if (H.n_layer() != layout.n_layer() || H.v_trans != layout.v_trans || H.has_v() != layout.has_v()) return false;
  for (uint32_t l = 0; l < H.n_layer(); ++l) {
    const auto &a = H.layers[l], &b = layout.layers[l];
    if (a.k_type != b.k_type || a.k_row_bytes != b.k_row_bytes || a.v_type != b.v_type || a.v_row_bytes != b.v_row_bytes) return false;
  }
  return true;
}
}  // namespace

int64_t usable_held_prefix(const ParsedState& held, const StateLayout& layout, const std::vector<int32_t>& prompt) {
  if (!same_rows(held.layout, layout)) return 0;
  int64_t P = 0;
  const int64_t n = std::min<int64_t>(int64_t(held.tokens.size()), int64_t(prompt.size()) - 1);
  while (P < n && held.tokens[size_t(P)] == prompt[size_t(P)]) ++P;
  std::vector<bool> present(size_t(std::max<int64_t>(P, 0)), false);
  for (uint32_t c = 0; c < held.cell_count; ++c)
    if (held.positions[c] >= 0 && held.positions[c] < P) present[size_t(held.positions[c])] = true;
  int64_t q = 0;
  while (q < P && present[size_t(q)]) ++q;
  return q;
}

void CaptureAssembler::copy_prefix(const ParsedState& held) {
  const int64_t P = tail_from_;
  if (P == 0) return;
  const StateLayout& H = held.layout;
  if (!same_rows(H, layout_))
    throw std::runtime_error("the slot's saved state has another layout than the decoder's probe (" + H.describe() + ")");
  if (int64_t(held.tokens.size()) < P || !std::equal(held.tokens.begin(), held.tokens.begin() + P, tokens_.begin()))
    throw std::runtime_error("the slot's saved state holds other tokens than the prompt's first " + std::to_string(P));
  // The cell holding each position: in a slot's own state usually cell p, but the file says.
  std::vector<int64_t> cell(size_t(P), -1);
  for (uint32_t c = 0; c < held.cell_count; ++c) {
    const int32_t p = held.positions[c];
    if (p >= 0 && p < P) {
      if (cell[size_t(p)] >= 0) throw std::runtime_error(fmt::format("the slot's saved state holds position {} twice", p));
      cell[size_t(p)] = c;
    }
  }
  for (int64_t p = 0; p < P; ++p)
    if (cell[size_t(p)] < 0) throw std::runtime_error(fmt::format("the slot's saved state lacks position {} of its first {}", p, P));
  constexpr int64_t kBatch = 4096;
  // Layers in parallel: one thread moves ~2 GB/s, and a long conversation's prefix is many GB (the 8B shape at 80K
  // tokens: 10 GB), copied while the prefill server computes the tail.
  const int threads = int(std::min<int64_t>(int64_t(H.n_layer()), std::max(1, std::min(8, default_threads()))));
  parallel_for(int64_t(H.n_layer()), threads, [&](int64_t lb, int64_t le) {
  std::vector<uint8_t> buf;
  for (uint32_t l = uint32_t(lb); l < uint32_t(le); ++l) {
    const auto& L = H.layers[l];
    for (int64_t p = 0; p < P;) {
      // a run of positions in consecutive cells: rows straight from the mapped file
      int64_t e = p + 1;
      while (e < P && e - p < kBatch && cell[size_t(e)] == cell[size_t(e - 1)] + 1) ++e;
      const uint32_t c0 = uint32_t(cell[size_t(p)]), n = uint32_t(e - p);
      writer_.write_k_rows(l, uint32_t(p), n, held.k_data[l] + size_t(c0) * L.k_row_bytes);
      if (L.has_v()) {
        if (!H.v_trans) {
          writer_.write_v_rows(l, uint32_t(p), n, held.v_data[l] + size_t(c0) * L.v_row_bytes);
        } else {  // element-major in the file: gather the run's rows
          const uint64_t el = L.v_row_bytes / L.n_embd_v;
          buf.resize(size_t(L.v_row_bytes) * n);
          for (uint32_t j = 0; j < L.n_embd_v; ++j)
            for (uint32_t r = 0; r < n; ++r)
              std::memcpy(buf.data() + size_t(r) * L.v_row_bytes + j * el, held.v_data[l] + (uint64_t(j) * held.cell_count + c0 + r) * el, el);
          writer_.write_v_rows(l, uint32_t(p), n, buf.data());
        }
      }
      p = e;
    }
  }
  });
}

bool CaptureAssembler::partial() const { return trailer_ && trailer_->value("status", "") == "partial"; }

int64_t CaptureAssembler::finish_partial(const std::string& path) {
  if (!partial()) throw std::runtime_error("capture is not partial");
  if (!parser_.idle()) throw std::runtime_error("capture stream ended inside a frame");
  const int64_t tp = trailer_->value("tokens", int64_t(0));
  if (tp <= tail_from_ || tp > T_) throw std::runtime_error(fmt::format("partial trailer with {} of {} tokens (tail from {})", tp, T_, tail_from_));
  for (size_t l = 0; l < layout_.layers.size(); ++l)
    if (k_next_[l] < tp || (layout_.layers[l].has_v() && v_next_[l] < tp))
      throw std::runtime_error(fmt::format("partial capture: layer {} covers K {} V {} of the sealed {} rows", l, k_next_[l], v_next_[l], tp));
  std::vector<int32_t> prefix(tokens_.begin(), tokens_.begin() + tp);
  // A different temporary name: `path`.partial is the file being read.
  StateFileWriter out(path + ".sealed", layout_, prefix, uint32_t(tp));
  constexpr uint32_t kBatch = 4096;
  std::vector<uint8_t> buf;
  for (uint32_t l = 0; l < layout_.layers.size(); ++l) {
    const auto& L = layout_.layers[l];
    for (uint32_t c = 0; c < uint32_t(tp); c += kBatch) {
      const uint32_t n = std::min<uint32_t>(kBatch, uint32_t(tp) - c);
      buf.resize(size_t(std::max(L.k_row_bytes, L.v_row_bytes)) * n);
      writer_.read_k_rows(l, c, n, buf.data());
      out.write_k_rows(l, c, n, buf.data());
      if (!L.has_v()) continue;
      writer_.read_v_rows(l, c, n, buf.data());
      out.write_v_rows(l, c, n, buf.data());
    }
  }
  out.commit();
  writer_.abandon();
  std::filesystem::rename(path + ".sealed", path);
  return tp;
}

void CaptureAssembler::feed(const uint8_t* data, size_t n) { parser_.feed(data, n); }

void CaptureAssembler::on_frame(const wire::FrameHeader& h, const uint8_t* payload) {
  if (trailer_) throw wire::Error("frame after the trailer");
  if (h.kind == wire::FrameKind::Hello) {
    const json j = parse_hello(h, payload, hello_, fingerprint_, T_);
    if (j.value("k_row_bytes", uint64_t(0)) != layout_.layers[0].k_row_bytes || j.value("v_row_bytes", uint64_t(0)) != layout_.layers[0].v_row_bytes)
      throw wire::Error("HELLO row sizes differ from the decoder's layout");
    if (j.value("tail_from", int64_t(0)) != tail_from_)
      throw wire::Error(fmt::format("HELLO: the capture's rows start at position {}, the front door asked for the tail from {} (a prefill server "
                                    "without tail captures?)", j.value("tail_from", int64_t(0)), tail_from_));
    hello_ = true;
    return;
  }
  if (!hello_) throw wire::Error("frame before HELLO");
  if (h.kind == wire::FrameKind::Trailer) {
    try { trailer_ = json::parse(payload, payload + h.payload_bytes); } catch (const std::exception& e) { throw wire::Error(std::string("trailer is not JSON: ") + e.what()); }
    return;
  }
  const size_t n_layer = layout_.layers.size();
  if (h.layer >= n_layer) throw wire::Error(fmt::format("frame for layer {} of {}", h.layer, n_layer));
  const bool is_k = h.kind == wire::FrameKind::K;
  const auto& LT = layout_.layers[h.layer];
  if (!is_k && !LT.has_v()) throw wire::Error(fmt::format("V rows for layer {}, which has no V section in the decoder's state", h.layer));
  const GgmlType want = is_k ? LT.k_type : LT.v_type;
  if (h.type != uint8_t(want))
    throw wire::Error(fmt::format("layer {} {} rows of type {} (decoder wants {})", h.layer, wire::kind_name(h.kind), h.type, ggml_type_name(want)));
  const uint64_t rb = is_k ? LT.k_row_bytes : LT.v_row_bytes;
  if (h.payload_bytes != rb * h.n_rows) throw wire::Error("row frame size does not match its row count");
  auto& next = is_k ? k_next_[h.layer] : v_next_[h.layer];
  if (int64_t(h.pos0) != next)
    throw wire::Error(fmt::format("layer {} {} rows out of order: position {}, expected {}", h.layer, wire::kind_name(h.kind), h.pos0, next));
  if (int64_t(h.pos0) + h.n_rows > T_) throw wire::Error("rows past the end of the prompt");
  if (is_k) writer_.write_k_rows(h.layer, h.pos0, h.n_rows, payload);
  else writer_.write_v_rows(h.layer, h.pos0, h.n_rows, payload);
  next += h.n_rows;
}

void CaptureAssembler::finish() {
  if (!trailer_) throw std::runtime_error("capture stream ended without a trailer");
  if (!parser_.idle()) throw std::runtime_error("capture stream ended inside a frame");
  const std::string st = trailer_->value("status", "");
  if (st != "complete") throw std::runtime_error(fmt::format("capture {} at {} tokens: {}", st, trailer_->value("tokens", 0), trailer_->value("reason", "")));
  if (trailer_->value("tokens", int64_t(-1)) != T_) throw std::runtime_error("trailer token count differs from the request");
  for (size_t l = 0; l < layout_.layers.size(); ++l)
    if (k_next_[l] != T_ || (layout_.layers[l].has_v() && v_next_[l] != T_))
      throw std::runtime_error(fmt::format("layer {} incomplete: K {} V {} of {} rows", l, k_next_[l], v_next_[l], T_));
  writer_.commit();
}

Dsv4CaptureAssembler::Dsv4CaptureAssembler(const std::string& path, const Dsv4State& like, const std::vector<int32_t>& tokens, uint32_t window,
                                           std::string fingerprint)
    : path_(path), like_(like), tokens_(tokens), T_(int64_t(tokens.size())), window_(window),
      window_first_(tokens.size() - std::min<size_t>(tokens.size(), window)),
      fingerprint_(std::move(fingerprint)), writer_(path, plan_dsv4_state(like, tokens, window)),
      parser_([this](const wire::FrameHeader& h, const uint8_t* p) { on_frame(h, p); }) {
  for (const auto& s : writer_.plan().sections()) next_[{s.layer, s.kind}] = base_row(s.kind);
}

void Dsv4CaptureAssembler::on_frame(const wire::FrameHeader& h, const uint8_t* payload) {
  if (trailer_) throw wire::Error("frame after the trailer");
  if (h.kind == wire::FrameKind::Hello) {
    const json j = parse_hello(h, payload, hello_, fingerprint_, T_);
    if (j.value("cache", "") != "dsv4") throw wire::Error("HELLO: the capture is not of a DeepSeek-V4 (pooled) cache");
    if (j.value("window", int64_t(-1)) != int64_t(window_)) throw wire::Error(fmt::format("HELLO: window {} (the decoder's is {})", j.value("window", int64_t(-1)), window_));
    uint64_t window_row_bytes = 0;
    for (const auto& s : writer_.plan().sections())
      if (s.kind == Dsv4SectionKind::Window) { window_row_bytes = s.block.row_bytes; break; }
    if (window_row_bytes && j.value("k_row_bytes", uint64_t(0)) != window_row_bytes) throw wire::Error("HELLO row sizes differ from the decoder's layout");
    hello_ = true;
    return;
  }
  if (!hello_) throw wire::Error("frame before HELLO");
  if (h.kind == wire::FrameKind::Trailer) {
    try { trailer_ = json::parse(payload, payload + h.payload_bytes); } catch (const std::exception& e) { throw wire::Error(std::string("trailer is not JSON: ") + e.what()); }
    return;
  }
  if (h.kind == wire::FrameKind::Seal) {
    json j;
    try { j = json::parse(payload, payload + h.payload_bytes); } catch (const std::exception& e) { throw wire::Error(std::string("SEAL is not JSON: ") + e.what()); }
    return on_seal(j.value("tokens", int64_t(0)));
  }
  if (!wire::is_section_kind(h.kind)) throw wire::Error(fmt::format("{} rows for a DeepSeek-V4 decoder, whose state has sections, not K/V rows", wire::kind_name(h.kind)));
  const auto kind = Dsv4SectionKind(uint8_t(h.kind) - wire::kFirstSectionKind);
  if (sealed_) {  // after the SEAL: the prefix's windows and rings only
    if (kind == Dsv4SectionKind::Csa || kind == Dsv4SectionKind::Hca || kind == Dsv4SectionKind::Lid)
      throw wire::Error(fmt::format("layer {} {} rows after the SEAL (its pools are the rows sent before it)", h.layer, to_string(kind)));
    const Dsv4Section* s = sealed_->find(h.layer, kind);
    if (!s) throw wire::Error(fmt::format("layer {} has no {} section in the decoder's state", h.layer, to_string(kind)));
    if (h.type != uint8_t(s->block.type) || h.payload_bytes != s->block.row_bytes * h.n_rows)
      throw wire::Error(fmt::format("layer {} {} seal rows of another type or size", h.layer, to_string(kind)));
    const uint64_t base = kind == Dsv4SectionKind::Window ? uint64_t(seal_ - std::min<int64_t>(seal_, window_)) : 0;
    uint64_t& next = next_[{h.layer, kind}];
    if (h.pos0 != next) throw wire::Error(fmt::format("layer {} {} seal rows out of order: row {}, expected {}", h.layer, to_string(kind), h.pos0, next));
    if (h.pos0 + uint64_t(h.n_rows) > base + s->block.rows) throw wire::Error(fmt::format("layer {} {}: seal rows past the prefix", h.layer, to_string(kind)));
    sealed_->write_rows(h.layer, kind, h.pos0 - base, h.n_rows, payload);
    next += h.n_rows;
    return;
  }
  const Dsv4Section* s = writer_.find(h.layer, kind);
  if (!s) throw wire::Error(fmt::format("layer {} has no {} section in the decoder's state", h.layer, to_string(kind)));
  if (h.type != uint8_t(s->block.type))
    throw wire::Error(fmt::format("layer {} {} rows of type {} (decoder wants {})", h.layer, to_string(kind), h.type, ggml_type_name(GgmlType(s->block.type))));
  if (h.payload_bytes != s->block.row_bytes * h.n_rows) throw wire::Error("row frame size does not match its row count");
  uint64_t& next = next_[{h.layer, kind}];
  if (h.pos0 != next)
    throw wire::Error(fmt::format("layer {} {} rows out of order: row {}, expected {}", h.layer, to_string(kind), h.pos0, next));
  const uint64_t base = base_row(kind);
  if (h.pos0 + uint64_t(h.n_rows) > base + s->block.rows)
    throw wire::Error(fmt::format("layer {} {}: rows {}..{} past the section's {} rows", h.layer, to_string(kind), h.pos0, h.pos0 + h.n_rows, s->block.rows));
  writer_.write_rows(h.layer, kind, h.pos0 - base, h.n_rows, payload);
  next += h.n_rows;
}

void Dsv4CaptureAssembler::on_seal(int64_t P) {
  if (seal_) throw wire::Error("second SEAL");
  if (P <= 0 || P >= T_) throw wire::Error(fmt::format("SEAL at {} of {} tokens", P, T_));
  const std::vector<int32_t> prefix(tokens_.begin(), tokens_.begin() + P);
  sealed_ = std::make_unique<Dsv4StateWriter>(path_ + ".seal", plan_dsv4_state(like_, prefix, window_));
  std::vector<uint8_t> buf;
  for (const auto& s : sealed_->plan().sections()) {
    const bool pool = s.kind == Dsv4SectionKind::Csa || s.kind == Dsv4SectionKind::Hca || s.kind == Dsv4SectionKind::Lid;
    uint64_t& next = next_[{s.layer, s.kind}];
    if (!pool) {  // the window and the rings come after the SEAL
      next = s.kind == Dsv4SectionKind::Window ? uint64_t(P - std::min<int64_t>(P, window_)) : 0;
      continue;
    }
    // the prefix's pool rows: every block that finished before P, sent before the SEAL
    if (next < s.block.rows)
      throw wire::Error(fmt::format("SEAL at {} tokens: layer {} {} has {} of the prefix's {} rows", P, s.layer, to_string(s.kind), next, s.block.rows));
    buf.resize(size_t(s.block.bytes()));
    if (s.block.rows) {
      writer_.read_rows(s.layer, s.kind, 0, s.block.rows, buf.data());
      sealed_->write_rows(s.layer, s.kind, 0, s.block.rows, buf.data());
    }
    next = s.block.rows;
  }
  seal_ = P;
}

int64_t Dsv4CaptureAssembler::commit() {
  if (!trailer_) throw std::runtime_error("capture stream ended without a trailer");
  if (!parser_.idle()) throw std::runtime_error("capture stream ended inside a frame");
  const std::string st = trailer_->value("status", "");
  if (st == "partial" && sealed_) {
    if (trailer_->value("tokens", int64_t(-1)) != seal_) throw std::runtime_error("partial trailer's token count differs from the SEAL's");
    for (const auto& s : sealed_->plan().sections()) {
      const uint64_t base = s.kind == Dsv4SectionKind::Window ? uint64_t(seal_ - std::min<int64_t>(seal_, window_)) : 0;
      if (next_[{s.layer, s.kind}] - base != s.block.rows)
        throw std::runtime_error(fmt::format("sealed capture: layer {} {} has {} of {} rows", s.layer, to_string(s.kind), next_[{s.layer, s.kind}] - base, s.block.rows));
    }
    sealed_->commit();
    writer_.abandon();
    std::filesystem::rename(path_ + ".seal", path_);
    return seal_;
  }
  if (st == "partial")
    throw std::runtime_error(fmt::format("capture partial at {} tokens ({}) without a SEAL: a DeepSeek-V4 state needs the prefix's windows and rings",
                                         trailer_->value("tokens", 0), trailer_->value("reason", "")));
  if (st != "complete") throw std::runtime_error(fmt::format("capture {} at {} tokens: {}", st, trailer_->value("tokens", 0), trailer_->value("reason", "")));
  if (trailer_->value("tokens", int64_t(-1)) != T_) throw std::runtime_error("trailer token count differs from the request");
  for (const auto& s : writer_.plan().sections()) {
    const uint64_t got = next_[{s.layer, s.kind}] - base_row(s.kind);
    if (got != s.block.rows)
      throw std::runtime_error(fmt::format("layer {} {} incomplete: {} of {} rows", s.layer, to_string(s.kind), got, s.block.rows));
  }
  writer_.commit();
  return T_;
}

}  // namespace pdb
