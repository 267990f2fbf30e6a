// llama.cpp's DeepSeek-V4 sequence state (its `deepseek4` memory, src/llama-kv-cache-dsv4.cpp), parsed and
// written by the same owner as the K/V state (formats/state_file.h). After the usual wrapper (magic, version,
// tokens) a DSV4 file holds, in order (checked against files the running llama-server saves,
// tests/deepseek4_state_test.cpp):
//   'DSV4' u32 version, u32 mode
//   [A] raw caches: a layer-less base part (one cell per position) and the SWA part (the last W cells, one
//       K-only row per layer: the window)
//   [B][C][D] compressed K pools: CSA (one row per 4 tokens, ratio-4 layers), HCA (one per 128, ratio-128
//       layers), LID (the lightning indexer's rows, ratio-4 layers)
//   [E][F][G] compressor states: f32 rings of kv and score rows per layer (CSA 8 x 2D, HCA 128 x D, LID 8 x 2I)
// The sections a recipe fills are these rows; `sections()` names each with its place in the file.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "formats/state_file.h"

namespace pdb {

constexpr uint32_t kDsv4Magic = 0x34565344;  // 'DSV4'

// One (type, rows, row bytes) block at an offset of the file.
struct Dsv4Block {
  int32_t type = 0;         // ggml type
  uint64_t ne0 = 0;         // elements per row
  uint64_t rows = 0, row_bytes = 0;
  uint64_t offset = 0;      // of the first row in the file
  uint64_t bytes() const { return rows * row_bytes; }
};

struct Dsv4RawStream {
  uint32_t cell_count = 0;
  std::vector<int32_t> positions;
  std::vector<std::vector<int32_t>> seq_ids;
  uint32_t v_trans = 0;
  std::vector<Dsv4Block> layers;  // K only; ne0 unknown from the file (0): row_bytes is what it says
};
struct Dsv4RawPart {
  std::vector<Dsv4RawStream> streams;  // n_stream of them; the sequence's cells sit in one
};

struct Dsv4Pool {  // [B] [C] [D]
  uint32_t version = 0, n_rows = 0, n_seq = 0;
  std::vector<uint32_t> layer_ids;
  std::vector<Dsv4Block> layers;
};

struct Dsv4Ring {  // [E] [F] [G]
  uint32_t version = 0, ratio = 0, state_size = 0, n_embd_state = 0, n_seq = 0;
  std::vector<uint32_t> layer_ids;
  std::vector<Dsv4Block> kv, score;
};

enum class Dsv4SectionKind { Window, Csa, Hca, Lid, CsaKvRing, CsaScoreRing, HcaKvRing, HcaScoreRing, LidKvRing, LidScoreRing };
struct Dsv4Section {
  uint32_t layer = 0;
  Dsv4SectionKind kind = Dsv4SectionKind::Window;
  Dsv4Block block;
};
const char* to_string(Dsv4SectionKind k);

struct Dsv4State {
  std::vector<int32_t> raw_tokens;  // as stored (the server's packed form included)
  std::vector<int32_t> tokens;      // decoded
  bool packed_tokens = false;
  uint32_t file_version = kStateVersion;  // llama.cpp's state version (formats/state_file.h)
  uint32_t version = 0, mode = 0;         // the DSV4 memory's own
  Dsv4RawPart base, swa;
  Dsv4Pool csa, hca, lid;
  Dsv4Ring csa_ring, hca_ring, lid_ring;
  std::vector<uint8_t> storage;  // the file's bytes; blocks point into it

  uint32_t cells() const;         // positions the state covers (the base part's cells)
  uint32_t window_cells() const;  // cells with K rows (the SWA part's)
  std::vector<Dsv4Section> sections() const;
  std::string describe() const;
};

// Why pdbridge cannot write a state of this layout for the decoder that saved `like` ("" when it can): llama.cpp
// releases before August 2026 (node-llama-cpp 3.19.1) store a pool's whole capacity (pool state version 1) and
// read back nothing shorter; pdbridge writes the used rows (version 2).
std::string dsv4_unwritable_reason(const Dsv4State& like);

// True when the bytes after a state file's token list start a DSV4 memory.
bool is_dsv4_state(const std::vector<uint8_t>& bytes);
Dsv4State parse_dsv4_state_bytes(std::vector<uint8_t> bytes, const std::string& name);
Dsv4State parse_dsv4_state_file(const std::string& path);
// The file's bytes from the parsed fields and the blocks' data (a parsed file re-writes byte-identical).
std::vector<uint8_t> serialize_dsv4_state(const Dsv4State& s);

// One layer's sections in the decoder's bytes (its cache type for the rows, f32 for the rings); the
// pool / ring parts stay empty for the layers that have none.
struct Dsv4LayerBytes {
  std::vector<uint8_t> window, pool, lid, ring_kv, ring_score, lid_kv, lid_score;
};
// The bytes of one kind of section in a layer's (the pool member holds CSA or HCA rows, by the layer's ratio).
const std::vector<uint8_t>& dsv4_section_bytes(const Dsv4LayerBytes& l, Dsv4SectionKind k);
// A state of `tokens` (the bridge writes T-1 of a T-token prompt) with every section from `layers`, laid out
// as `like` (a file the same decoder saved: its stream count, v_trans, types, row sizes, layer lists and
// ring sizes); `window` is the decoder's sliding window W. Throws when a section's size is not what the
// layout and the token count make it.
std::vector<uint8_t> write_dsv4_state(const Dsv4State& like, const std::vector<int32_t>& tokens, uint32_t window,
                                      const std::vector<Dsv4LayerBytes>& layers);

// The state of `tokens` shaped like `like`: every block with its row count and row size, no data (offsets 0).
Dsv4State plan_dsv4_state(const Dsv4State& like, const std::vector<int32_t>& tokens, uint32_t window);

// Writes a planned state straight into its file: the metadata at once, each section's rows at their offsets as
// they arrive (memory O(rows written), not O(state)); `commit` renames path.partial into place.
class Dsv4StateWriter {
 public:
  Dsv4StateWriter(const std::string& path, Dsv4State plan);
  ~Dsv4StateWriter();
  Dsv4StateWriter(const Dsv4StateWriter&) = delete;
  Dsv4StateWriter& operator=(const Dsv4StateWriter&) = delete;
  const Dsv4State& plan() const { return plan_; }
  // The section (its block's offset in this file), or null where the layout has none for that layer.
  const Dsv4Section* find(uint32_t layer, Dsv4SectionKind kind) const;
  void write_rows(uint32_t layer, Dsv4SectionKind kind, uint64_t first_row, uint64_t rows, const uint8_t* data);
  void read_rows(uint32_t layer, Dsv4SectionKind kind, uint64_t first_row, uint64_t rows, uint8_t* out) const;  // what was written
  uint64_t file_bytes() const { return total_; }
  void commit();
  void abandon();

 private:
  void pwrite_all(const void* p, size_t n, uint64_t off);
  std::string path_, partial_;
  Dsv4State plan_;
  std::map<std::pair<uint32_t, Dsv4SectionKind>, Dsv4Section> index_;
  uint64_t total_ = 0;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace pdb
