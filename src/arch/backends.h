// The prefill backends the architecture table makes (arch/architectures.cpp): an HF checkpoint's engine with the
// decoder's K/V recipe on its hook (kv_recipe_backend_*.cpp: llama, qwen3, qwen3moe, deepseek2) and DeepSeek-V4's
// engines with its pooled sections (deepseek4_backend*.cpp).
#pragma once
#include <memory>
#include <string>

#include "model/cpu_engine.h"
#include "model/product_numerics.h"
#include "prefill/backend.h"
#include "prefill/capture.h"
#include "recipes/recipe.h"

namespace pdb {

// Non-owning views work too (tests keep their engine and recipe on the stack).
// `faithful` (default): the engine's matmuls and attention follow the decoder's CPU arithmetic
// (bit-identical caches, slow); false: OpenBLAS GEMMs and attention (several times faster, caches
// equal up to rounding). The recipe itself is always faithful.
std::unique_ptr<PrefillBackend> make_cpu_backend(std::shared_ptr<CpuEngine> engine, std::shared_ptr<const Recipe> recipe,
                                                 bool faithful = true);
// Loads the HF checkpoint onto the GPU; `recipe` supplies the decoder's weights. kv_fp8: the engine's
// own K/V in fp8 (cuda_engine.h). tp: tensor parallel over GPUs 0..tp-1 (model/cuda_engine_tp.h), or with
// tp_shared_device every rank on the current GPU (the sharded forward checked on one GPU). Throws where CUDA
// is not built in or no GPU is present. engine_kv_rows (--kv-rows engine): the cache rows are the engine's own K/V
// products, RoPE'd and typed by the recipe, instead of the recipe's products of the decoder's weights with its
// arithmetic; for an engine running the decoder's GGUF (the caller checks), not MLA. numerics: how the engine's
// products of the GGUF's weights round their operands (model/product_numerics.h).
std::unique_ptr<PrefillBackend> make_cuda_backend(const std::string& hf_dir, std::shared_ptr<const Recipe> recipe, int threads,
                                                  int64_t max_chunk, bool kv_fp8 = false, int tp = 1, bool tp_shared_device = false,
                                                  double max_gpu_mem_gib = 0, bool engine_kv_rows = false,
                                                  ProductNumerics numerics = ProductNumerics::bf16);
bool cuda_backend_available();
// DeepSeek-V4 on the CPU (model/cpu_engine_dsv4 + recipes/deepseek4): the decoder GGUF gives the recipe's
// weights; the engine's come from `weights`: an HF checkpoint directory (DeepSeek's FP8 / FP4 layout or f32),
// or a GGUF.
std::unique_ptr<PrefillBackend> make_cpu_dsv4_backend(const std::string& decoder_gguf, const std::string& weights);
// The same with the GPU engine (model/cuda_engine_dsv4.h); throws where CUDA is not built in or no GPU is present.
std::unique_ptr<PrefillBackend> make_cuda_dsv4_backend(const std::string& decoder_gguf, const std::string& weights);
// A capture by the CPU engine and recipe the caller holds (tests, tools): a non-owning CPU backend.
CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk, const EmitFn& emit);

// Convenience for in-process use: every frame accepted.
CaptureResult run_capture(CpuEngine& engine, const Recipe& recipe, const wire::PrefillRequest& req, int64_t chunk,
                          const std::function<bool(wire::Bytes&&)>& emit);

}  // namespace pdb
