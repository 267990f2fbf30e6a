#include "formats/state_file_dsv4.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "formats/state_file.h"
#include "formats/state_file_reader.h"

namespace pdb {

using state_io::fail;
using state_io::Reader;

namespace {

void parse_raw(Reader& r, Dsv4RawPart& part, const char* what) {
  const uint32_t n_stream = r.get<uint32_t>("n_stream");
  if (n_stream == 0 || n_stream > 4096) fail(r.name, fmt::format("{}: n_stream {} is implausible", what, n_stream));
  part.streams.resize(n_stream);
  for (auto& st : part.streams) {
    st.cell_count = r.get<uint32_t>("cell_count");
    if (st.cell_count == 0) continue;
    if (uint64_t(st.cell_count) * 12 > r.n - r.pos) fail(r.name, fmt::format("{}: {} cells do not fit in the file", what, st.cell_count));
    st.positions.resize(st.cell_count);
    st.seq_ids.resize(st.cell_count);
    for (uint32_t c = 0; c < st.cell_count; ++c) {
      st.positions[c] = r.get<int32_t>("pos");
      const uint32_t n_seq = r.get<uint32_t>("n_seq_id");
      if (n_seq > 64) fail(r.name, fmt::format("{}: cell {} has {} sequence ids", what, c, n_seq));
      for (uint32_t j = 0; j < n_seq; ++j) st.seq_ids[c].push_back(r.get<int32_t>("seq_id"));
    }
    st.v_trans = r.get<uint32_t>("v_trans");
    const uint32_t n_layer = r.get<uint32_t>("n_layer");
    if (n_layer > 4096) fail(r.name, fmt::format("{}: {} layers is implausible", what, n_layer));
    for (uint32_t l = 0; l < n_layer; ++l) {
      Dsv4Block b;
      b.type = r.get<int32_t>("k_type");
      b.row_bytes = r.get<uint64_t>("k_row_size");
      b.rows = st.cell_count;
      b.offset = r.pos;
      r.take(b.bytes(), "raw K rows");
      st.layers.push_back(b);
    }
  }
}

void parse_pool(Reader& r, Dsv4Pool& p, const char* what) {
  p.version = r.get<uint32_t>("pool version");
  if (p.version != 1 && p.version != 2) fail(r.name, fmt::format("{} pool: version {} (1 or 2)", what, p.version));
  p.n_rows = r.get<uint32_t>("n_rows");
  p.n_seq = r.get<uint32_t>("ns");
  if (p.n_seq != 1) fail(r.name, fmt::format("{} pool: {} sequences (a slot file holds one)", what, p.n_seq));
  const uint32_t n_layer = r.get<uint32_t>("n_layer");
  if (n_layer > 4096) fail(r.name, fmt::format("{} pool: {} layers is implausible", what, n_layer));
  for (uint32_t l = 0; l < n_layer; ++l) {
    p.layer_ids.push_back(r.get<uint32_t>("il"));
    Dsv4Block b;
    b.type = r.get<int32_t>("type");
    b.ne0 = r.get<uint64_t>("ne0");
    b.rows = r.get<uint64_t>("rows");
    b.row_bytes = r.get<uint64_t>("row_size");
    if (b.rows != p.n_rows) fail(r.name, fmt::format("{} pool: layer {} holds {} rows, the header {}", what, p.layer_ids.back(), b.rows, p.n_rows));
    b.offset = r.pos;
    r.take(b.bytes(), "pool rows");
    p.layers.push_back(b);
  }
}

Dsv4Block parse_ring_tensor(Reader& r, const Dsv4Ring& g, const char* what) {
  Dsv4Block b;
  b.type = r.get<int32_t>("ring type");
  b.ne0 = r.get<uint64_t>("ring ne0");
  b.rows = r.get<uint64_t>("ring rows");
  b.row_bytes = r.get<uint64_t>("ring row size");
  if (b.type != 0 || b.ne0 != g.n_embd_state || b.rows != g.state_size || b.row_bytes != 4 * b.ne0)
    fail(r.name, fmt::format("{} ring: a tensor of type {} {} x {} ({} B/row), not f32 {} x {}", what, b.type, b.rows, b.ne0, b.row_bytes,
                             g.state_size, g.n_embd_state));
  b.offset = r.pos;
  r.take(b.bytes(), "ring rows");
  return b;
}

void parse_ring(Reader& r, Dsv4Ring& g, const char* what) {
  g.version = r.get<uint32_t>("ring version");
  if (g.version != 1) fail(r.name, fmt::format("{} ring: version {} (1)", what, g.version));
  g.ratio = r.get<uint32_t>("ratio");
  g.state_size = r.get<uint32_t>("state_size");
  g.n_embd_state = r.get<uint32_t>("n_embd_state");
  g.n_seq = r.get<uint32_t>("ns");
  if (g.n_seq != 1) fail(r.name, fmt::format("{} ring: {} sequences (a slot file holds one)", what, g.n_seq));
  const uint32_t n_layer = r.get<uint32_t>("n_layer");
  if (n_layer > 4096) fail(r.name, fmt::format("{} ring: {} layers is implausible", what, n_layer));
  for (uint32_t l = 0; l < n_layer; ++l) {
    g.layer_ids.push_back(r.get<uint32_t>("il"));
    g.kv.push_back(parse_ring_tensor(r, g, what));
    g.score.push_back(parse_ring_tensor(r, g, what));
  }
}

// The serializer's output: the whole file in `b`, or (plan mode) the metadata as pieces at their file offsets
// and each data block's offset, in the order the file holds them (that of Dsv4State::sections()).
struct Out {
  std::vector<uint8_t> b;
  bool plan = false;
  uint64_t base = 0;  // plan mode: file offset of b[0]
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> pieces;
  std::vector<uint64_t> block_offsets;
  template <class T> void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  void bytes(const std::vector<uint8_t>& src, const Dsv4Block& blk) {
    if (!plan) {
      b.insert(b.end(), src.begin() + std::ptrdiff_t(blk.offset), src.begin() + std::ptrdiff_t(blk.offset + blk.bytes()));
      return;
    }
    const uint64_t at = base + b.size();
    pieces.emplace_back(base, std::move(b));
    b.clear();
    block_offsets.push_back(at);
    base = at + blk.bytes();
  }
};

}  // namespace

const char* to_string(Dsv4SectionKind k) {
  switch (k) {
    case Dsv4SectionKind::Window: return "window";
    case Dsv4SectionKind::Csa: return "csa";
    case Dsv4SectionKind::Hca: return "hca";
    case Dsv4SectionKind::Lid: return "lid";
    case Dsv4SectionKind::CsaKvRing: return "csa-kv-ring";
    case Dsv4SectionKind::CsaScoreRing: return "csa-score-ring";
    case Dsv4SectionKind::HcaKvRing: return "hca-kv-ring";
    case Dsv4SectionKind::HcaScoreRing: return "hca-score-ring";
    case Dsv4SectionKind::LidKvRing: return "lid-kv-ring";
    case Dsv4SectionKind::LidScoreRing: return "lid-score-ring";
  }
  return "?";
}

uint32_t Dsv4State::cells() const {
  for (const auto& s : base.streams)
    if (s.cell_count) return s.cell_count;
  return 0;
}

uint32_t Dsv4State::window_cells() const {
  for (const auto& s : swa.streams)
    if (s.cell_count) return s.cell_count;
  return 0;
}

std::vector<Dsv4Section> Dsv4State::sections() const {
  std::vector<Dsv4Section> out;
  for (const auto& s : swa.streams)
    for (uint32_t l = 0; l < s.layers.size(); ++l) out.push_back({l, Dsv4SectionKind::Window, s.layers[l]});
  auto pool = [&](const Dsv4Pool& p, Dsv4SectionKind k) {
    for (size_t i = 0; i < p.layers.size(); ++i) out.push_back({p.layer_ids[i], k, p.layers[i]});
  };
  pool(csa, Dsv4SectionKind::Csa);
  pool(hca, Dsv4SectionKind::Hca);
  pool(lid, Dsv4SectionKind::Lid);
  auto ring = [&](const Dsv4Ring& g, Dsv4SectionKind kv, Dsv4SectionKind score) {
    for (size_t i = 0; i < g.layer_ids.size(); ++i) {
      out.push_back({g.layer_ids[i], kv, g.kv[i]});
      out.push_back({g.layer_ids[i], score, g.score[i]});
    }
  };
  ring(csa_ring, Dsv4SectionKind::CsaKvRing, Dsv4SectionKind::CsaScoreRing);
  ring(hca_ring, Dsv4SectionKind::HcaKvRing, Dsv4SectionKind::HcaScoreRing);
  ring(lid_ring, Dsv4SectionKind::LidKvRing, Dsv4SectionKind::LidScoreRing);
  return out;
}

std::string Dsv4State::describe() const {
  return fmt::format("DSV4 v{} mode {}: {} cells, window {} cells x {} layers; CSA {} rows x {} layers, HCA {} x {}, LID {} x {}; rings {}/{}/{} layers",
                     version, mode, cells(), window_cells(), swa.streams.empty() ? 0 : [&] {
                       for (const auto& s : swa.streams) if (s.cell_count) return s.layers.size();
                       return size_t(0);
                     }(),
                     csa.n_rows, csa.layers.size(), hca.n_rows, hca.layers.size(), lid.n_rows, lid.layers.size(), csa_ring.layer_ids.size(),
                     hca_ring.layer_ids.size(), lid_ring.layer_ids.size());
}

bool is_dsv4_state(const std::vector<uint8_t>& b) {
  if (b.size() < 16) return false;
  uint32_t magic, n_tok;
  std::memcpy(&magic, b.data(), 4);
  std::memcpy(&n_tok, b.data() + 8, 4);
  const uint64_t at = 12 + uint64_t(n_tok) * 4;
  if (magic != kStateMagic || at + 4 > b.size()) return false;
  uint32_t m;
  std::memcpy(&m, b.data() + at, 4);
  return m == kDsv4Magic;
}

Dsv4State parse_dsv4_state_bytes(std::vector<uint8_t> bytes, const std::string& name) {
  Dsv4State s;
  s.storage = std::move(bytes);
  Reader r{s.storage.data(), s.storage.size(), 0, name};
  s.raw_tokens = state_io::read_state_header(r, &s.file_version);
  try { s.tokens = decode_state_tokens(s.raw_tokens, &s.packed_tokens); } catch (const std::exception& e) { fail(name, e.what()); }
  if (r.get<uint32_t>("DSV4 magic") != kDsv4Magic) fail(name, "not a DeepSeek-V4 state (no 'DSV4' after the tokens)");
  s.version = r.get<uint32_t>("DSV4 version");
  if (s.version != 1) fail(name, fmt::format("DSV4 version {} (1)", s.version));
  s.mode = r.get<uint32_t>("DSV4 mode");
  if (s.mode != 0) fail(name, fmt::format("DSV4 mode {}: a partial (checkpoint) state, not a slot file", s.mode));
  parse_raw(r, s.base, "base");
  parse_raw(r, s.swa, "window");
  parse_pool(r, s.csa, "CSA");
  parse_pool(r, s.hca, "HCA");
  parse_pool(r, s.lid, "LID");
  parse_ring(r, s.csa_ring, "CSA");
  parse_ring(r, s.hca_ring, "HCA");
  parse_ring(r, s.lid_ring, "LID");
  if (r.pos != r.n) fail(name, fmt::format("{} bytes after the DSV4 state", r.n - r.pos));
  for (const auto& st : s.base.streams)
    if (st.cell_count && !st.layers.empty()) fail(name, "the base part carries layers (it has none in llama.cpp's DSV4 memory)");
  return s;
}

std::string dsv4_unwritable_reason(const Dsv4State& like) {
  for (const auto& [p, name] : {std::pair{&like.csa, "CSA"}, {&like.hca, "HCA"}, {&like.lid, "LID"}})
    if (p->version == 1 && !p->layers.empty())
      return fmt::format("the decoder's DeepSeek-V4 {} pool state version 1 (llama.cpp before August 2026) holds the pool's whole "
                         "capacity ({} rows) and restores nothing shorter; pdbridge writes pool state version 2 (the used rows): "
                         "this decoder's release is not bridged for DeepSeek-V4",
                         name, p->n_rows);
  return "";
}

Dsv4State parse_dsv4_state_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open state file " + path);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse_dsv4_state_bytes(std::move(bytes), path);
}

