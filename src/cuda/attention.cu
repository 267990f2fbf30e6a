#include "cuda/attention.cuh"
#include "cuda/attention_cudnn.h"
#include "cuda/device.h"
#include "common/tuning.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"

namespace pdb::cuda {
namespace {

// A block of W warps; each warp owns 16 query rows of one head; KT keys per shared-memory tile
// (64, or 128 to halve the per-tile synchronisation and softmax bookkeeping per key). With GQA the block packs the
// query heads that share a KV head (heads_per_block of them, W / heads_per_block warps each), so
// every K/V tile brought into shared memory serves 16 * W query rows: twice the reuse of a
// one-head block at W = 8, which is what keeps long contexts off the memory roof.
// Shared tiles are rows of head_dim bf16 in swizzled 16-byte chunks (device_helpers.cuh, swz).
__device__ __forceinline__ int64_t imin64(int64_t a, int64_t b) { return a < b ? a : b; }

// Copies `rows` rows (row stride `stride` elements) of a head_dim-wide tile into swizzled shared memory;
// rows at or past `valid` are zero-filled.
template <int D, int W>
__device__ __forceinline__ void load_tile(uint32_t smem, const __nv_bfloat16* g, int64_t stride, int rows, int valid) {
  constexpr int C = D / 8;
  for (int i = threadIdx.x; i < rows * C; i += 32 * W) {
    const int r = i / C, c = i % C;
    const bool ok = r < valid;
    cp_async16(smem + swz(r, c, C), g + (ok ? int64_t(r) * stride + c * 8 : 0), ok);
  }
}

// D: the width of queries and keys, DV of values and outputs (equal except for MLA's 192 / 128).
template <int D, int DV, int W, int KT>
__global__ void __launch_bounds__(32 * W, W == 4 ? 2 : 1)
flash_attention_causal(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                       const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ out, AttentionShape s, int heads_per_block) {
  constexpr int kBlockRows = 16 * W;  // query rows (head, position) per block
  constexpr int C = D / 8;           // 16-byte chunks per row
  constexpr int KSTEPS = D / 16;     // mma k-steps over head_dim
  constexpr int CV = DV / 8;         // 16-byte chunks per value row
  constexpr int DTILES = DV / 8;     // output n-tiles
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t sbase = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t sQ = sbase;
  // Stage s of K at sK0 + s * tile, of V at sV0 + s * tile (arithmetic, not an array: no stack frame).
  constexpr uint32_t kTileBytes = KT * D * 2, vTileBytes = KT * DV * 2;
  const uint32_t sK0 = sQ + kBlockRows * D * 2;
  const uint32_t sV0 = sK0 + 2 * kTileBytes;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Heaviest query tiles (most keys) first, so the tail of the grid is short.
  const int qtile = int(gridDim.x) - 1 - int(blockIdx.x);
  const int warps_per_head = W / heads_per_block;
  const int block_positions = 16 * warps_per_head;
  const int head = int(blockIdx.y) * heads_per_block + warp / warps_per_head;  // this warp's head
  const int sub = warp % warps_per_head;                                      // its 16-row slice
  const int kvh = head / (s.n_heads / s.n_kv_heads);  // shared by the whole block
  const int64_t q_first = int64_t(qtile) * block_positions;  // first position (within the chunk) of the block
  const int64_t q_stride = int64_t(s.n_heads) * D;
  const int64_t n_keys = s.pos0 + imin64(s.n_q, q_first + block_positions);  // keys this block can see
  const int n_tiles = int((n_keys + KT - 1) / KT);
  const __nv_bfloat16* kh = k + int64_t(kvh) * s.kv_capacity * D;
  const __nv_bfloat16* vh = v + int64_t(kvh) * s.kv_capacity * DV;

  // Q rows: smem row w*16 + r is position q_first + (w % warps_per_head)*16 + r of head (w / warps_per_head).
  for (int i = threadIdx.x; i < kBlockRows * C; i += 32 * W) {
    const int row = i / C, c = i % C, w = row / 16;
    const int64_t pos = q_first + (w % warps_per_head) * 16 + row % 16;
    const int h = int(blockIdx.y) * heads_per_block + w / warps_per_head;
    const bool ok = pos < s.n_q;
    cp_async16(sQ + swz(row, c, C), q + (ok ? pos * q_stride + int64_t(h) * D + c * 8 : 0), ok);
  }
  cp_async_commit();
  auto load_kv = [&](int t, int stage) {
    const int64_t k0 = int64_t(t) * KT;
    const int valid = int(imin64(KT, n_keys - k0));
    load_tile<D, W>(sK0 + stage * kTileBytes, kh + k0 * D, D, KT, valid);
    load_tile<DV, W>(sV0 + stage * vTileBytes, vh + k0 * DV, DV, KT, valid);
    cp_async_commit();
  };
  load_kv(0, 0);
  cp_async_wait<1>();
  __syncthreads();

  uint32_t qf[KSTEPS][4];
  {
    const int mat = lane / 8, r = lane % 8;
    const int row = warp * 16 + r + (mat & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
      ldmatrix_x4(sQ + swz(row, kk * 2 + (mat >> 1), C), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
  }

  float o[DTILES][4];
#pragma unroll
  for (int j = 0; j < DTILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  const float scale_log2 = s.scale * 1.4426950408889634f;
  // Absolute positions of this thread's two query rows.
  const int64_t qpos0 = s.pos0 + q_first + sub * 16 + lane / 4;
  const int64_t qpos[2] = {qpos0, qpos0 + 8};

  for (int t = 0; t < n_tiles; ++t) {
    const int stage = t & 1;
    if (t + 1 < n_tiles) { load_kv(t + 1, stage ^ 1); cp_async_wait<1>(); }
    else cp_async_wait<0>();
    __syncthreads();

    // S = Q K^T for 16 rows x 64 keys.
    float sc[KT / 8][4];
#pragma unroll
    for (int j = 0; j < KT / 8; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
    {
      const int mat = lane / 8, r = lane % 8;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
        for (int j = 0; j < KT / 8; j += 2) {
          uint32_t b0, b1, b2, b3;
          const int key = (j + (mat >> 1)) * 8 + r;
          ldmatrix_x4(sK0 + stage * kTileBytes + swz(key, kk * 2 + (mat & 1), C), b0, b1, b2, b3);
          mma_bf16(sc[j], qf[kk], b0, b1);
          mma_bf16(sc[j + 1], qf[kk], b2, b3);
        }
    }
    // Causal mask where the tile reaches past the first query row of the block.
    const int64_t key0 = int64_t(t) * KT;
    const bool needs_mask = key0 + KT - 1 > s.pos0 + q_first;
#pragma unroll
    for (int j = 0; j < KT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = sc[j][e] * scale_log2;
        if (needs_mask) {
          const int64_t kpos = key0 + j * 8 + 2 * (lane % 4) + (e & 1);
          if (kpos > qpos[e >> 1]) x = -INFINITY;
        }
        sc[j][e] = x;
      }
    // Online softmax (base 2): rows are shared by the 4 lanes of a quad.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m_run[h];
#pragma unroll
      for (int j = 0; j < KT / 8; ++j) mx = fmaxf(mx, fmaxf(sc[j][2 * h], sc[j][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float corr = exp2f(m_run[h] - mx);  // m_run = -inf on the first tile: corr = 0
      m_run[h] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < KT / 8; ++j) {
        sc[j][2 * h] = exp2f(sc[j][2 * h] - mx);
        sc[j][2 * h + 1] = exp2f(sc[j][2 * h + 1] - mx);
        sum += sc[j][2 * h] + sc[j][2 * h + 1];
      }
      l_run[h] = l_run[h] * corr + sum;  // per-lane partial; reduced across the quad at the end
#pragma unroll
      for (int j = 0; j < DTILES; ++j) { o[j][2 * h] *= corr; o[j][2 * h + 1] *= corr; }
    }
    // O += P V: the S accumulators of two neighbouring key tiles are exactly one A fragment.
    {
      const int mat = lane / 8, r = lane % 8;
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk) {
        uint32_t a[4] = {pack_bf16(sc[2 * kk][0], sc[2 * kk][1]), pack_bf16(sc[2 * kk][2], sc[2 * kk][3]),
                         pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
        for (int j = 0; j < DTILES; j += 2) {
          uint32_t b0, b1, b2, b3;
          const int key = kk * 16 + (mat & 1) * 8 + r;
          ldmatrix_x4_trans(sV0 + stage * vTileBytes + swz(key, j + (mat >> 1), CV), b0, b1, b2, b3);
          mma_bf16(o[j], a, b0, b1);
          mma_bf16(o[j + 1], a, b2, b3);
        }
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }

  store_normalized_rows<DV>(&o[0][0], l_run, q_first + sub * 16 + lane / 4, s.n_q, int64_t(s.n_heads) * DV, int64_t(head) * DV, lane % 4, out);
}

template <int D, int DV, int W, int KT>
void launch(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out, const AttentionShape& s,
            cudaStream_t stream) {
  const int smem = (16 * W + 2 * KT) * D * 2 + 2 * KT * DV * 2;
  static bool configured = false;  // attribute set once per process and instantiation
  if (!configured) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(flash_attention_causal<D, DV, W, KT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured = true;
  }
  const int group = s.n_heads / s.n_kv_heads;
  // Pack the group's heads into one block where the group divides the block's warps.
  const int heads_per_block = (W == 8 && 8 % group == 0) ? group : 1;
  const int positions = 16 * (W / heads_per_block);
  const dim3 grid(unsigned((s.n_q + positions - 1) / positions), unsigned(s.n_heads / heads_per_block));
  flash_attention_causal<D, DV, W, KT><<<grid, 32 * W, smem, stream>>>(q, k, v, out, s, heads_per_block);
  PDB_CUDA_LAUNCHED();
}

template <int D, int DV = D>
void launch_tuned(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out, const AttentionShape& s,
                  const AttentionTuning& t, cudaStream_t stream) {
  if (t.warps == 4 && t.key_tile == 64) return launch<D, DV, 4, 64>(q, k, v, out, s, stream);
  if (t.warps == 8 && t.key_tile == 64) return launch<D, DV, 8, 64>(q, k, v, out, s, stream);
  if (D + DV <= 256 && t.warps == 8 && t.key_tile == 128) return launch<D, DV, 8, 128>(q, k, v, out, s, stream);
  throw std::invalid_argument("attention: no kernel for " + std::to_string(t.warps) + " warps x " + std::to_string(t.key_tile) +
                              " keys per tile (4 x 64, 8 x 64, 8 x 128)");
}

// cuDNN where it loads and has an engine for this shape; otherwise false (said once per reason) and our kernels run.
bool try_cudnn(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out, const AttentionShape& s,
               cudaStream_t stream) {
  static std::mutex mu;
  static std::set<std::string> said;
  if (!q || !k || !v || !out) return false;  // our kernels' checks say what is wrong
  try {
    causal_attention_cudnn(q, k, v, out, s, stream);
    return true;
  } catch (const std::runtime_error& e) {
    std::lock_guard<std::mutex> lock(mu);
    if (said.insert(e.what()).second) std::fprintf(stderr, "attention: our kernels instead of cuDNN's: %s\n", e.what());
    return false;
  }
}

}  // namespace

// Read at every call (a handful of getenv beside a kernel launch), so that a test can switch kernels between engines.
AttentionTuning AttentionTuning::from_env() {
  AttentionTuning r;
  // Naming a shape of the mma.sync kernel selects that kernel.
  const Tuning t = Tuning::from_env();
  if (t.attn_warps == "4") r.warps = 4, r.wgmma = false;
  if (t.attn_ktile == "128") r.key_tile = 128, r.wgmma = false;
  if (t.attn_wgmma == "0") r.wgmma = false;
  if (t.attn_wgmma == "1") r.schedule = WgmmaSchedule::kLockstep;
  // cuDNN's fused attention by default: 1.45x our wgmma kernel in the same run on the H200 (docs/RESULTS.md)
  if (!t.attn.empty() && t.attn != "ours" && t.attn != "cudnn") throw std::invalid_argument("PDBRIDGE_ATTN: cudnn or ours, not " + t.attn);
  // naming one of our kernel's shapes or schedules selects our kernels too
  const bool ours_named = !t.attn_warps.empty() || !t.attn_ktile.empty() || !t.attn_wgmma.empty();
  r.cudnn = t.attn == "cudnn" || (t.attn.empty() && !ours_named);
  return r;
}

void causal_attention(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                      const AttentionShape& s, cudaStream_t stream, const AttentionTuning& tuning) {
  if (s.n_q <= 0) return;
  if (s.n_kv_heads <= 0 || s.n_heads % s.n_kv_heads != 0) throw std::invalid_argument("attention: heads not a multiple of kv heads");
  if (s.pos0 + s.n_q > s.kv_capacity) throw std::invalid_argument("attention: keys past the cache capacity");
  if (tuning.cudnn && try_cudnn(q, k, v, out, s, stream)) return;
  const int dv = s.v_dim();
  if (dv != s.head_dim) {
    if (s.head_dim == 192 && dv == 128) return launch_tuned<192, 128>(q, k, v, out, s, tuning, stream);
    throw std::invalid_argument("attention: key width " + std::to_string(s.head_dim) + " with value width " + std::to_string(dv) +
                                " not supported (192 / 128: MLA)");
  }
  if (tuning.wgmma && wgmma_attention_supported(s)) return causal_attention_wgmma(q, k, v, out, s, stream, tuning.schedule);
  switch (s.head_dim) {
    case 64: return launch_tuned<64>(q, k, v, out, s, tuning, stream);
    case 128: return launch_tuned<128>(q, k, v, out, s, tuning, stream);
    default: throw std::invalid_argument("attention: head_dim " + std::to_string(s.head_dim) + " not supported (64, 128)");
  }
}

void causal_attention(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
                      const AttentionShape& s, cudaStream_t stream) {
  causal_attention(q, k, v, out, s, stream, AttentionTuning::from_env());
}

int64_t attention_plans_built() { return cudnn_attention_stats().plans; }

std::string attention_kernel_summary() {
  if (!AttentionTuning::from_env().cudnn) return "ours (PDBRIDGE_ATTN=ours)";
  std::string why;
  return cudnn_attention_available(&why) ? "cudnn " + why.substr(why.find(' ') + 1) : "ours (" + why + ")";
}

}  // namespace pdb::cuda
