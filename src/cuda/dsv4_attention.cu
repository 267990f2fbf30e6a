#include "cuda/dsv4_attention.cuh"

#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/device_helpers.cuh"
#include "cuda/dsv4_attention_keys.cuh"

namespace pdb::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// One block per query, 8 warps over its heads padded to 64 rows: warp (rg, cg) computes the scores of rows
// 16 rg .. 16 rg + 15 for the keys cg * KT/2 .. of each tile, and the output of the same rows for the value
// columns cg * D/2 .. (a row's 512 f32 accumulators would not fit one warp's registers). The two warps of a row
// group agree on the tile's row maxima through shared memory and hand each other their half of P there. Key
// tiles of KT rows in two shared-memory stages (cp.async straight from the window and the pool: no gathered copy).
template <int D, int KT>
__global__ void __launch_bounds__(256, 1) sparse_attention_kernel(const __grid_constant__ Dsv4SparseAttention a, __nv_bfloat16* __restrict__ out) {
  constexpr int C = D / 8, KS = D / 16, CP = KT / 8;
  constexpr int NT_S = KT / 16;  // 8-key n-tiles of S per warp: half the tile
  constexpr int NT_O = D / 16;   // 8-column n-tiles of O per warp: half of D
  constexpr uint32_t kTileBytes = KT * D * 2;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const uint32_t sbase = uint32_t(__cvta_generic_to_shared(smem_raw));
  const uint32_t sQ = sbase, sK0 = sQ + 64 * D * 2, sP = sK0 + 2 * kTileBytes;
  const uint32_t p_off = 64 * D * 2 + 2 * kTileBytes;
  float* s_max = reinterpret_cast<float*>(smem_raw + p_off + 64 * KT * 2);  // [2][64]
  float* s_sum = s_max + 128;                                               // [2][64]
  uint8_t* s_valid = reinterpret_cast<uint8_t*>(s_sum + 128);               // [2][KT]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rg = warp >> 1, cg = warp & 1;
  const Dsv4QueryKeys<D> qk = dsv4_query_keys<D>(a);
  const int64_t qi = qk.qi;
  const int n_slots = qk.n_slots;
  const int n_tiles = (n_slots + KT - 1) / KT;

  for (int i = threadIdx.x; i < 64 * C; i += 256) {
    const int r = i / C, c = i % C;
    const bool ok = r < a.H;
    cp_async16(sQ + swz(r, c, C), a.q + (qi * a.H + (ok ? r : 0)) * D + c * 8, ok);
  }
  cp_async_commit();
  auto load = [&](int tile, int stage) {
    dsv4_load_key_tile<D, KT, 256>(qk, tile, sK0 + stage * kTileBytes, s_valid + stage * KT, [](int r, int c) { return swz(r, c, C); });
  };
  load(0, 0);

  const int mat = lane / 8, lr = lane % 8, quad = lane & 3;
  const int row0 = rg * 16 + lane / 4;  // this thread's rows (heads): row0 and row0 + 8
  float o[NT_O][4];
#pragma unroll
  for (int j = 0; j < NT_O; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  // the sink is one more logit: the running max starts at it, the running sum at its weight exp(sink - max) = 1
  // (held once per row: by lane 0 of the quad of the cg = 0 warp)
  float m_run[2], l_run[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int hh = row0 + 8 * h;
    m_run[h] = (hh < a.H ? a.sinks[hh] : 0.0f) * kLog2e;
    l_run[h] = cg == 0 && quad == 0 ? 1.0f : 0.0f;
  }
  const float scale_log2 = a.scale * kLog2e;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    cp_async_wait<0>();
    __syncthreads();  // the tile (and on the first, Q) landed; every warp is done with the other stage
    if (tile + 1 < n_tiles) load(tile + 1, stage ^ 1);
    const uint32_t sK = sK0 + stage * kTileBytes;
    float sc[NT_S][4];
#pragma unroll
    for (int j = 0; j < NT_S; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll 4
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t qa[4];
      ldmatrix_x4(sQ + swz(rg * 16 + lr + (mat & 1) * 8, kk * 2 + (mat >> 1), C), qa[0], qa[1], qa[2], qa[3]);
#pragma unroll
      for (int j = 0; j < NT_S; j += 2) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(sK + swz(cg * (KT / 2) + (j + (mat >> 1)) * 8 + lr, kk * 2 + (mat & 1), C), b0, b1, b2, b3);
        mma_bf16(sc[j], qa, b0, b1);
        mma_bf16(sc[j + 1], qa, b2, b3);
      }
    }
    const uint8_t* valid = s_valid + stage * KT;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < NT_S; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = cg * (KT / 2) + j * 8 + 2 * quad + (e & 1);
        const float x = valid[col] ? sc[j][e] * scale_log2 : -INFINITY;
        sc[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      if (quad == 0) s_max[cg * 64 + row0 + 8 * h] = mx[h];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m_run[h], fmaxf(mx[h], s_max[(cg ^ 1) * 64 + row0 + 8 * h]));
      const float corr = exp2f(m_run[h] - m_new);
      m_run[h] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NT_S; ++j) {
        sc[j][2 * h] = exp2f(sc[j][2 * h] - m_new);
        sc[j][2 * h + 1] = exp2f(sc[j][2 * h + 1] - m_new);
        sum += sc[j][2 * h] + sc[j][2 * h + 1];
      }
      l_run[h] = l_run[h] * corr + sum;
