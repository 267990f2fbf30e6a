#include "formats/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

namespace pdb {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF"
constexpr uint64_t kMaxStringLen = 1ull << 30;
constexpr uint64_t kMaxArrayLen = 1ull << 32;
constexpr int kMaxNestedArrays = 4;

[[noreturn]] void fail(const std::string& path, const std::string& why) {
  throw std::runtime_error(fmt::format("GGUF {}: {}", path, why));
}

// Bounds-checked little-endian reader over the mapped file.
struct Cursor {
  const uint8_t* base;
  size_t size;
  size_t pos = 0;
  const std::string& path;

  void need(size_t n, const char* what) {
    if (n > size - pos) fail(path, fmt::format("truncated while reading {} at offset {}", what, pos));
  }
  template <class T> T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string str(const char* what) {
    const uint64_t n = read<uint64_t>(what);
    if (n > kMaxStringLen) fail(path, fmt::format("{} length {} is implausible", what, n));
    need(n, what);
    std::string s(reinterpret_cast<const char*>(base + pos), n);
    pos += n;
    return s;
  }
};

bool valid_type(uint32_t t) { return t <= 12; }

GgufValue read_value(Cursor& c, GgufType type, int depth) {
  GgufValue v;
  v.type = type;
  switch (type) {
    case GgufType::U8: v.u = c.read<uint8_t>("u8"); break;
    case GgufType::I8: v.i = c.read<int8_t>("i8"); break;
    case GgufType::U16: v.u = c.read<uint16_t>("u16"); break;
    case GgufType::I16: v.i = c.read<int16_t>("i16"); break;
    case GgufType::U32: v.u = c.read<uint32_t>("u32"); break;
    case GgufType::I32: v.i = c.read<int32_t>("i32"); break;
    case GgufType::F32: v.f = c.read<float>("f32"); break;
    case GgufType::BOOL: {
      const uint8_t b = c.read<uint8_t>("bool");
      if (b > 1) fail(c.path, fmt::format("bool value {} at offset {}", b, c.pos - 1));
      v.u = b;
      break;
    }
    case GgufType::STRING: v.s = c.str("string"); break;
    case GgufType::U64: v.u = c.read<uint64_t>("u64"); break;
    case GgufType::I64: v.i = c.read<int64_t>("i64"); break;
    case GgufType::F64: v.f = c.read<double>("f64"); break;
    case GgufType::ARRAY: {
      if (depth >= kMaxNestedArrays) fail(c.path, "arrays nested too deeply");
      const uint32_t et = c.read<uint32_t>("array type");
      if (!valid_type(et)) fail(c.path, fmt::format("unknown array element type {}", et));
      const uint64_t n = c.read<uint64_t>("array length");
      if (n > kMaxArrayLen || n > c.size - c.pos) fail(c.path, fmt::format("array length {} exceeds the file", n));
      v.arr_type = GgufType(et);
      v.arr.reserve(n);
      for (uint64_t k = 0; k < n; ++k) v.arr.push_back(read_value(c, v.arr_type, depth + 1));
      break;
    }
  }
  return v;
}

void write_value(std::FILE* f, const GgufValue& v, bool with_type);

void put(std::FILE* f, const void* p, size_t n) {
  if (n && std::fwrite(p, 1, n, f) != n) throw std::runtime_error("GGUF write failed (disk full?)");
}
template <class T> void put(std::FILE* f, T v) { put(f, &v, sizeof(T)); }
void put_str(std::FILE* f, const std::string& s) { put<uint64_t>(f, s.size()); put(f, s.data(), s.size()); }

void write_value(std::FILE* f, const GgufValue& v, bool with_type) {
  if (with_type) put<uint32_t>(f, uint32_t(v.type));
  switch (v.type) {
    case GgufType::U8: put<uint8_t>(f, uint8_t(v.u)); break;
    case GgufType::I8: put<int8_t>(f, int8_t(v.i)); break;
    case GgufType::U16: put<uint16_t>(f, uint16_t(v.u)); break;
    case GgufType::I16: put<int16_t>(f, int16_t(v.i)); break;
    case GgufType::U32: put<uint32_t>(f, uint32_t(v.u)); break;
    case GgufType::I32: put<int32_t>(f, int32_t(v.i)); break;
    case GgufType::F32: put<float>(f, float(v.f)); break;
    case GgufType::BOOL: put<uint8_t>(f, uint8_t(v.u ? 1 : 0)); break;
    case GgufType::STRING: put_str(f, v.s); break;
    case GgufType::U64: put<uint64_t>(f, v.u); break;
    case GgufType::I64: put<int64_t>(f, v.i); break;
    case GgufType::F64: put<double>(f, v.f); break;
    case GgufType::ARRAY:
      put<uint32_t>(f, uint32_t(v.arr_type));
      put<uint64_t>(f, v.arr.size());
      for (const auto& e : v.arr) {
        if (e.type != v.arr_type) throw std::invalid_argument("GGUF array with mixed element types");
        write_value(f, e, false);
      }
      break;
  }
}

size_t pad_to(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace

const char* gguf_type_name(GgufType t) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"};
  return uint32_t(t) <= 12 ? names[uint32_t(t)] : "?";
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16: case GgufType::U32:
    case GgufType::I32: case GgufType::U64: case GgufType::I64: return true;
    default: return false;
  }
}

