// `pdbridge make-model`: one deterministic random master copy of a model's weights, written as the
// HF checkpoint the prefill engine loads and as the decoder's GGUFs (quantized ones by llama-quantize).
#pragma once
#include <string>
#include <vector>

#include "formats/hf_to_gguf.h"

namespace pdb {

struct MakeModelOptions {
  std::string arch = "llama", preset = "tiny", out;
  uint64_t seed = 1;
  std::string hf_dtype = "f32";                   // f32 | f16 | bf16 | fp8
  std::vector<std::string> gguf_types = {"f32"};  // f32 f16 bf16 q8_0 q4_0 (others: any llama-quantize type)
  std::string vocab_dir;                          // llama.cpp models/ (default: next to the executable)
  std::string llama_bin;                          // llama-quantize's directory
  int threads = 0;
  // max_position_embeddings override (0: the preset's). llama-server caps a slot at the model's
  // training context, so scale runs past 128K tokens need a model that declares more.
  int64_t context_length = 0;
  // num_layers override (0: the preset's): real layer shapes with fewer layers, for benchmarks on a
  // machine whose disk cannot hold the whole model twice (HF checkpoint + GGUF).
  int layers = 0;
  // deepseek4: the layers' compress ratios (0, 4, 128), replacing the preset's (and its layer count): real
  // layer shapes of every kind in a few layers.
  std::vector<int> compress_ratios;
  // deepseek4: how many of the first layers route by token hash (-1: the preset's, capped at the layer count); with a
  // few layers of each kind, 1 keeps the other kinds on the learned router as in the whole model.
  int hash_layers = -1;
  // Only the decoder GGUFs, no HF checkpoint: models larger than the disk holds twice (the prefill then runs the GGUF).
  bool no_hf = false;
  // What llama-quantize starts from, written here: "f32" (exact), or "q8_0" (half the bytes of f16: a 30B model's
  // K-quants on a 64 GB disk; llama-quantize --allow-requantize, as users requantize a Q8_0 download).
  std::string quantize_from = "f32";
};

void make_model(const MakeModelOptions& o);
// deepseek4 (tools/make_model_deepseek4.cpp): the decoder GGUF (F32) of the preset; no HF checkpoint yet.
void make_deepseek4_model(const MakeModelOptions& o, const std::string& vocab_gguf);

// `pdbridge convert`: a real HF checkpoint (safetensors, any float dtype) to the decoder's GGUFs, as
// users do it (convert to a float GGUF, then llama-quantize). The tokenizer comes from --vocab-gguf,
// else from <hf>/pdbridge-vocab.json (our own models' tokenizer), else llama.cpp's vocab for the arch.
struct ConvertOptions {
  std::string hf_dir, out, vocab_gguf, vocab_dir, llama_bin, name;
  std::vector<std::string> gguf_types = {"f16"};
  int threads = 0;
};
void convert_model(const ConvertOptions& o);

// Writes a tokenizer-only GGUF (like llama.cpp's models/ggml-vocab-*.gguf) from pdbridge-vocab.json:
// {"model": "llama", "tokens": [...], "scores": [...], "token_type": [...], "bos_token_id", "eos_token_id",
//  "unknown_token_id", "add_bos_token", "add_eos_token", "add_space_prefix", "chat_template"}.
void write_vocab_gguf_from_json(const std::string& json_path, const std::string& gguf_path);

// The float and quantized decoder GGUFs (decoder-<type>.gguf) of one set of weights. quantize_from: the type of the
// GGUF llama-quantize starts from (F32, or Q8_0: written here, byte for byte what llama-quantize writes).
void write_decoder_ggufs(const HfConfig& c, const HfWeightSource& src, const std::string& vocab, const std::vector<std::string>& types,
                         const std::string& out, const std::string& name, int threads, const std::string& llama_bin, const std::string& tool,
                         GgmlType quantize_from = GgmlType::F32);

class GgufFile;
// Which tokens a random test model may emit (normal tokens of whole UTF-8): the others' head rows are zero.
std::vector<bool> printable_tokens(const GgufFile& vocab);

// The master weight value of element i of tensor `name` (also used by tests to check files).
float master_weight(uint64_t seed, const std::string& name, int64_t i, int64_t n_layers);

}  // namespace pdb
