// The CPU engine's weights from an HF checkpoint (safetensors): f32/f16/bf16 as f32, block FP8 dequantized with its
// scales.
#include <memory>
#include <stdexcept>

#include <fmt/format.h>

#include "formats/ggml_types.h"
#include "formats/safetensors.h"
#include "formats/weight_source.h"

namespace pdb {
namespace {

class CheckpointWeights final : public WeightSource {
 public:
  CheckpointWeights(const std::string& dir, const HfConfig& c) : ck_(SafetensorsCheckpoint::open(dir)), c_(c), dir_(dir) {}
  std::vector<float> matrix(const std::string& name, int64_t rows, int64_t cols) const override {
    const StTensor& t = ck_->get(name);
    if (t.shape.size() != 2 || t.shape[0] != rows || t.shape[1] != cols)
      throw std::runtime_error(fmt::format("{}: shape does not match config.json ({} x {})", name, rows, cols));
    if (t.dtype == StDtype::F8_E4M3) {
      const std::string sname = name.substr(0, name.size() - 6) + "weight_scale_inv";
      if (!ck_->find(sname)) throw std::runtime_error(name + " is FP8 but " + sname + " is missing");
      auto s = ck_->to_f32(sname);
      const int64_t sr = (rows + c_.fp8_block_rows - 1) / c_.fp8_block_rows, sc = (cols + c_.fp8_block_cols - 1) / c_.fp8_block_cols;
      if (int64_t(s.size()) != sr * sc) throw std::runtime_error(sname + " has the wrong shape for the block size");
      std::vector<float> w(static_cast<size_t>(rows * cols));
      dequantize_block_fp8(t.data, rows, cols, s.data(), c_.fp8_block_rows, c_.fp8_block_cols, w.data());
      return w;
    }
    return ck_->to_f32(name);
  }
  std::vector<float> vector(const std::string& name, int64_t n) const override {
    auto v = ck_->to_f32(name);
    if (int64_t(v.size()) != n) throw std::runtime_error(fmt::format("{}: {} elements, expected {}", name, v.size(), n));
    return v;
  }
  int weight_bits(const std::string& name) const override {
    const StDtype t = ck_->get(name).dtype;
    return t == StDtype::F16 ? 16 : t == StDtype::BF16 ? 17 : 32;
  }
  std::string describe() const override { return "HF checkpoint " + dir_; }

 private:
  std::unique_ptr<SafetensorsCheckpoint> ck_;
  HfConfig c_;
  std::string dir_;
};

}  // namespace

std::unique_ptr<WeightSource> checkpoint_weights(const std::string& hf_dir, const HfConfig& c) {
  return std::make_unique<CheckpointWeights>(hf_dir, c);
}

}  // namespace pdb
