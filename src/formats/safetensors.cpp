#include "formats/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "formats/numeric.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
struct DtypeInfo { StDtype d; const char* name; size_t size; };
constexpr DtypeInfo kDtypes[] = {
    {StDtype::F32, "F32", 4}, {StDtype::F16, "F16", 2}, {StDtype::BF16, "BF16", 2}, {StDtype::F8_E4M3, "F8_E4M3", 1},
    {StDtype::F8_E8M0, "F8_E8M0", 1}, {StDtype::I8, "I8", 1}, {StDtype::U8, "U8", 1}, {StDtype::I32, "I32", 4},
    {StDtype::I64, "I64", 8}, {StDtype::F64, "F64", 8},
};
[[noreturn]] void fail(const std::string& path, const std::string& why) {
  throw std::runtime_error(fmt::format("safetensors {}: {}", path, why));
}
}  // namespace

const char* st_dtype_name(StDtype d) { for (auto& e : kDtypes) if (e.d == d) return e.name; return "?"; }
size_t st_dtype_size(StDtype d) { for (auto& e : kDtypes) if (e.d == d) return e.size; return 0; }

int64_t StTensor::n_elements() const { int64_t n = 1; for (auto s : shape) n *= s; return n; }

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail(path, fmt::format("cannot open: {}", std::strerror(errno)));
  struct stat st{};
  fstat(fd, &st);
  f->map_size_ = size_t(st.st_size);
  if (f->map_size_ < 8) { ::close(fd); fail(path, "file too small"); }
  f->map_ = mmap(nullptr, f->map_size_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (f->map_ == MAP_FAILED) { f->map_ = nullptr; fail(path, "mmap failed"); }
  const auto* base = static_cast<const uint8_t*>(f->map_);
  uint64_t hlen;
  std::memcpy(&hlen, base, 8);
  if (hlen > f->map_size_ - 8 || hlen > (100u << 20)) fail(path, fmt::format("header length {} exceeds the file", hlen));
  json header;
  try {
    header = json::parse(base + 8, base + 8 + hlen);
  } catch (const std::exception& e) {
    fail(path, fmt::format("header is not JSON: {}", e.what()));
  }
  if (!header.is_object()) fail(path, "header is not a JSON object");
  const uint8_t* data = base + 8 + hlen;
  const size_t data_size = f->map_size_ - 8 - hlen;
  std::vector<std::pair<size_t, size_t>> spans;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path, "__metadata__ is not an object");
      for (auto& [k, s] : v.items()) {
        if (!s.is_string()) fail(path, fmt::format("__metadata__.{} is not a string", k));
        f->metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      fail(path, fmt::format("tensor '{}' lacks dtype/shape/data_offsets", name));
    StTensor t;
    t.name = name;
    const std::string dt = v["dtype"].get<std::string>();
    bool known = false;
    for (auto& e : kDtypes) if (dt == e.name) { t.dtype = e.d; known = true; }
    if (!known) fail(path, fmt::format("tensor '{}' has unsupported dtype {}", name, dt));
    for (auto& s : v["shape"]) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0) fail(path, fmt::format("tensor '{}' has a bad shape", name));
      t.shape.push_back(s.get<int64_t>());
    }
    auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2) fail(path, fmt::format("tensor '{}' data_offsets must be [begin, end]", name));
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_size) fail(path, fmt::format("tensor '{}' span [{}, {}) is outside the data ({} bytes)", name, b, e, data_size));
    if (e - b != size_t(t.n_elements()) * st_dtype_size(t.dtype))
      fail(path, fmt::format("tensor '{}' has {} bytes for {} {} elements", name, e - b, t.n_elements(), dt));
    t.data = data + b;
    t.n_bytes = e - b;
    spans.emplace_back(b, e);
    f->tensors_[name] = std::move(t);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) fail(path, "tensor data spans overlap");
  return f;
}

SafetensorsFile::~SafetensorsFile() { if (map_) munmap(map_, map_size_); }

std::unique_ptr<SafetensorsCheckpoint> SafetensorsCheckpoint::open(const std::string& dir) {
  auto ck = std::make_unique<SafetensorsCheckpoint>();
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> shards;
  if (fs::exists(index)) {
    json j;
    try { std::ifstream in(index); j = json::parse(in); } catch (const std::exception& e) { fail(index, e.what()); }
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) fail(index, "no weight_map");
    std::map<std::string, std::string> wm;
    for (auto& [k, v] : j["weight_map"].items()) { wm[k] = v.get<std::string>(); }
    std::set<std::string> uniq;
    for (auto& [k, v] : wm) {
      if (v.find('/') != std::string::npos || v.find("..") != std::string::npos) fail(index, "shard name with a path: " + v);
      uniq.insert(v);
    }
    shards.assign(uniq.begin(), uniq.end());
    for (const auto& s : shards) ck->files_.push_back(SafetensorsFile::open((fs::path(dir) / s).string()));
    for (size_t i = 0; i < shards.size(); ++i)
      for (auto& [name, t] : ck->files_[i]->tensors()) ck->index_[name] = &t;
    for (auto& [k, v] : wm)
      if (!ck->index_.count(k)) fail(index, fmt::format("weight_map lists '{}' in {}, which does not hold it", k, v));
  } else {
    const fs::path single = fs::path(dir) / "model.safetensors";
    if (!fs::exists(single)) fail(dir, "neither model.safetensors nor model.safetensors.index.json exists");
    ck->files_.push_back(SafetensorsFile::open(single.string()));
    for (auto& [name, t] : ck->files_[0]->tensors()) ck->index_[name] = &t;
  }
  return ck;
}