int64_t GgufValue::as_int() const {
  switch (type) {
    case GgufType::U8: case GgufType::U16: case GgufType::U32: case GgufType::U64: case GgufType::BOOL:
      return int64_t(u);
    case GgufType::I8: case GgufType::I16: case GgufType::I32: case GgufType::I64: return i;
    default: throw std::invalid_argument(fmt::format("GGUF value of type {} is not an integer", gguf_type_name(type)));
  }
}

double GgufValue::as_float() const {
  if (type == GgufType::F32 || type == GgufType::F64) return f;
  return double(as_int());
}

bool GgufValue::operator==(const GgufValue& o) const {
  if (type != o.type) return false;
  switch (type) {
    case GgufType::STRING: return s == o.s;
    case GgufType::ARRAY: return arr_type == o.arr_type && arr == o.arr;
    case GgufType::F32: return float(f) == float(o.f) || (f != f && o.f != o.f);
    case GgufType::F64: return f == o.f || (f != f && o.f != o.f);
    default: return as_int() == o.as_int();
  }
}

int64_t GgufTensorInfo::n_elements() const {
  int64_t n = 1;
  for (auto d : ne) n *= d;
  return n;
}

size_t GgufTensorInfo::n_bytes() const {
  const size_t rb = ggml_row_bytes(type, ne.empty() ? 1 : ne[0]);
  const size_t r = size_t(rows());
  if (r && rb > SIZE_MAX / r) throw std::runtime_error("tensor " + name + " is too large");
  return rb * r;
}

std::unique_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::unique_ptr<GgufFile> g(new GgufFile());
  g->path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail(path, fmt::format("cannot open: {}", std::strerror(errno)));
  struct stat st{};
  if (fstat(fd, &st) != 0) { ::close(fd); fail(path, "cannot stat"); }
  g->map_size_ = size_t(st.st_size);
  if (g->map_size_ < 24) { ::close(fd); fail(path, fmt::format("file of {} bytes is too small to be GGUF", g->map_size_)); }
  g->map_ = mmap(nullptr, g->map_size_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (g->map_ == MAP_FAILED) { g->map_ = nullptr; fail(path, "mmap failed"); }
  g->mapped_ = true;
  g->parse();
  return g;
}

std::unique_ptr<GgufFile> GgufFile::from_bytes(std::vector<uint8_t> bytes, const std::string& name) {
  std::unique_ptr<GgufFile> g(new GgufFile());
  g->path_ = name;
  g->owned_ = std::move(bytes);
  g->map_ = g->owned_.data();
  g->map_size_ = g->owned_.size();
  if (g->map_size_ < 24) fail(name, fmt::format("file of {} bytes is too small to be GGUF", g->map_size_));
  g->parse();
  return g;
}