namespace {
void serialize_into(const Dsv4State& s, Out& o) {
  o.put(kStateMagic);
  o.put(s.file_version);
  o.put(uint32_t(s.raw_tokens.size()));
  for (int32_t t : s.raw_tokens) o.put(t);
  o.put(kDsv4Magic);
  o.put(s.version);
  o.put(s.mode);
  for (const Dsv4RawPart* part : {&s.base, &s.swa}) {
    o.put(uint32_t(part->streams.size()));
    for (const auto& st : part->streams) {
      o.put(st.cell_count);
      if (!st.cell_count) continue;
      for (uint32_t c = 0; c < st.cell_count; ++c) {
        o.put(st.positions[c]);
        o.put(uint32_t(st.seq_ids[c].size()));
        for (int32_t id : st.seq_ids[c]) o.put(id);
      }
      o.put(st.v_trans);
      o.put(uint32_t(st.layers.size()));
      for (const auto& b : st.layers) {
        o.put(b.type);
        o.put(b.row_bytes);
        o.bytes(s.storage, b);
      }
    }
  }
  for (const Dsv4Pool* p : {&s.csa, &s.hca, &s.lid}) {
    o.put(p->version);
    o.put(p->n_rows);
    o.put(p->n_seq);
    o.put(uint32_t(p->layers.size()));
    for (size_t i = 0; i < p->layers.size(); ++i) {
      const auto& b = p->layers[i];
      o.put(p->layer_ids[i]);
      o.put(b.type);
      o.put(b.ne0);
      o.put(b.rows);
      o.put(b.row_bytes);
      o.bytes(s.storage, b);
    }
  }
  for (const Dsv4Ring* g : {&s.csa_ring, &s.hca_ring, &s.lid_ring}) {
    o.put(g->version);
    o.put(g->ratio);
    o.put(g->state_size);
    o.put(g->n_embd_state);
    o.put(g->n_seq);
    o.put(uint32_t(g->layer_ids.size()));
    for (size_t i = 0; i < g->layer_ids.size(); ++i) {
      o.put(g->layer_ids[i]);
      for (const Dsv4Block* b : {&g->kv[i], &g->score[i]}) {
        o.put(b->type);
        o.put(b->ne0);
        o.put(b->rows);
        o.put(b->row_bytes);
        o.bytes(s.storage, *b);
      }
    }
  }
}
}  // namespace

