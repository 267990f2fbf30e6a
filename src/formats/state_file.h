// llama.cpp sequence-state files (what `POST /slots/{id}?action=save` writes and `restore` reads):
// llama_state_seq_save_file + llama_kv_cache::state_write for one sequence. This file is the single
// owner of that format in pdbridge: the parser, the layout arithmetic and the offset-exact writer.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/ggml_types.h"

namespace pdb {

constexpr uint32_t kStateMagic = 0x67677371;  // 'ggsq'
// LLAMA_STATE_SEQ_VERSION: 2 until llama.cpp's August 2026 releases (node-llama-cpp 3.19.1's bundle: the server
// stores a plain token list), 3 since (3.21.1, 3.22.1: the server stores [-1, 1, n, tokens..., 0 media] and still
// reads plain lists). The rows after the tokens are the same in both. A file is written in the version the running
// decoder wrote its own probe in; any other version is refused by name.
constexpr uint32_t kStateVersion = 3;
constexpr uint32_t kStateVersionMin = 2;
bool state_version_known(uint32_t version);
std::string state_version_note(uint32_t version);  // why a version is refused, naming the ones read

struct StateLayerTypes {
  GgmlType k_type = GgmlType::F16;
  uint64_t k_row_bytes = 0;
  GgmlType v_type = GgmlType::F16;
  // non-transposed V; for v_trans this is elem_bytes * n_embd_v. 0: the layer has no V section at all,
  // not even a header (MLA: deepseek2 caches one K row, and V is a view of it).
  uint64_t v_row_bytes = 0;
  uint32_t n_embd_k = 0, n_embd_v = 0;  // elements per row
  bool has_v() const { return v_row_bytes != 0; }
};

// One section of a decoder's state: rows of one kind for one layer, as the file holds them. The
// contract between recipe, wire and assembler is "rows of a section": a frame names its section and
// its first row, the layout says where a row sits. In llama.cpp's plain KV cache every section has
// one row per token (cell); a pooled cache (DeepSeek-V4) will add sections with other row counts.
enum class SectionKind : uint8_t { K = 0, V = 1 };
struct StateSection {
  uint32_t layer = 0;
  SectionKind kind = SectionKind::K;
  GgmlType type = GgmlType::F16;
  uint64_t row_bytes = 0;
  uint32_t n_embd = 0;
  bool transposed = false;  // V of a v_trans file: element-major
  uint64_t rows_for(uint64_t n_tokens) const { return n_tokens; }
};

// Everything the decoder's reader checks, learned from a file the running decoder wrote itself.
struct StateLayout {
  uint32_t file_version = kStateVersion;  // the llama.cpp state version the decoder writes and reads
  uint32_t n_stream = 1;
  uint32_t stream = 0;  // the stream that holds the cells (the slot's own)
  bool v_trans = false;
  std::vector<StateLayerTypes> layers;
  uint32_t n_layer() const { return uint32_t(layers.size()); }
  bool has_v() const { return !layers.empty() && layers[0].has_v(); }
  // Every section in file order (all K sections, then all V sections where there are any).
  std::vector<StateSection> sections() const;
  uint64_t kv_bytes_per_cell() const;
  std::string describe() const;
};

struct ParsedState {
  std::vector<int32_t> tokens;
  bool packed_tokens = false;  // server's packed form (starts with -1)
  StateLayout layout;
  uint32_t cell_count = 0;
  std::vector<int32_t> positions;
  // K row r of layer l: k_data[l] + r * k_row_bytes. V: row-major when !v_trans, else element-major;
  // v_data is empty when the layout has no V sections.
  std::vector<const uint8_t*> k_data, v_data;
  std::vector<uint8_t> storage;  // owns the bytes (the file)
  std::shared_ptr<const void> mapping;  // or: the file mapped read-only (parse_state_file_mapped)
};

// Parses a state file; throws std::runtime_error naming what is wrong. Requires at most one
// non-empty stream (a single sequence) and the plain per-cell metadata (no cell extensions).
ParsedState parse_state_file(const std::string& path);
ParsedState parse_state_bytes(std::vector<uint8_t> bytes, const std::string& name);
// The same on the file mapped read-only: its rows are paged in as they are read, not copied into memory (a
// slot's state of many GB, of which the front door copies a prefix into a new file).
ParsedState parse_state_file_mapped(const std::string& path);

// The server's token encoding: [-1, version 1, n, tokens..., 0 media] (plain lists are also accepted).
std::vector<int32_t> decode_state_tokens(const std::vector<int32_t>& raw, bool* packed);

// Offsets of a state file with n cells for a given layout, so rows can be written in any order
// straight to their final place.
class StateFileGeometry {
 public:
  StateFileGeometry(const StateLayout& layout, size_t n_tokens, uint32_t n_cells);
  uint64_t total_bytes() const { return total_; }
  uint64_t meta_offset() const { return meta_; }
  uint64_t k_row_offset(uint32_t layer, uint32_t cell) const;
  uint64_t v_row_offset(uint32_t layer, uint32_t cell) const;  // !v_trans only
  uint64_t v_elem_offset(uint32_t layer, uint32_t cell, uint32_t j) const;  // v_trans only
  const StateLayout& layout() const { return layout_; }
  uint32_t n_cells() const { return n_cells_; }

