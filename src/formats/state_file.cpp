#include "formats/state_file.h"
#include "common/tuning.h"
#include "formats/state_file_dsv4.h"
#include "formats/state_file_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include <fmt/format.h>

namespace pdb {
using state_io::fail;
using state_io::Reader;

uint64_t StateLayout::kv_bytes_per_cell() const {
  uint64_t b = 0;
  for (const auto& l : layers) b += l.k_row_bytes + l.v_row_bytes;
  return b;
}

std::vector<StateSection> StateLayout::sections() const {
  std::vector<StateSection> out;
  for (uint32_t l = 0; l < n_layer(); ++l) out.push_back({l, SectionKind::K, layers[l].k_type, layers[l].k_row_bytes, layers[l].n_embd_k, false});
  for (uint32_t l = 0; l < n_layer(); ++l)
    if (layers[l].has_v()) out.push_back({l, SectionKind::V, layers[l].v_type, layers[l].v_row_bytes, layers[l].n_embd_v, v_trans});
  return out;
}

std::string StateLayout::describe() const {
  if (layers.empty()) return fmt::format("n_stream {} (no layers)", n_stream);
  if (!has_v())
    return fmt::format("n_stream {} stream {} layers {} K {} ({} B/row), no V sections{}", n_stream, stream, layers.size(),
                       ggml_type_name(layers[0].k_type), layers[0].k_row_bytes, v_trans ? " v_trans" : "");
  return fmt::format("n_stream {} stream {} layers {} K {} ({} B/row) V {} ({} B/row){}", n_stream, stream, layers.size(),
                     ggml_type_name(layers[0].k_type), layers[0].k_row_bytes, ggml_type_name(layers[0].v_type),
                     layers[0].v_row_bytes, v_trans ? " v_trans" : "");
}

bool state_version_known(uint32_t version) { return version >= kStateVersionMin && version <= kStateVersion; }

std::string state_version_note(uint32_t version) {
  return fmt::format("llama.cpp state version {}: pdbridge reads and writes versions {} (llama.cpp releases before August 2026) "
                     "and {} (since); {}",
                     version, kStateVersionMin, kStateVersion,
                     version > kStateVersion ? "the decoder is a newer llama.cpp than this pdbridge knows: its state format is not "
                                               "known, so nothing is mounted (upgrade pdbridge)"
                                             : "the decoder is older than any release pdbridge was measured against");
}

std::vector<int32_t> decode_state_tokens(const std::vector<int32_t>& raw, bool* packed) {
  if (packed) *packed = false;
  if (raw.empty() || raw[0] != -1) return raw;
  if (packed) *packed = true;
  if (raw.size() < 3 || raw[1] != 1)
    throw std::runtime_error(fmt::format("token encoding: the server's packed token list is version {} (pdbridge reads version 1): "
                                         "a llama.cpp release pdbridge does not know",
                                         raw.size() < 2 ? -1 : raw[1]));
  const uint32_t n = uint32_t(raw[2]);
  if (size_t(n) + 3 > raw.size()) throw std::runtime_error("packed token list is truncated");
  std::vector<int32_t> t(raw.begin() + 3, raw.begin() + 3 + n);
  if (raw.size() < size_t(n) + 4 || raw[3 + n] != 0) throw std::runtime_error("packed token state carries media, which pdbridge does not handle");
  return t;
}

namespace {
// Parses the file's bytes at p (owned by s.storage or s.mapping); row pointers point into them.
void parse_state_into(ParsedState& s, const uint8_t* p, size_t n, const std::string& name) {
  Reader r{p, n, 0, name};
  const std::vector<int32_t> raw = state_io::read_state_header(r, &s.layout.file_version);
  try { s.tokens = decode_state_tokens(raw, &s.packed_tokens); } catch (const std::exception& e) { fail(name, e.what()); }

  if (r.n - r.pos >= 4) {
    uint32_t next;
    std::memcpy(&next, r.p + r.pos, 4);
    if (next == kDsv4Magic)
      fail(name, "a DeepSeek-V4 state (llama.cpp's DSV4 memory: window, compressed pools, rings), not a K/V one: formats/state_file_dsv4 "
                 "reads it (the front door does when its --decoder-gguf is a deepseek4 model; is the decoder running another model?)");
  }
  s.layout.n_stream = r.get<uint32_t>("n_stream");
  if (s.layout.n_stream == 0 || s.layout.n_stream > 4096) fail(name, fmt::format("n_stream {} is implausible", s.layout.n_stream));
  bool found = false;
  for (uint32_t st = 0; st < s.layout.n_stream; ++st) {
    const uint32_t cells = r.get<uint32_t>("cell_count");
    if (cells == 0) continue;
    if (found) fail(name, "more than one stream holds cells (not a single-sequence file)");
    found = true;
    s.layout.stream = st;
    s.cell_count = cells;
    if (uint64_t(cells) * 12 > r.n - r.pos) fail(name, fmt::format("{} cells do not fit in the file", cells));
    s.positions.resize(cells);
    for (uint32_t c = 0; c < cells; ++c) {
      s.positions[c] = r.get<int32_t>("pos");
      const uint32_t n_seq = r.get<uint32_t>("n_seq_id");
      if (n_seq != 1) fail(name, fmt::format("cell {} has n_seq_id {} (cell extensions or shared cells are not supported)", c, n_seq));
      (void)r.get<int32_t>("seq_id");
    }
    s.layout.v_trans = r.get<uint32_t>("v_trans") != 0;
    const uint32_t n_layer = r.get<uint32_t>("n_layer");
    if (n_layer == 0 || n_layer > 1024) fail(name, fmt::format("n_layer {} is implausible", n_layer));
    s.layout.layers.resize(n_layer);
    for (uint32_t l = 0; l < n_layer; ++l) {
      auto& L = s.layout.layers[l];
      const int32_t kt = r.get<int32_t>("k_type");
      auto tr = ggml_type_traits(uint32_t(kt));
      if (kt < 0 || !tr) fail(name, fmt::format("layer {} has unknown K type {}", l, kt));
      L.k_type = GgmlType(kt);
      L.k_row_bytes = r.get<uint64_t>("k_row_bytes");
      if (L.k_row_bytes == 0 || L.k_row_bytes % tr->type_size) fail(name, fmt::format("layer {} K row of {} bytes is not whole {} blocks", l, L.k_row_bytes, tr->name));
      L.n_embd_k = uint32_t(L.k_row_bytes / tr->type_size * tr->block_size);
      s.k_data.push_back(r.take(L.k_row_bytes * cells, "K rows"));
    }
    // A cache without V tensors (MLA) writes no V section at all: what follows is then only the
    // zero cell counts of the streams after this one. A V section is at least 12 bytes per layer,
    // so the two cannot be confused.
    if (r.n - r.pos == 4 * uint64_t(s.layout.n_stream - st - 1)) {
      for (auto& L : s.layout.layers) { L.v_row_bytes = 0; L.n_embd_v = 0; }
      continue;
    }
    for (uint32_t l = 0; l < n_layer; ++l) {
      auto& L = s.layout.layers[l];
      const int32_t vt = r.get<int32_t>("v_type");
      auto tr = ggml_type_traits(uint32_t(vt));
      if (vt < 0 || !tr) fail(name, fmt::format("layer {} has unknown V type {}", l, vt));
      L.v_type = GgmlType(vt);
      if (!s.layout.v_trans) {
        L.v_row_bytes = r.get<uint64_t>("v_row_bytes");
        if (L.v_row_bytes == 0 || L.v_row_bytes % tr->type_size) fail(name, fmt::format("layer {} V row of {} bytes is not whole blocks", l, L.v_row_bytes));
        L.n_embd_v = uint32_t(L.v_row_bytes / tr->type_size * tr->block_size);
        s.v_data.push_back(r.take(L.v_row_bytes * cells, "V rows"));
      } else {
        const uint32_t el = r.get<uint32_t>("v elem bytes");
        L.n_embd_v = r.get<uint32_t>("n_embd_v");
        if (tr->block_size != 1 || el != tr->type_size) fail(name, fmt::format("layer {} transposed V of type {} with element size {}", l, tr->name, el));
        L.v_row_bytes = uint64_t(el) * L.n_embd_v;
        s.v_data.push_back(r.take(L.v_row_bytes * cells, "V elements"));
      }
    }
  }
  if (r.pos != r.n) fail(name, fmt::format("{} trailing bytes", r.n - r.pos));
}
}  // namespace

ParsedState parse_state_bytes(std::vector<uint8_t> bytes, const std::string& name) {
  ParsedState s;
  s.storage = std::move(bytes);
  parse_state_into(s, s.storage.data(), s.storage.size(), name);
  return s;
}

ParsedState parse_state_file_mapped(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, fmt::format("cannot open: {}", std::strerror(errno)));
  struct stat stt{};
  if (fstat(fd, &stt) != 0 || stt.st_size <= 0) {
    ::close(fd);
    fail(path, "cannot stat, or empty");
  }
  const size_t n = size_t(stt.st_size);
  void* m = mmap(nullptr, n, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (m == MAP_FAILED) fail(path, fmt::format("cannot map: {}", std::strerror(errno)));
  ParsedState s;
  s.mapping = std::shared_ptr<const void>(m, [n](const void* q) { munmap(const_cast<void*>(q), n); });
  parse_state_into(s, static_cast<const uint8_t*>(m), n, path);
  return s;
}

ParsedState parse_state_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot open");
  std::vector<uint8_t> b{std::istreambuf_iterator<char>(in), {}};
  return parse_state_bytes(std::move(b), path);
}