std::vector<uint8_t> serialize_dsv4_state(const Dsv4State& s) {
  Out o;
  o.b.reserve(s.storage.size());
  serialize_into(s, o);
  return std::move(o.b);
}

Dsv4State plan_dsv4_state(const Dsv4State& like, const std::vector<int32_t>& tokens, uint32_t window) {
  Dsv4State s;
  s.raw_tokens = tokens;
  s.tokens = tokens;
  s.file_version = like.file_version;
  s.version = like.version;
  s.mode = 0;
  const uint32_t n = uint32_t(tokens.size()), w = std::min(n, window), w0 = n - w;
  auto raw = [&](const Dsv4RawPart& lp, Dsv4RawPart& part, uint32_t first, uint32_t cells, bool rows) {
    part.streams.resize(lp.streams.size());
    for (size_t i = 0; i < lp.streams.size(); ++i) {
      const auto& ls = lp.streams[i];
      auto& st = part.streams[i];
      if (!ls.cell_count) continue;  // the stream that holds the sequence in `like` holds it here
      st.cell_count = cells;
      st.v_trans = ls.v_trans;
      for (uint32_t c = 0; c < cells; ++c) {
        st.positions.push_back(int32_t(first + c));
        st.seq_ids.push_back(ls.seq_ids.empty() ? std::vector<int32_t>{0} : ls.seq_ids[0]);
      }
      if (!rows) continue;
      for (const auto& lb : ls.layers) {
        Dsv4Block b = lb;
        b.rows = cells;
        b.offset = 0;
        st.layers.push_back(b);
      }
    }
  };
  raw(like.base, s.base, 0, n, false);
  raw(like.swa, s.swa, w0, w, true);
  auto pool = [&](const Dsv4Pool& lp, Dsv4Pool& p, uint32_t ratio) {
    p = lp;
    p.n_rows = n / ratio;
    for (auto& b : p.layers) { b.rows = p.n_rows; b.offset = 0; }
  };
  pool(like.csa, s.csa, 4);
  pool(like.hca, s.hca, 128);
  pool(like.lid, s.lid, 4);
  for (auto [from, to] : {std::pair{&like.csa_ring, &s.csa_ring}, {&like.hca_ring, &s.hca_ring}, {&like.lid_ring, &s.lid_ring}}) {
    *to = *from;  // fixed-size rings: the same blocks whatever the token count
    for (auto* v : {&to->kv, &to->score})
      for (auto& b : *v) b.offset = 0;
  }
  return s;
}

