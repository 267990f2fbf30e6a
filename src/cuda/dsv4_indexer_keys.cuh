// The fragment plumbing of the FP8 indexer's keys kernel (dsv4_indexer_wgmma.cu, the default), host
// and device alike, so that how it strings the hardware's fragment layouts together is checked on any machine
// (dsv4_indexer_keys_test.cpp plays a block's warps through the PTX ISA's wgmma and mma.sync layouts on the host).
//
// A warpgroup multiplies a tile of 64 keys (A, m64) by its 256 (query, head) rows (B, two n128 halves): the
// accumulator holds the warp's 16 keys by the half's 128 rows. Its heads are summed by m16n8k16 bf16 products
// whose A is that accumulator's ReLU (an m64nN accumulator fragment is an m16n8k16 A fragment, k-step by k-step)
// and whose B holds the rows' weights: column n = 2 slot + part is query slot `slot` of a group of four, part 0
// the weight's bf16 value, part 1 the rest (wq - hi, in bf16), so that their sum keeps ~16 bits of wq.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace pdb::cuda::indexer_keys {

constexpr int kGroupRows = 256;  // a warpgroup's (query, head) rows; a query's heads take HP of them (HP >= 16)

// The query (within the warpgroup) of k-step sg's 16 rows, and the accumulator group of four queries it adds into.
__host__ __device__ constexpr int query_of_step(int hp, int sg) { return sg * 16 / hp; }
__host__ __device__ constexpr int group_of_step(int hp, int sg) { return query_of_step(hp, sg) / 4; }
__host__ __device__ constexpr int groups(int hp) { return kGroupRows / hp >= 4 ? kGroupRows / hp / 4 : 1; }

// Register j (0..3) of k-step s's A fragment packs the half's accumulator registers a_source(s, j) (low half) and
// a_source(s, j) + 1 (high half), as bf16 of their ReLU.
__host__ __device__ constexpr int a_source(int s, int j) { return 8 * s + 2 * j; }

// The B fragment word k (0: rows 2 (lane % 4) + {0, 1}; 1: those + 8) of `lane` for k-step sg: lane / 4 is the
// column. `t_valid`: the step's query is in the chunk; w and q_scale point at that query's heads.
__host__ __device__ inline uint32_t b_word(int hp, int heads, bool t_valid, const float* w, const float* q_scale, int sg, int lane, int k) {
  const int n = lane / 4, c = lane % 4, qw = query_of_step(hp, sg);
  if (!t_valid || n / 2 != qw % 4) return 0u;
  float v[2];
  for (int e = 0; e < 2; ++e) {
    const int h = (sg * 16 + 2 * c + 8 * k + e) % hp;
    const float wq = h < heads ? w[h] * q_scale[h] : 0.0f;
    const float hi = __bfloat162float(__float2bfloat16_rn(wq));
    v[e] = n % 2 == 0 ? hi : wq - hi;
  }
  const __nv_bfloat162 p = __floats2bfloat162_rn(v[0], v[1]);
  uint32_t u;
  memcpy(&u, &p, 4);
  return u;
}

// The scores a thread ends with, per group a: query slot score_slot (of the warpgroup's), keys score_key(k = 0, 1)
// of the tile, each the sum of its output registers 2k (part 0) and 2k + 1 (part 1).
__host__ __device__ constexpr int score_slot(int lane, int a) { return 4 * a + lane % 4; }
__host__ __device__ constexpr int score_key(int warp, int lane, int k) { return 16 * warp + lane / 4 + 8 * k; }

}  // namespace pdb::cuda::indexer_keys
