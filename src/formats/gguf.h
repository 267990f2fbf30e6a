// GGUF v3 (ggml docs/gguf.md): an mmap'ed strict reader and a streaming writer.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "formats/ggml_types.h"

namespace pdb {

enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7, STRING = 8, ARRAY = 9,
  U64 = 10, I64 = 11, F64 = 12,
};
const char* gguf_type_name(GgufType t);

// One metadata value. Integers keep their exact GGUF type so a file round-trips unchanged.
struct GgufValue {
  GgufType type = GgufType::U32;
  uint64_t u = 0;      // unsigned integers and bool
  int64_t i = 0;       // signed integers
  double f = 0;        // f32 / f64
  std::string s;       // string
  GgufType arr_type = GgufType::U8;
  std::vector<GgufValue> arr;

  static GgufValue of_u32(uint32_t v) { GgufValue x; x.type = GgufType::U32; x.u = v; return x; }
  static GgufValue of_i32(int32_t v) { GgufValue x; x.type = GgufType::I32; x.i = v; return x; }
  static GgufValue of_u64(uint64_t v) { GgufValue x; x.type = GgufType::U64; x.u = v; return x; }
  static GgufValue of_f32(float v) { GgufValue x; x.type = GgufType::F32; x.f = v; return x; }
  static GgufValue of_bool(bool v) { GgufValue x; x.type = GgufType::BOOL; x.u = v; return x; }
  static GgufValue of_str(std::string v) { GgufValue x; x.type = GgufType::STRING; x.s = std::move(v); return x; }
  static GgufValue of_array(GgufType elem, std::vector<GgufValue> v) {
    GgufValue x; x.type = GgufType::ARRAY; x.arr_type = elem; x.arr = std::move(v); return x;
  }

  bool is_integer() const;
  int64_t as_int() const;     // any integer type (throws otherwise)
  double as_float() const;    // any numeric type
  bool operator==(const GgufValue& o) const;
};

struct GgufTensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> ne;  // ne[0] is the fastest dimension
  uint64_t offset = 0;      // from the start of the data section
  int64_t n_elements() const;
  size_t n_bytes() const;
  int64_t rows() const { return ne.empty() || ne[0] == 0 ? 0 : n_elements() / ne[0]; }
};

class GgufFile {
 public:
  static std::unique_ptr<GgufFile> open(const std::string& path);  // throws std::runtime_error with reason
  static std::unique_ptr<GgufFile> from_bytes(std::vector<uint8_t> bytes, const std::string& name = "<memory>");

  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  const std::vector<std::pair<std::string, GgufValue>>& kv() const { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }

  const GgufValue* find(const std::string& key) const;
  const GgufValue& get(const std::string& key) const;  // throws if missing
  int64_t get_int(const std::string& key) const;
  std::optional<int64_t> get_int_opt(const std::string& key) const;
  double get_float(const std::string& key) const;
  std::optional<double> get_float_opt(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  std::string architecture() const { return get_string("general.architecture"); }

  const GgufTensorInfo* find_tensor(const std::string& name) const;
  const GgufTensorInfo& tensor(const std::string& name) const;  // throws if missing
  const uint8_t* data(const GgufTensorInfo& t) const { return data_ + t.offset; }
  // Whole tensor as f32 (dequantized), shape preserved in row-major ne order.
  std::vector<float> to_f32(const GgufTensorInfo& t) const;

  ~GgufFile();

 private:
  GgufFile() = default;
  void parse();
  std::vector<uint8_t> owned_;
  bool mapped_ = false;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  const uint8_t* data_ = nullptr;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::map<std::string, size_t> kv_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// Writes a GGUF in one pass. Tensor bytes are produced by callbacks at write time, so multi-GB
// models stream to disk without being held in memory.
class GgufWriter {
 public:
  using Producer = std::function<void(uint8_t* dst, size_t n_bytes)>;
  void set(const std::string& key, GgufValue v);
  void add_tensor(const std::string& name, GgmlType type, std::vector<int64_t> ne, Producer produce);
  void add_tensor_bytes(const std::string& name, GgmlType type, std::vector<int64_t> ne, std::vector<uint8_t> bytes);
  void write(const std::string& path, size_t alignment = 32) const;  // writes to path.tmp, then renames

 private:
  std::vector<std::pair<std::string, GgufValue>> kv_;
  struct Pending { GgufTensorInfo info; Producer produce; };
  std::vector<Pending> tensors_;
};

}  // namespace pdb
