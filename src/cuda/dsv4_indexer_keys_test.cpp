// The FP8 indexer's keys kernel strings three fragment layouts together (dsv4_indexer_keys.cuh): wgmma's m64nN
// accumulator, read as mma.sync m16n8k16 A fragments; the rows' weights as its B fragments; its outputs as scores.
// Here a warpgroup's four warps are played on the host through the layouts as the PTX ISA states them (written out
// below, not taken from the kernel), with the kernel's own choices from the header, and each score is checked
// against the weighted ReLU sum over heads. Runs on any machine of a CUDA build: no GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#ifdef PDBRIDGE_HAVE_CUDA
#include "cuda/dsv4_indexer_keys.cuh"
#endif

namespace pdb {

#ifdef PDBRIDGE_HAVE_CUDA
namespace {

float bf16_half(uint32_t word, int e) {  // element e (0: the low half) of a bf16x2 word
  const uint32_t bits = (e == 0 ? word << 16 : word & 0xffff0000u);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// PTX ISA layouts (g = lane / 4, c = lane % 4):
// wgmma m64nN f32 accumulator register i of warp w: row 16 w + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 c + (i & 1)
int acc_row(int w, int lane, int i) { return 16 * w + lane / 4 + 8 * ((i >> 1) & 1); }
int acc_col(int lane, int i) { return 8 * (i >> 2) + 2 * (lane % 4) + (i & 1); }
// mma.m16n8k16 bf16: A register i, half e: row g + 8 (i % 2), column 2 c + e + 8 (i / 2); B register i, half e: k =
// 2 c + e + 8 i, n = g; C register i: row g + 8 (i / 2), column 2 c + (i % 2)
struct Warp16x8 {
  float c[32][4] = {};  // each lane's C registers
  void mma(const uint32_t (&a)[32][4], const uint32_t (&b)[32][2]) {
    float A[16][16], B[16][8];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, cc = lane % 4;
      for (int i = 0; i < 4; ++i)
        for (int e = 0; e < 2; ++e) A[g + 8 * (i % 2)][2 * cc + e + 8 * (i / 2)] = bf16_half(a[lane][i], e);
      for (int i = 0; i < 2; ++i)
        for (int e = 0; e < 2; ++e) B[2 * cc + e + 8 * i][g] = bf16_half(b[lane][i], e);
    }
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const int row = lane / 4 + 8 * (i / 2), col = 2 * (lane % 4) + (i % 2);
        double s = 0;
        for (int k = 0; k < 16; ++k) s += double(A[row][k]) * B[k][col];
        c[lane][i] += float(s);
      }
  }
};

// One warpgroup's scores for 64 keys from the accumulator D [64 keys x 256 rows], the kernel's way.
std::vector<float> keys_kernel_scores(int hp, int heads, int n_valid, const std::vector<float>& D, const std::vector<float>& w,
                                      const std::vector<float>& qs) {
  using namespace cuda::indexer_keys;
  const int qw_count = kGroupRows / hp, n_groups = groups(hp);
  std::vector<float> scores(size_t(qw_count) * 64, NAN);
  for (int warp = 0; warp < 4; ++warp) {
    std::vector<Warp16x8> out(static_cast<size_t>(n_groups));
    for (int half = 0; half < 2; ++half)
      for (int s = 0; s < 8; ++s) {
        const int sg = half * 8 + s, q = query_of_step(hp, sg);
        uint32_t a[32][4], b[32][2];
        for (int lane = 0; lane < 32; ++lane) {
          auto acc = [&](int i) { return D[size_t(acc_row(warp, lane, i) * kGroupRows + half * 128 + acc_col(lane, i))]; };
          for (int j = 0; j < 4; ++j) {
            const __nv_bfloat162 p = __floats2bfloat162_rn(std::max(0.0f, acc(a_source(s, j))), std::max(0.0f, acc(a_source(s, j) + 1)));
            std::memcpy(&a[lane][j], &p, 4);
          }
          const bool ok = q < n_valid;
          for (int k = 0; k < 2; ++k)
            b[lane][k] = b_word(hp, heads, ok, w.data() + (ok ? q * heads : 0), qs.data() + (ok ? q * heads : 0), sg, lane, k);
        }
        out[size_t(group_of_step(hp, sg))].mma(a, b);
      }
    for (int a = 0; a < n_groups; ++a)
      for (int lane = 0; lane < 32; ++lane) {
        const int slot = score_slot(lane, a);
        if (slot >= qw_count) continue;
        for (int k = 0; k < 2; ++k) scores[size_t(slot * 64 + score_key(warp, lane, k))] = out[size_t(a)].c[lane][2 * k] + out[size_t(a)].c[lane][2 * k + 1];
      }
  }
  return scores;
}

}  // namespace
#endif

TEST(Dsv4IndexerKeys, FragmentsSumEachQuerysHeadsOverTheRightKeys) {
#ifdef PDBRIDGE_HAVE_CUDA
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // padded rows (heads < HP), a part-filled warpgroup (n_valid < its queries), one and two groups of four queries
  struct Case { int hp, heads, n_valid; };
  for (const Case c : {Case{64, 64, 4}, Case{64, 48, 3}, Case{32, 32, 8}, Case{32, 20, 6}, Case{128, 128, 2}, Case{128, 100, 1}}) {
    const int qw_count = cuda::indexer_keys::kGroupRows / c.hp;
    std::vector<float> D(size_t(64) * 256), w(size_t(qw_count) * c.heads), qs(w.size());
    for (auto& x : D) x = 100.0f * nd(rng);
    for (auto& x : w) x = 0.1f * nd(rng);
    for (auto& x : qs) x = std::ldexp(1.0f, int(rng() % 9) - 4);  // powers of two, as the FP8 rows' scales
    const auto got = keys_kernel_scores(c.hp, c.heads, c.n_valid, D, w, qs);
    double worst = 0;
    for (int q = 0; q < qw_count; ++q)
      for (int key = 0; key < 64; ++key) {
        double want = 0, magnitude = 0;
        if (q < c.n_valid)
          for (int h = 0; h < c.heads; ++h) {
            const double term = double(w[size_t(q * c.heads + h)]) * qs[size_t(q * c.heads + h)] * std::max(0.0f, D[size_t(key * 256 + q * c.hp + h)]);
            want += term;
            magnitude += std::fabs(term);
          }
        const float g = got[size_t(q * 64 + key)];
        ASSERT_FALSE(std::isnan(g)) << "hp " << c.hp << " query " << q << " key " << key << ": no lane holds it";
        // each ReLU rounded to bf16 (within 2^-8 of it), the weight's hi + lo within 2^-16 of it, f32 sums
        const double allowance = std::ldexp(magnitude, -8) * (1 + std::ldexp(1.0, -7)) + 1e-6 * magnitude;
        if (magnitude > 0) worst = std::max(worst, std::fabs(g - want) / allowance);
        EXPECT_LE(std::fabs(g - want), allowance) << "hp " << c.hp << " heads " << c.heads << " query " << q << " key " << key << ": " << g << " against " << want;
        if (q >= c.n_valid) {
          EXPECT_EQ(g, 0.0f) << "a query past the chunk sums nothing";
        }
      }
    std::printf("keys kernel fragments, HP %d, %d heads, %d queries: worst error %.3g of the bf16 allowance\n", c.hp, c.heads, c.n_valid, worst);
  }
#else
  GTEST_SKIP() << "a build without the CUDA toolkit (the fragments' headers are CUDA's)";
#endif
}

}  // namespace pdb