StateFileGeometry::StateFileGeometry(const StateLayout& layout, size_t n_tokens, uint32_t n_cells)
    : layout_(layout), n_cells_(n_cells) {
  if (n_cells == 0) throw std::invalid_argument("a state file with zero cells crashes llama-server; refusing to lay one out");
  if (layout.stream >= layout.n_stream) throw std::invalid_argument("stream index out of range");
  uint64_t off = 4 + 4 + 4 + 4 * uint64_t(n_tokens) + 4;  // magic, version, n_token, tokens, n_stream
  off += 4 * uint64_t(layout.stream);                     // empty streams before ours
  off += 4;                                               // our cell_count
  meta_ = off;
  off += 12 * uint64_t(n_cells);                          // pos, n_seq_id, seq_id
  off += 8;                                               // v_trans, n_layer
  for (const auto& l : layout.layers) {
    off += 4 + 8;
    k_base_.push_back(off);
    off += l.k_row_bytes * n_cells;
  }
  for (const auto& l : layout.layers) {
    if (l.has_v() != layout.has_v()) throw std::invalid_argument("a layout with V sections in some layers only");
    if (!l.has_v()) continue;
    off += layout.v_trans ? 4 + 4 + 4 : 4 + 8;
    v_base_.push_back(off);
    off += l.v_row_bytes * n_cells;
  }
  off += 4 * uint64_t(layout.n_stream - layout.stream - 1);  // empty streams after ours
  total_ = off;
}

