// safetensors (single file or sharded with model.safetensors.index.json): mmap reader and writer.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace pdb {

enum class StDtype { F32, F16, BF16, F8_E4M3, F8_E8M0, I8, U8, I32, I64, F64 };
const char* st_dtype_name(StDtype d);
size_t st_dtype_size(StDtype d);

struct StTensor {
  std::string name;
  StDtype dtype = StDtype::F32;
  std::vector<int64_t> shape;  // numpy order: shape[0] is the slowest dimension
  const uint8_t* data = nullptr;
  size_t n_bytes = 0;
  int64_t n_elements() const;
};

class SafetensorsFile {
 public:
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
  const std::map<std::string, StTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  ~SafetensorsFile();

 private:
  SafetensorsFile() = default;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, StTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint directory: model.safetensors, or shards listed by model.safetensors.index.json.
class SafetensorsCheckpoint {
 public:
  static std::unique_ptr<SafetensorsCheckpoint> open(const std::string& dir);
  const StTensor* find(const std::string& name) const;
  const StTensor& get(const std::string& name) const;  // throws if missing
  std::vector<std::string> names() const;
  // Tensor as f32 (F32/F16/BF16/F8_E4M3 element-wise; no block scales applied).
  std::vector<float> to_f32(const std::string& name) const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const StTensor*> index_;
};

// Streams tensors into a safetensors file; `max_shard_bytes` > 0 splits into shards and writes the index.
class SafetensorsWriter {
 public:
  using Producer = std::function<void(uint8_t* dst, size_t n_bytes)>;
  void add(const std::string& name, StDtype dtype, std::vector<int64_t> shape, Producer produce);
  void add_bytes(const std::string& name, StDtype dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes);
  // Writes dir/model.safetensors, or dir/model-0000K-of-0000N.safetensors + index when sharded.
  void write(const std::string& dir, size_t max_shard_bytes = 0, int threads = 1) const;

 private:
  struct Pending { std::string name; StDtype dtype; std::vector<int64_t> shape; size_t n_bytes; Producer produce; };
  std::vector<Pending> tensors_;
};

}  // namespace pdb