void GgufFile::parse() {
  GgufFile* g = this;
  const std::string& path = path_;
  Cursor c{static_cast<const uint8_t*>(g->map_), g->map_size_, 0, g->path_};
  const uint32_t magic = c.read<uint32_t>("magic");
  if (magic != kGgufMagic) fail(path, fmt::format("bad magic 0x{:08x} (not a GGUF file)", magic));
  g->version_ = c.read<uint32_t>("version");
  if (g->version_ < 2 || g->version_ > 3) fail(path, fmt::format("unsupported GGUF version {}", g->version_));
  const int64_t n_tensors = c.read<int64_t>("tensor count");
  const int64_t n_kv = c.read<int64_t>("kv count");
  if (n_tensors < 0 || uint64_t(n_tensors) > g->map_size_ / 24) fail(path, fmt::format("tensor count {} is implausible", n_tensors));
  if (n_kv < 0 || uint64_t(n_kv) > g->map_size_ / 12) fail(path, fmt::format("kv count {} is implausible", n_kv));

  for (int64_t k = 0; k < n_kv; ++k) {
    std::string key = c.str("key");
    const uint32_t t = c.read<uint32_t>("value type");
    if (!valid_type(t)) fail(path, fmt::format("key '{}' has unknown value type {}", key, t));
    GgufValue v = read_value(c, GgufType(t), 0);
    if (g->kv_index_.count(key)) fail(path, fmt::format("duplicate key '{}'", key));
    g->kv_index_[key] = g->kv_.size();
    g->kv_.emplace_back(std::move(key), std::move(v));
  }
  if (const GgufValue* a = g->find("general.alignment")) {
    if (a->type != GgufType::U32) fail(path, "general.alignment must be u32");
    if (a->u == 0 || (a->u & (a->u - 1))) fail(path, fmt::format("general.alignment {} is not a power of two", a->u));
    g->alignment_ = a->u;
  }

  for (int64_t k = 0; k < n_tensors; ++k) {
    GgufTensorInfo ti;
    ti.name = c.str("tensor name");
    if (ti.name.size() >= 64) fail(path, fmt::format("tensor name '{}' is longer than 63 bytes", ti.name));
    const uint32_t n_dims = c.read<uint32_t>("n_dims");
    if (n_dims < 1 || n_dims > 4) fail(path, fmt::format("tensor '{}' has {} dimensions", ti.name, n_dims));
    int64_t total = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const int64_t ne = c.read<int64_t>("dimension");
      if (ne < 0 || (ne > 0 && total > INT64_MAX / ne)) fail(path, fmt::format("tensor '{}' has bad dimension {}", ti.name, ne));
      total *= ne;
      ti.ne.push_back(ne);
    }
    const uint32_t type = c.read<uint32_t>("tensor type");
    auto tr = ggml_type_traits(type);
    if (!tr) fail(path, fmt::format("tensor '{}' has unknown ggml type {}", ti.name, type));
    ti.type = GgmlType(type);
    if (ti.ne[0] % tr->block_size != 0)
      fail(path, fmt::format("tensor '{}': ne[0]={} is not a multiple of the {} block size {}", ti.name, ti.ne[0], tr->name, tr->block_size));
    ti.offset = c.read<uint64_t>("tensor offset");
    if (g->tensor_index_.count(ti.name)) fail(path, fmt::format("duplicate tensor '{}'", ti.name));
    g->tensor_index_[ti.name] = g->tensors_.size();
    g->tensors_.push_back(std::move(ti));
  }

  const size_t data_start = pad_to(c.pos, g->alignment_);
  if (data_start > g->map_size_ && n_tensors > 0) fail(path, "truncated before the tensor data");
  g->data_ = static_cast<const uint8_t*>(g->map_) + std::min(data_start, g->map_size_);
  const size_t data_size = g->map_size_ - std::min(data_start, g->map_size_);
  size_t expect = 0;
  for (const auto& t : g->tensors_) {
    if (t.offset % g->alignment_) fail(path, fmt::format("tensor '{}' offset {} is not aligned to {}", t.name, t.offset, g->alignment_));
    if (t.offset != expect) fail(path, fmt::format("tensor '{}' offset {} is not contiguous (expected {})", t.name, t.offset, expect));
    const size_t nb = t.n_bytes();
    if (t.offset > data_size || nb > data_size - t.offset)
      fail(path, fmt::format("tensor '{}' ({} bytes at {}) runs past the end of the file", t.name, nb, t.offset));
    expect = pad_to(t.offset + nb, g->alignment_);
  }
}

