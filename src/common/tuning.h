// Every PDBRIDGE_* tuning switch in one place: the A/B paths the benchmarks compare in the same run (README and
// docs/RESULTS.md say which one is the default and why). Parsed from the environment into one struct by
// Tuning::from_env(); each engine takes it when it is made (a test may set a switch between two engines).
#pragma once
#include <cstdlib>
#include <string>
#include <vector>

namespace pdb {

struct Tuning {
  // causal attention (cuda/attention.cu): PDBRIDGE_ATTN_WARPS=4 / PDBRIDGE_ATTN_KTILE=128 pick an mma.sync shape;
  // PDBRIDGE_ATTN_WGMMA=0 the mma.sync kernel, =1 the wgmma kernel's lockstep schedule
  std::string attn_warps, attn_ktile, attn_wgmma;
  std::string attn;              // PDBRIDGE_ATTN=cudnn|ours: cuDNN's fused attention (the default where it loads) or our
                                 // kernels (also chosen by naming one of the three switches above)
  std::string attn_bucket;       // PDBRIDGE_ATTN_BUCKET=0: cuDNN's attention plans for the exact query rows (no bucket)
  std::string moe_gemm;          // PDBRIDGE_MOE_GEMM=cudnn|cudnn-gather|grouped|loop: the MoE's expert products through
                                 // cuDNN's grouped matmul (the default where it loads; -gather: x read through the
                                 // grouping's index), cuBLAS's grouped call, or one cuBLAS product per expert
  std::string state_pwrite;      // PDBRIDGE_STATE_PWRITE=1: the state writer's pwrite path instead of mmap
  std::string fp8;               // PDBRIDGE_FP8=0: block-FP8 checkpoints as bf16 products
  std::string fp8kv_fused;       // PDBRIDGE_FP8KV_FUSED=1: the lockstep attention reads fp8 K/V itself
  std::string recipe_stream;     // PDBRIDGE_RECIPE_STREAM=1: the GPU recipe on its own stream
  std::string dsv4_experts;      // PDBRIDGE_DSV4_EXPERTS=bf16: DeepSeek-V4's random-weight bench with bf16 experts
  std::string dsv4_experts_fp8;  // PDBRIDGE_DSV4_EXPERTS_FP8=1: FP8 expert products from e4m3 tiles (after expansion)
  std::string dsv4_experts_fp4;  // PDBRIDGE_DSV4_EXPERTS_FP4=0: the FP4 experts expanded to bf16 for cuBLAS (the default:
                                 // products that read the MXFP4 codes)
  std::string dsv4_fp4_tile;     // PDBRIDGE_DSV4_FP4_TILE=rows256: the FP4 products' CTAs as 128 outputs x 256 rows (the
                                 // default: 256 outputs x 128 rows)
  std::string dsv4_fp4_fuse;     // PDBRIDGE_DSV4_FP4_FUSE=0: the FP4 gate|up products without their gather and SwiGLU (the
                                 // default: the products gather their rows and write the SwiGLU)
  std::string dsv4_indexer;      // PDBRIDGE_DSV4_INDEXER=bf16|gemm: the indexer's scores in bf16, or GEMM + sum
  std::string dsv4_indexer_a;    // PDBRIDGE_DSV4_INDEXER_A=smem|registers: the FP8 indexer's queries as A, from shared
                                 // memory by every product or as register fragments read once (the default: the keys
                                 // as A, the heads summed by bf16 products)
  std::string dsv4_attn;         // PDBRIDGE_DSV4_ATTN=gather: the gathered sparse attention; =mma: the fused one on mma.sync (not wgmma)
  std::string dsv4_topk;         // PDBRIDGE_DSV4_TOPK=global: the indexer's top-k by block scans over global memory; =smem:
                                 // each query's scores in shared memory (the default: by warps over global memory, ballots)
  std::string dsv4_expand;       // PDBRIDGE_DSV4_EXPAND=inline: with PDBRIDGE_DSV4_EXPERTS_FP4=0, the experts expanded in the MoE, not on a side stream
  std::string dsv4_mix;          // PDBRIDGE_DSV4_MIX=cublas: the hyper-connection mixes' f32 products by cuBLAS, not the
                                 // narrow kernel; =narrow: the kernel at any row count (the tests' tiny prompts);
                                 // =split: the kernel with k split until its tiles fill the GPU
  std::string dsv4_f32;          // PDBRIDGE_DSV4_F32=fp32: the mixes' and the router's f32 products on the f32 units (the
                                 // default: as three TF32 tensor-core products, k split where a chunk's tiles do
                                 // not fill the GPU); =mixes: the mixes only (the router by cuBLAS's f32 products)
  std::string q8_gemm;           // PDBRIDGE_Q8_GEMM=64|128: the Q8_0 block products (sections, recipes) in those tiles
                                 // whatever their size (the default: 128 where they fill the GPU twice)
  std::string act_quant;         // PDBRIDGE_ACT_QUANT=0: the CPU engine's products with a GGUF's quantized weights in f32
  std::string readback;          // PDBRIDGE_READBACK=copy: small device results reach the host by cudaMemcpyAsync, not mapped stores
  std::string rows_fused;        // PDBRIDGE_ROWS_FUSED=0: the GPU backend's rows of an f16 cache in five passes, not one
  std::string capture_stats;     // PDBRIDGE_CAPTURE_STATS=1: each GPU capture's rows timed part by part, on stderr (no path changes)
  std::string frames;            // PDBRIDGE_FRAMES=copy: the GPU backend copies its pinned slot buffers into frames (default: they leave as the frames)
  std::string tail_pieces;       // PDBRIDGE_TAIL_PIECES=N: a GPU capture's last block in up to N pieces, each copied out and hashed
                                 // as it lands (default 1: whole, as the blocks before it; 4 measured no faster, docs/RESULTS.md)
  std::string mla_auto_rows;     // PDBRIDGE_MLA_AUTO_ROWS=1: --kv-rows auto takes MLA's rows from the engine's half kv_a product
                                 // (an F16 GGUF; the same rows as the recipe's, measured no faster, docs/RESULTS.md)

