#include "formats/state_file_dsv4.h"

#include <algorithm>
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

struct Out {
  std::vector<uint8_t> b;
  template <class T> void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  void bytes(const std::vector<uint8_t>& src, const Dsv4Block& blk) {
    b.insert(b.end(), src.begin() + std::ptrdiff_t(blk.offset), src.begin() + std::ptrdiff_t(blk.offset + blk.bytes()));
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
  s.raw_tokens = state_io::read_state_header(r);
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

Dsv4State parse_dsv4_state_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open state file " + path);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse_dsv4_state_bytes(std::move(bytes), path);
}

std::vector<uint8_t> serialize_dsv4_state(const Dsv4State& s) {
  Out o;
  o.b.reserve(s.storage.size());
  o.put(kStateMagic);
  o.put(kStateVersion);
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
  return std::move(o.b);
}

std::vector<uint8_t> write_dsv4_state(const Dsv4State& like, const std::vector<int32_t>& tokens, uint32_t window,
                                      const std::vector<Dsv4LayerBytes>& layers) {
  Dsv4State s;
  s.raw_tokens = tokens;
  s.tokens = tokens;
  s.version = like.version;
  s.mode = 0;
  const uint32_t n = uint32_t(tokens.size()), w = std::min(n, window), w0 = n - w;
  auto fail_size = [](const std::string& what, size_t got, uint64_t want) {
    throw std::runtime_error(fmt::format("DSV4 state: {} holds {} bytes, the layout needs {}", what, got, want));
  };
  auto add = [&](Dsv4Block& b, const std::vector<uint8_t>& data, const std::string& what) {
    if (data.size() != b.bytes()) fail_size(what, data.size(), b.bytes());
    b.offset = s.storage.size();
    s.storage.insert(s.storage.end(), data.begin(), data.end());
  };
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
      for (size_t l = 0; l < ls.layers.size(); ++l) {
        Dsv4Block b = ls.layers[l];
        b.rows = cells;
        if (rows) {
          if (l >= layers.size()) throw std::runtime_error("DSV4 state: fewer layers than the layout");
          add(b, layers[l].window, fmt::format("layer {} window", l));
        }
        st.layers.push_back(b);
      }
    }
  };
  raw(like.base, s.base, 0, n, false);
  raw(like.swa, s.swa, w0, w, true);
  auto pool = [&](const Dsv4Pool& lp, Dsv4Pool& p, uint32_t ratio, auto member, const char* what) {
    p.version = lp.version;
    p.n_seq = lp.n_seq;
    p.n_rows = n / ratio;
    p.layer_ids = lp.layer_ids;
    for (size_t i = 0; i < lp.layers.size(); ++i) {
      Dsv4Block b = lp.layers[i];
      b.rows = p.n_rows;
      add(b, layers.at(lp.layer_ids[i]).*member, fmt::format("layer {} {}", lp.layer_ids[i], what));
      p.layers.push_back(b);
    }
  };
  pool(like.csa, s.csa, 4, &Dsv4LayerBytes::pool, "CSA");
  pool(like.hca, s.hca, 128, &Dsv4LayerBytes::pool, "HCA");
  pool(like.lid, s.lid, 4, &Dsv4LayerBytes::lid, "LID");
  auto ring = [&](const Dsv4Ring& lg, Dsv4Ring& g, auto kv, auto score, const char* what) {
    g = lg;
    g.kv.clear();
    g.score.clear();
    for (size_t i = 0; i < lg.layer_ids.size(); ++i) {
      Dsv4Block a = lg.kv[i], b = lg.score[i];
      add(a, layers.at(lg.layer_ids[i]).*kv, fmt::format("layer {} {} kv ring", lg.layer_ids[i], what));
      add(b, layers.at(lg.layer_ids[i]).*score, fmt::format("layer {} {} score ring", lg.layer_ids[i], what));
      g.kv.push_back(a);
      g.score.push_back(b);
    }
  };
  ring(like.csa_ring, s.csa_ring, &Dsv4LayerBytes::ring_kv, &Dsv4LayerBytes::ring_score, "CSA");
  ring(like.hca_ring, s.hca_ring, &Dsv4LayerBytes::ring_kv, &Dsv4LayerBytes::ring_score, "HCA");
  ring(like.lid_ring, s.lid_ring, &Dsv4LayerBytes::lid_kv, &Dsv4LayerBytes::lid_score, "LID");
  return serialize_dsv4_state(s);
}

}  // namespace pdb