GgufFile::~GgufFile() {
  if (map_ && mapped_) munmap(map_, map_size_);
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}
const GgufValue& GgufFile::get(const std::string& key) const {
  const GgufValue* v = find(key);
  if (!v) fail(path_, fmt::format("missing key '{}'", key));
  return *v;
}
int64_t GgufFile::get_int(const std::string& key) const {
  try { return get(key).as_int(); } catch (const std::invalid_argument& e) { fail(path_, fmt::format("key '{}': {}", key, e.what())); }
}
std::optional<int64_t> GgufFile::get_int_opt(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return get_int(key);
}
double GgufFile::get_float(const std::string& key) const {
  try { return get(key).as_float(); } catch (const std::invalid_argument& e) { fail(path_, fmt::format("key '{}': {}", key, e.what())); }
}
std::optional<double> GgufFile::get_float_opt(const std::string& key) const {
  if (!find(key)) return std::nullopt;
  return get_float(key);
}
std::string GgufFile::get_string(const std::string& key) const {
  const GgufValue& v = get(key);
  if (v.type != GgufType::STRING) fail(path_, fmt::format("key '{}' is {}, not a string", key, gguf_type_name(v.type)));
  return v.s;
}
const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}
const GgufTensorInfo& GgufFile::tensor(const std::string& name) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (!t) fail(path_, fmt::format("missing tensor '{}'", name));
  return *t;
}
std::vector<float> GgufFile::to_f32(const GgufTensorInfo& t) const {
  if (!can_dequantize(t.type)) fail(path_, fmt::format("tensor '{}' has type {} which pdbridge cannot decode", t.name, ggml_type_name(t.type)));
  std::vector<float> out(static_cast<size_t>(t.n_elements()));
  const size_t row_bytes = ggml_row_bytes(t.type, t.ne[0]);
  for (int64_t r = 0; r < t.rows(); ++r) dequantize_row(t.type, data(t) + r * row_bytes, out.data() + r * t.ne[0], t.ne[0]);
  return out;
}

void GgufWriter::set(const std::string& key, GgufValue v) {
  for (auto& [k, old] : kv_) if (k == key) { old = std::move(v); return; }
  kv_.emplace_back(key, std::move(v));
}

void GgufWriter::add_tensor(const std::string& name, GgmlType type, std::vector<int64_t> ne, Producer produce) {
  if (name.size() >= 64) throw std::invalid_argument("tensor name too long: " + name);
  for (const auto& p : tensors_) if (p.info.name == name) throw std::invalid_argument("duplicate tensor " + name);
  Pending p;
  p.info.name = name;
  p.info.type = type;
  p.info.ne = std::move(ne);
  (void)p.info.n_bytes();  // validates the block size
  p.produce = std::move(produce);
  tensors_.push_back(std::move(p));
}

void GgufWriter::add_tensor_bytes(const std::string& name, GgmlType type, std::vector<int64_t> ne, std::vector<uint8_t> bytes) {
  auto shared = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  add_tensor(name, type, std::move(ne), [shared, name](uint8_t* dst, size_t n) {
    if (n != shared->size()) throw std::invalid_argument(fmt::format("tensor {}: {} bytes given, {} expected", name, shared->size(), n));
    std::memcpy(dst, shared->data(), n);
  });
}

void GgufWriter::write(const std::string& path, size_t alignment) const {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error(fmt::format("cannot create {}: {}", tmp, std::strerror(errno)));
  try {
    auto kv = kv_;
    bool has_align = false;
    for (auto& [k, v] : kv) if (k == "general.alignment") { v = GgufValue::of_u32(uint32_t(alignment)); has_align = true; }
    if (!has_align && alignment != 32) kv.emplace_back("general.alignment", GgufValue::of_u32(uint32_t(alignment)));
    put<uint32_t>(f, kGgufMagic);
    put<uint32_t>(f, 3);
    put<int64_t>(f, int64_t(tensors_.size()));
    put<int64_t>(f, int64_t(kv.size()));
    for (const auto& [k, v] : kv) { put_str(f, k); write_value(f, v, true); }
    uint64_t offset = 0;
    for (const auto& p : tensors_) {
      put_str(f, p.info.name);
      put<uint32_t>(f, uint32_t(p.info.ne.size()));
      for (auto d : p.info.ne) put<int64_t>(f, d);
      put<uint32_t>(f, uint32_t(p.info.type));
      put<uint64_t>(f, offset);
      offset = pad_to(offset + p.info.n_bytes(), alignment);
    }
    static const uint8_t zeros[256] = {};
    auto pad = [&](size_t at) { size_t n = pad_to(at, alignment) - at; while (n) { size_t k = std::min<size_t>(n, 256); put(f, zeros, k); n -= k; } };
    if (!tensors_.empty()) pad(size_t(std::ftell(f)));  // no data section, no padding (as gguf.cpp)
    std::vector<uint8_t> buf;
    for (const auto& p : tensors_) {
      const size_t nb = p.info.n_bytes();
      buf.assign(nb, 0);
      p.produce(buf.data(), nb);
      put(f, buf.data(), nb);
      pad(nb);
    }
    if (std::fflush(f) != 0 || std::fclose(f) != 0) { f = nullptr; throw std::runtime_error("GGUF flush failed (disk full?)"); }
    f = nullptr;
    std::filesystem::rename(tmp, path);
  } catch (...) {
    if (f) std::fclose(f);
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw;
  }
}

}  // namespace pdb