  static Tuning from_env();
};

struct TuningSwitch {
  const char* env;
  std::string Tuning::*field;
};
// The switches, in the order above. Header-only: the CUDA kernels' library reads them too.
inline const std::vector<TuningSwitch>& tuning_switches() {
  static const std::vector<TuningSwitch> s = {
      {"PDBRIDGE_ATTN_WARPS", &Tuning::attn_warps},         {"PDBRIDGE_ATTN_KTILE", &Tuning::attn_ktile},
      {"PDBRIDGE_ATTN_WGMMA", &Tuning::attn_wgmma},         {"PDBRIDGE_ATTN", &Tuning::attn},
      {"PDBRIDGE_MOE_GEMM", &Tuning::moe_gemm},             {"PDBRIDGE_ATTN_BUCKET", &Tuning::attn_bucket},
      {"PDBRIDGE_STATE_PWRITE", &Tuning::state_pwrite},     {"PDBRIDGE_FP8", &Tuning::fp8},
      {"PDBRIDGE_FP8KV_FUSED", &Tuning::fp8kv_fused},       {"PDBRIDGE_RECIPE_STREAM", &Tuning::recipe_stream},
      {"PDBRIDGE_DSV4_EXPERTS", &Tuning::dsv4_experts},     {"PDBRIDGE_DSV4_EXPERTS_FP8", &Tuning::dsv4_experts_fp8},
      {"PDBRIDGE_DSV4_EXPERTS_FP4", &Tuning::dsv4_experts_fp4}, {"PDBRIDGE_DSV4_FP4_TILE", &Tuning::dsv4_fp4_tile},
      {"PDBRIDGE_DSV4_FP4_FUSE", &Tuning::dsv4_fp4_fuse},
      {"PDBRIDGE_DSV4_INDEXER", &Tuning::dsv4_indexer},     {"PDBRIDGE_DSV4_INDEXER_A", &Tuning::dsv4_indexer_a},
      {"PDBRIDGE_DSV4_ATTN", &Tuning::dsv4_attn},
      {"PDBRIDGE_DSV4_TOPK", &Tuning::dsv4_topk},
      {"PDBRIDGE_DSV4_EXPAND", &Tuning::dsv4_expand},       {"PDBRIDGE_DSV4_MIX", &Tuning::dsv4_mix},
      {"PDBRIDGE_DSV4_F32", &Tuning::dsv4_f32},
      {"PDBRIDGE_Q8_GEMM", &Tuning::q8_gemm},
      {"PDBRIDGE_ACT_QUANT", &Tuning::act_quant},
      {"PDBRIDGE_READBACK", &Tuning::readback},             {"PDBRIDGE_ROWS_FUSED", &Tuning::rows_fused},
      {"PDBRIDGE_CAPTURE_STATS", &Tuning::capture_stats},    {"PDBRIDGE_FRAMES", &Tuning::frames},
      {"PDBRIDGE_TAIL_PIECES", &Tuning::tail_pieces},      {"PDBRIDGE_MLA_AUTO_ROWS", &Tuning::mla_auto_rows},
  };
  return s;
}

inline Tuning Tuning::from_env() {
  Tuning t;
  for (const auto& s : tuning_switches())
    if (const char* v = std::getenv(s.env)) t.*s.field = v;
  return t;
}

}  // namespace pdb
