// DeepSeek-V4's HF checkpoint in the official layout and llama.cpp's conversion of it to the decoder GGUF
// (../shared/reference/llama-cpp-deepseek4.md section 8: conversion/deepseek.py). One table names every tensor:
// its HF name and shape, the GGUF tensor it becomes, and how the official checkpoint stores it:
//   Fp8        e4m3 [out, in] + `.scale` ue8m0 [ceil(out/128), ceil(in/128)]   -> GGUF Q8_0 (dequantized, requantized)
//   Fp4Expert  a routed expert's matrix: e2m1 two per byte, low nibble first, as I8 [out, in/2]
//              + `.scale` ue8m0 [out, in/32]                                  -> the stacked GGUF tensor in MXFP4 (lossless)
//   Bf16       bf16 (embedding, head, router)                                 -> BF16 (2-D), F32 (1-D)
//   F32        norms, sinks, hyper-connection mixes, ape, the router bias     -> F32
//   I64        the hash layers' tid2eid                                       -> I32
// An F32 checkpoint (our tests') holds every float tensor in F32 and converts to an all-F32 GGUF.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "formats/deepseek4_config.h"

namespace pdb {

class SafetensorsCheckpoint;

struct Dsv4HfTensor {
  enum class Store { Fp8, Fp4Expert, Bf16, F32, I64 };
  std::string hf;                // e.g. layers.0.attn.wq_a.weight
  std::vector<int64_t> shape;    // torch order [out, in]
  std::string gguf;              // e.g. blk.0.attn_q_a.weight
  std::vector<int64_t> gguf_ne;  // the GGUF tensor's ne (routed experts: the stacked {in, out, n_expert})
  Store store = Store::F32;      // in the official checkpoint
  int64_t expert = -1;           // routed experts: the index in the stacked tensor
  float init_mean = 0.0f, init_sd = 0.0f;  // make-model's random values (sd 0: all init_mean)
  int64_t elements() const;
};

// Every tensor of the model, in the checkpoint's order.
std::vector<Dsv4HfTensor> deepseek4_hf_tensors(const Deepseek4Config& c);

// config.json as the official checkpoint's (model_type deepseek_v4; quantization_config and expert_dtype for
// the official layout).
nlohmann::json deepseek4_hf_config_json(const Deepseek4Config& c, bool official_layout);
Deepseek4Config deepseek4_config_from_hf(const nlohmann::json& j);  // throws std::runtime_error naming the field

// A DeepSeek-V4 checkpoint directory, read tensor by GGUF name (what the engine and the converter need).
class Deepseek4Checkpoint {
 public:
  static std::unique_ptr<Deepseek4Checkpoint> open(const std::string& dir);
  ~Deepseek4Checkpoint();
  const Deepseek4Config& config() const { return c_; }
  const std::string& dir() const { return dir_; }
  bool official_layout() const { return official_; }  // FP8 / FP4 tensors present
  // The f32 values of GGUF tensor `gguf` in GGUF memory order (FP8 and FP4 dequantized with their scales, routed
  // experts stacked). Throws for the I32 tensors.
  std::vector<float> gguf_f32(const std::string& gguf) const;
  std::vector<int32_t> gguf_i32(const std::string& gguf) const;  // tid2eid
  // The GGUF tensor as llama.cpp's converter writes it: its type and bytes.
  struct Converted { uint32_t type = 0; std::vector<uint8_t> bytes; };
  Converted gguf_converted(const std::string& gguf) const;
  uint32_t gguf_converted_type(const std::string& gguf) const;
  std::vector<std::string> gguf_names() const;  // in the order the GGUF holds them

 private:
  Deepseek4Checkpoint() = default;
  std::vector<const Dsv4HfTensor*> sources(const std::string& gguf) const;
  std::vector<float> hf_f32(const Dsv4HfTensor& t) const;
  std::string dir_;
  Deepseek4Config c_;
  bool official_ = false;
  std::vector<Dsv4HfTensor> table_;
  std::unique_ptr<SafetensorsCheckpoint> st_;
};

// The decoder GGUF llama-server loads: the keys src/models/deepseek4.cpp reads, the tokenizer of `vocab_gguf`,
// every tensor as the converter writes it.
void write_deepseek4_gguf(const Deepseek4Checkpoint& ck, const std::string& vocab_gguf, const std::string& path, const std::string& name);

}  // namespace pdb
