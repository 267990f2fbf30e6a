// Where an engine's weights come from, by their HF names (the blocks' weight map): an HF checkpoint
// (formats/checkpoint_weights.cpp: block FP8 dequantized with its scales) or the decoder's GGUF
// (formats/gguf_weights.cpp: every weight type dequantized bit for bit as ggml does, llama's Q/K rows back in HF's
// order, the config read from its keys). Shapes are checked.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/ggml_types.h"
#include "formats/hf_config.h"

namespace pdb {

class GgufFile;

// A weight's rows as the source stores them (quantized rows of ggml blocks), in HF's row order.
struct RawRows {
  GgmlType type = GgmlType::F32;
  std::vector<uint8_t> bytes;
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The rows without decoding (for an engine that keeps quantized weights quantized); nullopt where the source has no
  // such form (a checkpoint; deepseek2's kv_b_proj, rebuilt from two GGUF tensors).
  virtual std::optional<RawRows> raw_rows(const std::string& /*name*/, int64_t /*rows*/, int64_t /*cols*/) const { return std::nullopt; }
  virtual std::vector<float> matrix(const std::string& name, int64_t rows, int64_t cols) const = 0;
  virtual std::vector<float> vector(const std::string& name, int64_t n) const = 0;
  // 16 / 17 / 32: the float type the decoder multiplies this weight in (f16, bf16; 32 for f32 and quantized types).
  virtual int weight_bits(const std::string& name) const = 0;
  // The type the weight is stored in (F32 for a checkpoint's: its products are float products).
  virtual GgmlType storage_type(const std::string& /*name*/) const { return GgmlType::F32; }
  virtual std::string describe() const = 0;
  // The weights' storage types ("q4_K x 145, q6_K x 25"; "" where there is one dtype to tell).
  virtual std::string type_summary() const { return ""; }
};

std::unique_ptr<WeightSource> checkpoint_weights(const std::string& hf_dir, const HfConfig& c);

// A GGUF as a model: the HfConfig its keys give (llama, qwen3, qwen3moe, deepseek2) and its weights.
struct GgufModel {
  HfConfig config;
  std::unique_ptr<WeightSource> weights;
};
GgufModel gguf_weights(const std::string& path);
bool is_gguf_path(const std::string& path);
// Where two GGUFs hold different weights ("" for none): a tensor missing from one, or another type, shape or content
// (xxh3 of its bytes), at most `max` of them. The same file is not read.
std::vector<std::string> gguf_weight_differences(const GgufFile& a, const GgufFile& b, size_t max = 3);
// The config of a model path: an HF checkpoint's config.json, or a GGUF's keys.
HfConfig model_config(const std::string& model);
// The HfConfig of a decoder GGUF's keys; throws naming what it cannot express yet (llama3/linear RoPE scaling, deepseek4).
HfConfig hf_config_from_gguf(const GgufFile& g);

}  // namespace pdb