const std::vector<uint8_t>& dsv4_section_bytes(const Dsv4LayerBytes& l, Dsv4SectionKind k) {
  switch (k) {
    case Dsv4SectionKind::Window: return l.window;
    case Dsv4SectionKind::Csa:
    case Dsv4SectionKind::Hca: return l.pool;
    case Dsv4SectionKind::Lid: return l.lid;
    case Dsv4SectionKind::CsaKvRing:
    case Dsv4SectionKind::HcaKvRing: return l.ring_kv;
    case Dsv4SectionKind::CsaScoreRing:
    case Dsv4SectionKind::HcaScoreRing: return l.ring_score;
    case Dsv4SectionKind::LidKvRing: return l.lid_kv;
    case Dsv4SectionKind::LidScoreRing: return l.lid_score;
  }
  throw std::logic_error("DSV4 section kind");
}

std::vector<uint8_t> write_dsv4_state(const Dsv4State& like, const std::vector<int32_t>& tokens, uint32_t window,
                                      const std::vector<Dsv4LayerBytes>& layers) {
  Dsv4State s = plan_dsv4_state(like, tokens, window);
  // the sections' bytes into storage, in the file's order; each block then points at its own
  std::vector<Dsv4Block*> blocks;
  for (auto& st : s.swa.streams)
    for (auto& b : st.layers) blocks.push_back(&b);
  for (Dsv4Pool* p : {&s.csa, &s.hca, &s.lid})
    for (auto& b : p->layers) blocks.push_back(&b);
  for (Dsv4Ring* g : {&s.csa_ring, &s.hca_ring, &s.lid_ring})
    for (size_t i = 0; i < g->layer_ids.size(); ++i) { blocks.push_back(&g->kv[i]); blocks.push_back(&g->score[i]); }
  const auto secs = s.sections();
  for (size_t i = 0; i < secs.size(); ++i) {
    if (secs[i].layer >= layers.size()) throw std::runtime_error("DSV4 state: fewer layers than the layout");
    const auto& data = dsv4_section_bytes(layers[secs[i].layer], secs[i].kind);
    if (data.size() != blocks[i]->bytes())
      throw std::runtime_error(fmt::format("DSV4 state: layer {} {} holds {} bytes, the layout needs {}", secs[i].layer, to_string(secs[i].kind),
                                           data.size(), blocks[i]->bytes()));
    blocks[i]->offset = s.storage.size();
    s.storage.insert(s.storage.end(), data.begin(), data.end());
  }
  return serialize_dsv4_state(s);
}