uint64_t StateFileGeometry::k_row_offset(uint32_t layer, uint32_t cell) const {
  return k_base_.at(layer) + layout_.layers[layer].k_row_bytes * cell;
}
uint64_t StateFileGeometry::v_row_offset(uint32_t layer, uint32_t cell) const {
  if (layout_.v_trans) throw std::logic_error("v_row_offset on a transposed-V layout");
  return v_base_.at(layer) + layout_.layers[layer].v_row_bytes * cell;
}
uint64_t StateFileGeometry::v_elem_offset(uint32_t layer, uint32_t cell, uint32_t j) const {
  const auto& l = layout_.layers[layer];
  const uint64_t el = l.v_row_bytes / l.n_embd_v;
  return v_base_.at(layer) + (uint64_t(j) * n_cells_ + cell) * el;
}

StateFileWriter::StateFileWriter(const std::string& path, const StateLayout& layout, const std::vector<int32_t>& tokens, uint32_t n_cells,
                                 WriteMode mode)
    : path_(path), partial_(path + ".partial"), geo_(layout, tokens.size(), n_cells) {
  if (tokens.size() < n_cells) throw std::invalid_argument("fewer tokens than cells");
  fd_ = ::open(partial_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error(fmt::format("cannot create {}: {}", partial_, std::strerror(errno)));
  if (ftruncate(fd_, off_t(geo_.total_bytes())) != 0) {
    const int e = errno;
    abandon();
    throw std::runtime_error(fmt::format("cannot size {} to {} bytes: {}", partial_, geo_.total_bytes(), std::strerror(e)));
  }
  struct statvfs sv{};
  if (mode == WriteMode::Auto && Tuning::from_env().state_pwrite != "1" && geo_.total_bytes() > 0 && fstatvfs(fd_, &sv) == 0 &&
      uint64_t(sv.f_bavail) * uint64_t(sv.f_frsize) >= 2 * geo_.total_bytes()) {
    void* m = mmap(nullptr, size_t(geo_.total_bytes()), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (m != MAP_FAILED) map_ = static_cast<uint8_t*>(m);
  }
  // header, tokens (plain list: the server accepts it), stream cell counts, cell metadata, layer headers
  std::vector<uint8_t> h;
  auto put = [&h](const void* p, size_t n) { h.insert(h.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n); };
  auto u32 = [&put](uint32_t v) { put(&v, 4); };
  u32(kStateMagic);
  u32(layout.file_version);
  u32(uint32_t(tokens.size()));
  put(tokens.data(), tokens.size() * 4);
  u32(layout.n_stream);
  for (uint32_t s = 0; s < layout.stream; ++s) u32(0);
  u32(n_cells);
  for (uint32_t c = 0; c < n_cells; ++c) {
    const int32_t pos = int32_t(c), seq = 0;
    put(&pos, 4);
    u32(1);
    put(&seq, 4);
  }
  u32(layout.v_trans ? 1 : 0);
  u32(layout.n_layer());
  pwrite_all(h.data(), h.size(), 0);
  for (uint32_t l = 0; l < layout.n_layer(); ++l) {
    const auto& L = layout.layers[l];
    uint8_t kh[12];
    const int32_t kt = int32_t(L.k_type);
    std::memcpy(kh, &kt, 4);
    std::memcpy(kh + 4, &L.k_row_bytes, 8);
    pwrite_all(kh, 12, geo_.k_row_offset(l, 0) - 12);
    if (!L.has_v()) continue;
    const int32_t vt = int32_t(L.v_type);
    if (!layout.v_trans) {
      std::memcpy(kh, &vt, 4);
      std::memcpy(kh + 4, &L.v_row_bytes, 8);
      pwrite_all(kh, 12, geo_.v_elem_offset(l, 0, 0) - 12);
    } else {
      const uint32_t el = uint32_t(L.v_row_bytes / L.n_embd_v);
      std::memcpy(kh, &vt, 4);
      std::memcpy(kh + 4, &el, 4);
      std::memcpy(kh + 8, &L.n_embd_v, 4);
      pwrite_all(kh, 12, geo_.v_elem_offset(l, 0, 0) - 12);
    }
  }
  // empty streams after ours are already zero (ftruncate)
}

StateFileWriter::~StateFileWriter() { if (!committed_) abandon(); }

void StateFileWriter::unmap() {
  if (map_) munmap(map_, size_t(geo_.total_bytes()));
  map_ = nullptr;
}

void StateFileWriter::pwrite_all(const void* p, size_t n, uint64_t off) {
  if (off + n > geo_.total_bytes()) throw std::out_of_range(fmt::format("write past the end of {}", partial_));
  if (map_) {
    std::memcpy(map_ + off, p, n);
    bytes_ += n;
    return;
  }
  const auto* b = static_cast<const uint8_t*>(p);
  while (n) {
    const ssize_t w = ::pwrite(fd_, b, n, off_t(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(fmt::format("write to {} failed: {}", partial_, std::strerror(errno)));
    }
    b += w; n -= size_t(w); off += uint64_t(w);
    bytes_ += uint64_t(w);
  }
}

void StateFileWriter::write_k_rows(uint32_t layer, uint32_t cell, uint32_t rows, const uint8_t* data) {
  if (layer >= geo_.layout().n_layer() || uint64_t(cell) + rows > geo_.n_cells()) throw std::out_of_range("K rows outside the state file");
  pwrite_all(data, size_t(geo_.layout().layers[layer].k_row_bytes) * rows, geo_.k_row_offset(layer, cell));
}

void StateFileWriter::write_v_rows(uint32_t layer, uint32_t cell, uint32_t rows, const uint8_t* data) {
  const auto& lay = geo_.layout();
  if (layer >= lay.n_layer() || uint64_t(cell) + rows > geo_.n_cells()) throw std::out_of_range("V rows outside the state file");
  if (!lay.layers[layer].has_v()) throw std::out_of_range("V rows for a layout without V sections");
  const auto& L = lay.layers[layer];
  if (!lay.v_trans) {
    pwrite_all(data, size_t(L.v_row_bytes) * rows, geo_.v_row_offset(layer, cell));
    return;
  }
  // transposed: element j of every cell is contiguous; scatter this run of rows per element
  const uint32_t el = uint32_t(L.v_row_bytes / L.n_embd_v);
  std::vector<uint8_t> col(size_t(rows) * el);
  for (uint32_t j = 0; j < L.n_embd_v; ++j) {
    for (uint32_t r = 0; r < rows; ++r) std::memcpy(col.data() + size_t(r) * el, data + size_t(r) * L.v_row_bytes + size_t(j) * el, el);
    pwrite_all(col.data(), col.size(), geo_.v_elem_offset(layer, cell, j));
  }
}

void StateFileWriter::pread_all(void* p, size_t n, uint64_t off) const {
  if (off + n > geo_.total_bytes()) throw std::out_of_range(fmt::format("read past the end of {}", partial_));
  if (map_) {
    std::memcpy(p, map_ + off, n);
    return;
  }
  auto* b = static_cast<uint8_t*>(p);
  while (n) {
    const ssize_t r = ::pread(fd_, b, n, off_t(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw std::runtime_error(fmt::format("read from {} failed", partial_));
    b += r; n -= size_t(r); off += uint64_t(r);
  }
}

void StateFileWriter::read_k_rows(uint32_t layer, uint32_t cell, uint32_t rows, uint8_t* out) const {
  pread_all(out, size_t(geo_.layout().layers[layer].k_row_bytes) * rows, geo_.k_row_offset(layer, cell));
}

void StateFileWriter::read_v_rows(uint32_t layer, uint32_t cell, uint32_t rows, uint8_t* out) const {
  const auto& lay = geo_.layout();
  const auto& L = lay.layers[layer];
  if (!lay.v_trans) { pread_all(out, size_t(L.v_row_bytes) * rows, geo_.v_row_offset(layer, cell)); return; }
  const uint32_t el = uint32_t(L.v_row_bytes / L.n_embd_v);
  std::vector<uint8_t> col(size_t(rows) * el);
  for (uint32_t j = 0; j < L.n_embd_v; ++j) {
    pread_all(col.data(), col.size(), geo_.v_elem_offset(layer, cell, j));
    for (uint32_t r = 0; r < rows; ++r) std::memcpy(out + size_t(r) * L.v_row_bytes + size_t(j) * el, col.data() + size_t(r) * el, el);
  }
}

void StateFileWriter::commit() {
  unmap();  // the pages stay in the page cache: the decoder reads what was written
  if (fd_ >= 0) { ::close(fd_); fd_ = -1; }
  std::filesystem::rename(partial_, path_);
  committed_ = true;
}

void StateFileWriter::abandon() {
  unmap();
  if (fd_ >= 0) { ::close(fd_); fd_ = -1; }
  std::error_code ec;
  std::filesystem::remove(partial_, ec);
}

}  // namespace pdb