#pragma unroll
      for (int j = 0; j < NT_O; ++j) { o[j][2 * h] *= corr; o[j][2 * h + 1] *= corr; }
      const int row = row0 + 8 * h;
#pragma unroll
      for (int j = 0; j < NT_S; ++j) {
        const int col = cg * (KT / 2) + j * 8 + 2 * quad;
        *reinterpret_cast<uint32_t*>(smem_raw + p_off + swz(row, col / 8, CP) + (col % 8) * 2) = pack_bf16(sc[j][2 * h], sc[j][2 * h + 1]);
      }
    }
    __syncthreads();  // both halves of P
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
      uint32_t pa[4];
      ldmatrix_x4(sP + swz(rg * 16 + lr + (mat & 1) * 8, kk * 2 + (mat >> 1), CP), pa[0], pa[1], pa[2], pa[3]);
#pragma unroll
      for (int j = 0; j < NT_O; j += 2) {
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4_trans(sK + swz(kk * 16 + (mat & 1) * 8 + lr, cg * NT_O + j + (mat >> 1), C), b0, b1, b2, b3);
        mma_bf16(o[j], pa, b0, b1);
        mma_bf16(o[j + 1], pa, b2, b3);
      }
    }
  }
  // the row sums: the quad's lanes, then the two warps of the row group
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (quad == 0) s_sum[cg * 64 + row0 + 8 * h] = l;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= a.H) continue;
    const float inv = 1.0f / (s_sum[row] + s_sum[64 + row]);
    __nv_bfloat16* orow = out + (qi * a.H + row) * D + cg * (D / 2);
#pragma unroll
    for (int j = 0; j < NT_O; ++j)
      *reinterpret_cast<__nv_bfloat162*>(orow + j * 8 + 2 * quad) = __floats2bfloat162_rn(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
  }
}

template <int D, int KT>
void launch(const Dsv4SparseAttention& a, __nv_bfloat16* out, cudaStream_t s) {
  constexpr int smem = 64 * D * 2 + 2 * KT * D * 2 + 64 * KT * 2 + 2 * 128 * 4 + 2 * KT;
  static bool configured = false;  // once per process and instantiation
  if (!configured) {
    PDB_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_kernel<D, KT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured = true;
  }
  sparse_attention_kernel<D, KT><<<unsigned(a.nq), 256, smem, s>>>(a, out);
  PDB_CUDA_LAUNCHED();
}

}  // namespace

bool dsv4_sparse_attention_supported(int heads, int dim) { return heads > 0 && heads <= 64 && (dim == 64 || dim == 512); }

void dsv4_sparse_attention(const Dsv4SparseAttention& a, __nv_bfloat16* out, cudaStream_t s) {
  if (a.nq <= 0) return;
  if (!dsv4_sparse_attention_supported(a.H, a.D))
    throw std::invalid_argument("dsv4_sparse_attention: takes <= 64 heads of 64 or 512, not " + std::to_string(a.H) + " x " + std::to_string(a.D));
  if (a.ratio != 0 && a.ratio != 4 && a.ratio != 128) throw std::invalid_argument("dsv4_sparse_attention: compress ratio 0, 4 or 128");
  if (a.ratio == 4 && (!a.idx || a.top_k <= 0)) throw std::invalid_argument("dsv4_sparse_attention: ratio 4 needs the indexer's choices");
  if (a.W <= 0) throw std::invalid_argument("dsv4_sparse_attention: the window must be positive");
  if (a.D == 512) return launch<512, 64>(a, out, s);
  return launch<64, 64>(a, out, s);
}

}  // namespace pdb::cuda