Dsv4StateWriter::Dsv4StateWriter(const std::string& path, Dsv4State plan) : path_(path), partial_(path + ".partial"), plan_(std::move(plan)) {
  Out o;
  o.plan = true;
  serialize_into(plan_, o);
  const auto secs = plan_.sections();
  if (o.block_offsets.size() != secs.size()) throw std::logic_error("DSV4 writer: blocks and sections disagree");
  for (size_t i = 0; i < secs.size(); ++i) {
    Dsv4Section sec = secs[i];
    sec.block.offset = o.block_offsets[i];
    index_[{sec.layer, sec.kind}] = sec;
  }
  total_ = o.base + o.b.size();
  o.pieces.emplace_back(o.base, std::move(o.b));
  fd_ = ::open(partial_.c_str(), O_CREAT | O_TRUNC | O_RDWR | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error(fmt::format("cannot create {}: {}", partial_, std::strerror(errno)));
  if (::ftruncate(fd_, off_t(total_)) != 0) {
    const int e = errno;
    abandon();
    throw std::runtime_error(fmt::format("cannot size {} to {} bytes: {}", partial_, total_, std::strerror(e)));
  }
  for (const auto& [off, bytes] : o.pieces) pwrite_all(bytes.data(), bytes.size(), off);
}

Dsv4StateWriter::~Dsv4StateWriter() {
  if (!committed_) abandon();
}

const Dsv4Section* Dsv4StateWriter::find(uint32_t layer, Dsv4SectionKind kind) const {
  auto it = index_.find({layer, kind});
  return it == index_.end() ? nullptr : &it->second;
}

void Dsv4StateWriter::write_rows(uint32_t layer, Dsv4SectionKind kind, uint64_t first_row, uint64_t rows, const uint8_t* data) {
  const Dsv4Section* s = find(layer, kind);
  if (!s) throw std::runtime_error(fmt::format("DSV4 state: layer {} has no {} section", layer, to_string(kind)));
  if (first_row + rows > s->block.rows)
    throw std::runtime_error(fmt::format("DSV4 state: layer {} {} rows {}..{} past its {} rows", layer, to_string(kind), first_row, first_row + rows,
                                         s->block.rows));
  pwrite_all(data, size_t(rows * s->block.row_bytes), s->block.offset + first_row * s->block.row_bytes);
}

void Dsv4StateWriter::read_rows(uint32_t layer, Dsv4SectionKind kind, uint64_t first_row, uint64_t rows, uint8_t* out) const {
  const Dsv4Section* s = find(layer, kind);
  if (!s || first_row + rows > s->block.rows) throw std::runtime_error(fmt::format("DSV4 state: no rows {}..{} of layer {} {}", first_row, first_row + rows, layer, to_string(kind)));
  size_t n = size_t(rows * s->block.row_bytes);
  uint64_t off = s->block.offset + first_row * s->block.row_bytes;
  while (n > 0) {
    const ssize_t r = ::pread(fd_, out, n, off_t(off));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw std::runtime_error(fmt::format("read {}: {}", partial_, r < 0 ? std::strerror(errno) : "short file"));
    out += r;
    n -= size_t(r);
    off += uint64_t(r);
  }
}

void Dsv4StateWriter::pwrite_all(const void* p, size_t n, uint64_t off) {
  const auto* c = static_cast<const uint8_t*>(p);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, c, n, off_t(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(fmt::format("write {}: {}", partial_, std::strerror(errno)));
    }
    c += w;
    n -= size_t(w);
    off += uint64_t(w);
  }
}

void Dsv4StateWriter::commit() {
  if (::close(fd_) != 0) {
    fd_ = -1;
    throw std::runtime_error(fmt::format("close {}: {}", partial_, std::strerror(errno)));
  }
  fd_ = -1;
  std::filesystem::rename(partial_, path_);
  committed_ = true;
}

void Dsv4StateWriter::abandon() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  std::error_code ec;
  std::filesystem::remove(partial_, ec);
}

}  // namespace pdb