const StTensor* SafetensorsCheckpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}
const StTensor& SafetensorsCheckpoint::get(const std::string& name) const {
  const StTensor* t = find(name);
  if (!t) throw std::runtime_error("checkpoint has no tensor " + name);
  return *t;
}
std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> n;
  for (auto& [k, v] : index_) n.push_back(k);
  return n;
}
std::vector<float> SafetensorsCheckpoint::to_f32(const std::string& name) const {
  const StTensor& t = get(name);
  std::vector<float> out(static_cast<size_t>(t.n_elements()));
  const uint8_t* p = t.data;
  const size_t n = out.size();
  switch (t.dtype) {
    case StDtype::F32: std::memcpy(out.data(), p, n * 4); break;
    case StDtype::F16: for (size_t i = 0; i < n; ++i) { uint16_t h; std::memcpy(&h, p + 2 * i, 2); out[i] = fp16_to_f32(h); } break;
    case StDtype::BF16: for (size_t i = 0; i < n; ++i) { uint16_t h; std::memcpy(&h, p + 2 * i, 2); out[i] = bf16_to_f32(h); } break;
    case StDtype::F8_E4M3: for (size_t i = 0; i < n; ++i) out[i] = fp8_e4m3_to_f32(p[i]); break;
    case StDtype::F8_E8M0: for (size_t i = 0; i < n; ++i) out[i] = e8m0_to_f32(p[i]); break;
    default: throw std::runtime_error(fmt::format("tensor {}: dtype {} is not a float type", name, st_dtype_name(t.dtype)));
  }
  return out;
}

void SafetensorsWriter::add(const std::string& name, StDtype dtype, std::vector<int64_t> shape, Producer produce) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  tensors_.push_back({name, dtype, std::move(shape), size_t(n) * st_dtype_size(dtype), std::move(produce)});
}

void SafetensorsWriter::add_bytes(const std::string& name, StDtype dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
  auto shared = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  add(name, dtype, std::move(shape), [shared](uint8_t* dst, size_t n) {
    if (n != shared->size()) throw std::invalid_argument("safetensors: byte count mismatch");
    std::memcpy(dst, shared->data(), n);
  });
}

void SafetensorsWriter::write(const std::string& dir, size_t max_shard_bytes, int threads) const {
  fs::create_directories(dir);
  std::vector<std::vector<size_t>> shards(1);
  size_t cur = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (max_shard_bytes && cur > 0 && cur + tensors_[i].n_bytes > max_shard_bytes) { shards.emplace_back(); cur = 0; }
    shards.back().push_back(i);
    cur += tensors_[i].n_bytes;
  }
  const bool sharded = max_shard_bytes && shards.size() > 1;
  json weight_map = json::object();
  size_t total = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string fname = sharded ? fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size()) : "model.safetensors";
    json header = json::object();
    header["__metadata__"] = {{"format", "pt"}};
    size_t off = 0;
    for (size_t i : shards[s]) {
      const auto& t = tensors_[i];
      header[t.name] = {{"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + t.n_bytes}}};
      off += t.n_bytes;
      weight_map[t.name] = fname;
    }
    total += off;
    std::string h = header.dump();
    while ((8 + h.size()) % 8) h.push_back(' ');  // keep data 8-byte aligned, as the reference writer does
    const fs::path path = fs::path(dir) / fname, tmp = path.string() + ".tmp";
    {
      std::FILE* f = std::fopen(tmp.c_str(), "wb");
      if (!f) throw std::runtime_error(fmt::format("cannot create {}: {}", tmp.string(), std::strerror(errno)));
      uint64_t hl = h.size();
      bool ok = std::fwrite(&hl, 8, 1, f) == 1 && std::fwrite(h.data(), 1, h.size(), f) == h.size();
      // Produce tensors in parallel in bounded groups, write in order.
      const std::vector<size_t>& ids = shards[s];
      for (size_t g = 0; ok && g < ids.size(); g += size_t(std::max(1, threads))) {
        const size_t ge = std::min(ids.size(), g + size_t(std::max(1, threads)));
        std::vector<std::vector<uint8_t>> bufs(ge - g);
        std::vector<std::thread> ws;
        std::exception_ptr err;
        std::mutex m;
        for (size_t k = g; k < ge; ++k)
          ws.emplace_back([&, k] {
            try { bufs[k - g].resize(tensors_[ids[k]].n_bytes); tensors_[ids[k]].produce(bufs[k - g].data(), bufs[k - g].size()); }
            catch (...) { std::lock_guard<std::mutex> l(m); err = std::current_exception(); }
          });
        for (auto& w : ws) w.join();
        if (err) { std::fclose(f); fs::remove(tmp); std::rethrow_exception(err); }
        for (auto& b : bufs) ok = ok && std::fwrite(b.data(), 1, b.size(), f) == b.size();
      }
      ok = (std::fclose(f) == 0) && ok;
      if (!ok) { fs::remove(tmp); throw std::runtime_error("write failed for " + path.string() + " (disk full?)"); }
      fs::rename(tmp, path);
    }
  }
  if (sharded) {
    json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream(fs::path(dir) / "model.safetensors.index.json") << idx.dump(2) << "\n";
  }
}

}  // namespace pdb