 private:
  StateLayout layout_;
  uint32_t n_cells_;
  uint64_t meta_ = 0, total_ = 0;
  std::vector<uint64_t> k_base_, v_base_;
};

// Writes <dir>/<name>.partial at computed offsets; commit() renames it to <dir>/<name>.
// Destroying an uncommitted writer deletes the partial file, so a failed bridge leaves no garbage.
// Rows go through a shared writable mapping of the file when its filesystem has room for it twice over: Linux
// takes a file's inode lock for every buffered pwrite, so threads writing one file (a tail's prefix copied by
// layers beside the frames arriving) ran one at a time (1.4 GB/s on the H200 box's tmpfs), while page faults
// into a mapping run in parallel. Room is checked first because a mapped write past a full filesystem is a
// SIGBUS where pwrite returns ENOSPC; without it (or with WriteMode::Pwrite) rows are pwritten.
class StateFileWriter {
 public:
  enum class WriteMode { Auto, Pwrite };
  StateFileWriter(const std::string& path, const StateLayout& layout, const std::vector<int32_t>& tokens, uint32_t n_cells,
                  WriteMode mode = WriteMode::Auto);
  ~StateFileWriter();
  StateFileWriter(const StateFileWriter&) = delete;
  StateFileWriter& operator=(const StateFileWriter&) = delete;

  const StateFileGeometry& geometry() const { return geo_; }
  // `rows` consecutive cells starting at `cell`, each `row_bytes` (K, or non-transposed V).
  void write_k_rows(uint32_t layer, uint32_t cell, uint32_t rows, const uint8_t* data);
  void write_v_rows(uint32_t layer, uint32_t cell, uint32_t rows, const uint8_t* data);
  // Reads rows back (for compaction into a shorter file when a capture was sealed early).
  void read_k_rows(uint32_t layer, uint32_t cell, uint32_t rows, uint8_t* out) const;
  void read_v_rows(uint32_t layer, uint32_t cell, uint32_t rows, uint8_t* out) const;
  void commit();  // fsync-free rename: the decoder reads it right after, on the same host
  void abandon();
  const std::string& path() const { return path_; }
  uint64_t bytes_written() const { return bytes_.load(); }
  bool mapped() const { return map_ != nullptr; }

 private:
  void pwrite_all(const void* p, size_t n, uint64_t off);
  void pread_all(void* p, size_t n, uint64_t off) const;
  std::string path_, partial_;
  StateFileGeometry geo_;
  int fd_ = -1;
  uint8_t* map_ = nullptr;  // the whole file, when mapped
  void unmap();
  bool committed_ = false;
  std::atomic<uint64_t> bytes_{0};  // rows may be written from two threads (a tail's copied prefix beside the frames)
};

}  // namespace pdb
