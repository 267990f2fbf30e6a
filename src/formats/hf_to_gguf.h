// The llama.cpp conversion of an HF llama/qwen3 model into GGUF (what convert_hf_to_gguf.py does):
// tensor names, the Q/K row permutation for llama, hyperparameter keys, llama3 rope_freqs, and the
// tokenizer metadata copied from a llama.cpp vocab GGUF.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "formats/ggml_types.h"
#include "formats/hf_config.h"

namespace pdb {

// Fills dst (row-major HF shape) with the f32 values of the HF tensor `hf_name`.
using HfWeightSource = std::function<void(const std::string& hf_name, float* dst)>;

struct HfTensorSpec {
  std::string hf_name;
  std::vector<int64_t> shape;  // HF (numpy) order
  std::string gguf_name;       // empty: not stored in the GGUF (e.g. tied lm_head)
  int permute_heads = 0;       // llama Q/K: number of heads whose rows are reordered
  // A GGUF tensor stacked from several HF tensors (MoE experts: `stack[e]` is expert e's [out x in],
  // the GGUF tensor ne {in, out, n_expert}); hf_name is then empty and shape is {n_expert, out, in}.
  std::vector<std::string> stack;
  bool keep_f32 = false;       // stays F32 in every GGUF type (the MoE router, as llama.cpp's converter keeps it)
  // deepseek2's attn_k_b (1) / attn_v_b (2): the per-head halves of HF's kv_b_proj (`derive_from`),
  // k_b transposed, as convert_hf_to_gguf.py splits them for MLA.
  int kv_b_part = 0;
  std::string derive_from;
};

// Every tensor of the architecture, in the order the HF checkpoint and the GGUF hold them.
std::vector<HfTensorSpec> hf_tensor_specs(const HfConfig& c);

// llama's converter permutation: gguf_row[h*hd + 2i + a] = hf_row[h*hd + a*hd/2 + i].
void permute_qk_rows(const float* hf, float* gguf, int64_t n_heads, int64_t head_dim, int64_t cols);

struct GgufConvertOptions {
  GgmlType type = GgmlType::F16;  // f32, f16, bf16 or q8_0 for 2-D weights; norms stay f32
  std::string vocab_gguf;         // tokenizer source (llama.cpp models/ggml-vocab-*.gguf)
  std::string name;               // general.name
  int threads = 1;
};

// The per-pair divisors of theta llama.cpp stores as rope_freqs.weight for llama3 scaling.
std::vector<float> llama3_rope_factors(const HfConfig& c);

void write_decoder_gguf(const HfConfig& c, const HfWeightSource& src, const GgufConvertOptions& o, const std::string& path);

// The vocab GGUF llama.cpp ships for an architecture's tokenizer: llama -> llama-bpe, qwen3 -> qwen2.
std::string vocab_name_for_arch(const std::string& arch);
int64_t vocab_size_of(const std::string& vocab_gguf);

}  // namespace pdb
