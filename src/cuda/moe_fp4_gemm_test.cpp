// The products that read FP4 codes (cuda/moe_fp4_gemm.cuh) against their CPU twin: ggml's MXFP4 dequantization
// (formats/ggml_types) and an f64 product. Identity rows make each output a weight, so the expansion inside the
// tiles is checked bit for bit over the whole E8M0 range (both of its multiply paths, the denormal scales); random
// rows check the grouped products themselves (experts with 0, 1, 127, 128 and 300 rows, gate and up taken apart
// into one matrix's halves as the engine does, one and several k-steps). Skips without an sm_90 GPU; the tiles'
// layout is checked on any machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/moe_tiles.h"
#include "formats/ggml_types.h"
#ifdef PDBRIDGE_HAVE_CUDA
#include "cuda/common.cuh"
#include "cuda/kernel_test_support.h"
#include "cuda/dsv4.cuh"
#include "cuda/fp4_expand.cuh"
#include "cuda/grouped_gemm.cuh"
#include "cuda/moe.cuh"
#include "cuda/moe_fp4_gemm.cuh"
#endif

namespace pdb {
namespace {

// Both of the products' shapes (cuda/moe_tiles.h), each test run under each.
constexpr cuda::Fp4Shape kShapes[] = {cuda::Fp4Shape::kRows256, cuda::Fp4Shape::kOutputs256};
std::string shape_name(cuda::Fp4Shape s) { return s == cuda::Fp4Shape::kRows256 ? "rows256" : "outputs256"; }

}  // namespace

#ifdef PDBRIDGE_HAVE_CUDA
namespace {

using namespace test_kernels;

struct Fp4Device {
  cuda::DeviceBuffer codes, scales;
  cuda::Fp4Matrices m;
  Fp4Device(int64_t experts, int64_t rows, int64_t cols) : codes(size_t(experts * rows * cols / 2)), scales(size_t(experts * rows * cols / 32)) {
    m = {codes.as<uint8_t>(), scales.as<uint8_t>(), experts, rows, cols};
  }
};

// `experts` matrices [rows x cols] of MXFP4 blocks; block b's E8M0 byte from exps (cycled), codes random
std::vector<uint8_t> fp4_blocks(int64_t experts, int64_t rows, int64_t cols, const std::vector<uint8_t>& exps) {
  std::vector<uint8_t> b(size_t(experts * rows * cols / 32) * 17);
  for (size_t i = 0; i < b.size() / 17; ++i) {
    b[i * 17] = exps[i % exps.size()];
    for (int j = 1; j < 17; ++j) b[i * 17 + j] = uint8_t(rng()());
  }
  return b;
}

std::vector<float> dequantized(const std::vector<uint8_t>& blocks) {
  std::vector<float> w(blocks.size() / 17 * 32);
  dequantize_row(GgmlType::MXFP4, blocks.data(), w.data(), int64_t(w.size()));
  return w;
}

cuda::DeviceBuffer upload(const std::vector<uint8_t>& v) {
  cuda::DeviceBuffer d(v.size());
  d.upload(v.data(), v.size());
  return d;
}

cuda::DeviceBuffer upload_tiles(const std::vector<cuda::Fp4Tile>& t) {
  cuda::DeviceBuffer d(t.size() * sizeof(cuda::Fp4Tile));
  d.upload(t.data(), t.size() * sizeof(cuda::Fp4Tile));
  return d;
}

}  // namespace
#endif

#ifdef PDBRIDGE_HAVE_CUDA
namespace {

// Experts of `counts` rows, gate and up ([half x k] each) taken apart into the halves of one [2 half x k] matrix per
// expert as the engine does, random rows; each kernel's products against the f64 product of ggml's dequantization.
void check_grouped_products(const std::vector<int32_t>& counts, int64_t half, int64_t k) {
  const int64_t experts = int64_t(counts.size()), n = 2 * half;
  int64_t g = 0;
  for (int32_t c : counts) g += c;
  const std::vector<uint8_t> exps = {118, 119, 120, 121, 122};  // weights of magnitude ~2^-8 .. 2^-3
  const auto gate = fp4_blocks(experts, half, k, exps), up = fp4_blocks(experts, half, k, exps);
  const auto wg = dequantized(gate), wu = dequantized(up);
  auto dg = upload(gate), du = upload(up);
  Fp4Device d(experts, n, k);
  d.m.wide_scales = cuda::repack_mxfp4(dg.as<uint8_t>(), half, 0, d.m, nullptr);
  d.m.wide_scales |= cuda::repack_mxfp4(du.as<uint8_t>(), half, half, d.m, nullptr);
  EXPECT_FALSE(d.m.wide_scales) << "scales of 118 .. 122 were repacked";
  const auto x = round_bf16(randn(size_t(g * k)));
  auto dx = to_device_bf16(x);
  std::vector<double> want(size_t(g * n));
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (int32_t r = 0; r < counts[size_t(e)]; ++r, ++row)
      for (int64_t o = 0; o < n; ++o) {
        const float* wr = o < half ? wg.data() + (e * half + o) * k : wu.data() + (e * half + o - half) * k;
        double sum = 0;
        for (int64_t i = 0; i < k; ++i) sum += double(x[size_t(row * k + i)]) * wr[i];
        want[size_t(row * n + o)] = sum;
      }
  for (const cuda::Fp4Shape shape : kShapes) {
    const std::string kernel = shape_name(shape);
    const auto tiles = cuda::fp4_tiles(counts.data(), experts, shape);
    auto dt = upload_tiles(tiles);
    auto y = poisoned(size_t(g * n) * 2);
    cuda::moe_fp4_products(dx.as<__nv_bfloat16>(), d.m, dt.as<cuda::Fp4Tile>(), int64_t(tiles.size()), shape, y.as<__nv_bfloat16>(), nullptr);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = from_device_bf16(y, size_t(g * n));
    double err2 = 0, ref2 = 0, worst_excess = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      const double gv = got[i], wv = want[i];
      ASSERT_TRUE(std::isfinite(gv)) << kernel << ": row " << i / size_t(n) << " output " << i % size_t(n);
      err2 += (gv - wv) * (gv - wv);
      ref2 += wv * wv;
      // one bf16 rounding of an f32 sum: within 2^-8 of the value, plus the sum's order
      worst_excess = std::max(worst_excess, std::fabs(gv - wv) - std::ldexp(std::fabs(wv), -8));
    }
    const double rel = std::sqrt(err2 / ref2), rms = std::sqrt(ref2 / double(g * n));
    std::printf("FP4 grouped products (%s), %zu tiles x %lld outputs, k=%lld: rel RMS %.2e, worst excess over one bf16 rounding %.2e (output RMS %.2e)\n",
                kernel.c_str(), tiles.size(), (long long)n, (long long)k, rel, worst_excess, rms);
    EXPECT_LT(rel, 3e-3) << kernel;
    EXPECT_LT(worst_excess, 1e-4 * rms * std::sqrt(double(k))) << kernel;
  }
}

}  // namespace
#endif

// The tiles cover every routed row once, in order, each within one expert and at most the shape's rows long (CPU).
TEST(MoeTiles, EveryRowOnceWithinItsExpertInOrder) {
  const std::vector<int32_t> counts = {0, 1, 127, 128, 129, 0, 300, 256, 257, 700};
  for (const cuda::Fp4Shape shape : kShapes) {
    SCOPED_TRACE(shape_name(shape));
    const int32_t most = cuda::fp4_tile_rows(shape);
    EXPECT_EQ(most * cuda::fp4_tile_outputs(shape), 256 * 128) << "both shapes are one CTA's 32K accumulators";
    const auto tiles = cuda::fp4_tiles(counts.data(), int64_t(counts.size()), shape);
    size_t want = 0;
    for (int32_t c : counts) want += size_t((c + most - 1) / most);
    ASSERT_EQ(tiles.size(), want) << "each expert's rows in as few tiles as hold them";
    int32_t next = 0, first_of_expert = 0;
    int64_t e_prev = -1;
    for (const auto& t : tiles) {
      EXPECT_EQ(t.row0, next) << "tiles leave a gap or overlap";
      EXPECT_GE(t.rows, 1);
      EXPECT_LE(t.rows, most);
      ASSERT_GE(t.expert, e_prev) << "experts out of order";
      if (t.expert != e_prev) {
        first_of_expert = 0;
        for (int64_t e = 0; e < t.expert; ++e) first_of_expert += counts[size_t(e)];
        EXPECT_EQ(t.row0, first_of_expert) << "expert " << t.expert << " starts elsewhere";
        e_prev = t.expert;
      }
      EXPECT_LE(t.row0 + t.rows, first_of_expert + counts[size_t(t.expert)]) << "a tile runs into the next expert's rows";
      next = t.row0 + t.rows;
    }
    int32_t total = 0;
    for (int32_t c : counts) total += c;
    EXPECT_EQ(next, total);
  }
}

// The expansion's arithmetic (cuda/fp4_expand.cuh, run here on the host: the same functions the kernel inlines, its
// bf16 products as the exact f32 product rounded) against ggml's MXFP4 dequantization: every code under every E8M0
// byte, each lane's repacked word pair by pair, as bf16, bit for bit (CUDA builds; no GPU needed).
TEST(Fp4Expand, EveryCodeUnderEveryScaleIsGgmlsValueInBf16) {
#ifdef PDBRIDGE_HAVE_CUDA
  int64_t differ = 0;
  for (uint32_t e = 0; e < 256; ++e) {
    uint8_t block[17];
    block[0] = uint8_t(e);
    for (int j = 0; j < 16; ++j) block[1 + j] = uint8_t(j | ((15 - j) << 4));  // every code low and high
    float want[32];
    dequantize_row(GgmlType::MXFP4, block, want, 32);
    // the register path (the FP4 products' fragments): each lane's repacked word, pair by pair
    const cuda::Fp4PairScale ps = cuda::fp4_pair_scale(e);
    for (int q = 0; q < 4; ++q) {
      const uint32_t word = cuda::fp4_fragment_word(block + 1, q);
      for (int p = 0; p < 4; ++p) {
        const uint32_t pair = cuda::fp4_pair(word, p, ps);
        for (int h = 0; h < 2; ++h) {
          const int k = 2 * q + 8 * p + h;
          const uint32_t f32 = ((pair >> (16 * h)) & 0xffffu) << 16;
          float got;
          std::memcpy(&got, &f32, 4);
          if (!(got == want[k]) && differ++ < 5)
            ADD_FAILURE() << "E8M0 " << e << " element " << k << " (lane " << q << ", pair " << p << "): " << got << " != ggml's " << want[k];
        }
      }
    }
  }
  EXPECT_EQ(differ, 0);
#else
  GTEST_SKIP() << "a build without the CUDA toolkit (the expansion's headers are CUDA's)";
#endif
}

// The fused SwiGLU's pairing, on the host (CUDA builds; no GPU needed): for every gate and up row of a paired matrix
// at V4-Flash's width and a small one, the thread that holds its stored row in the products' epilogue (CTA of 128
// rows, warpgroup of 64, warp of 16, rows g and g + 8) holds the same feature's other row too, gate as its first.
TEST(Fp4Expand, GateUpPairsMeetInOneThreadOfTheEpilogue) {
#ifdef PDBRIDGE_HAVE_CUDA
  for (const int64_t half : {int64_t(64), int64_t(192), int64_t(2048)}) {
    cuda::Fp4Matrices m;
    m.rows = 2 * half;
    m.gate_up_pairs = true;
    std::vector<int> seen(static_cast<size_t>(m.rows), 0);
    for (int64_t n = 0; n < m.rows; ++n) {
      const int64_t p = cuda::fp4_stored_row(n, m), j = n % half;
      ASSERT_GE(p, 0);
      ASSERT_LT(p, m.rows);
      ++seen[size_t(p)];
      const int64_t n0 = p / 128 * 128, wg = p % 128 / 64, warp = p % 64 / 16;
      const int g = int(p % 8);
      const bool second = p % 16 >= 8;
      EXPECT_EQ(cuda::fp4_pair_feature(n0 + 64 * wg + 16 * warp, g), j) << "half " << half << ", logical row " << n << " stored at " << p;
      EXPECT_EQ(second, n >= half) << "half " << half << ", logical row " << n << ": gate must be the thread's first row, up its second";
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), m.rows) << "every stored row holds one logical row";
    m.gate_up_pairs = false;
    for (int64_t n = 0; n < m.rows; ++n) EXPECT_EQ(cuda::fp4_stored_row(n, m), n);
  }
#else
  GTEST_SKIP() << "a build without the CUDA toolkit (the products' headers are CUDA's)";
#endif
}

TEST(CudaMoeFp4, IdentityRowsGiveEachWeightBitForBit) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  if (!cuda::moe_fp4_products_supported(256, 128)) GTEST_SKIP() << "needs an sm_90 GPU: " << cuda::device_summary();
  // k identity rows per expert: one tile each (rows256: multiplied as 128 token rows and as 256; outputs256: as 64,
  // as 128, and two tiles of 128), 128 outputs (outputs256: its second warpgroup without outputs)
  // E8M0 bytes across the range: denormal scales (1, 2), ordinary ones, the last whose first product is 2^(e-1)
  // (128) and the ones past it, 2^127 then 2^(e-128) (codes with |value| <= 12 x 2^122 stay finite there); and the
  // same up to 128 alone, the kernel's one-product form (its scales made by a byte permute)
  for (const bool wide : {true, false})
  for (const int64_t k : {int64_t(64), int64_t(128), int64_t(256)}) {
    const int64_t experts = 2, n = 128;
    const std::vector<uint8_t> exps = wide ? std::vector<uint8_t>{1, 2, 60, 100, 120, 127, 128, 133, 200, 248, 249, 250}
                                           : std::vector<uint8_t>{1, 2, 60, 100, 120, 121, 126, 127, 128};
    auto blocks = fp4_blocks(experts, n, k, exps);
    const auto w = dequantized(blocks);
    auto db = upload(blocks);
    Fp4Device d(experts, n, k);
    d.m.wide_scales = cuda::repack_mxfp4(db.as<uint8_t>(), n, 0, d.m, nullptr);
    EXPECT_EQ(d.m.wide_scales, wide) << "scales up to " << int(exps.back()) << " were repacked";
    std::vector<float> x(size_t(experts * k * k), 0.0f);  // expert e's k rows: the identity
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t i = 0; i < k; ++i) x[size_t((e * k + i) * k + i)] = 1.0f;
    auto dx = to_device_bf16(x);
    const std::vector<int32_t> counts = {int32_t(k), int32_t(k)};
    for (const cuda::Fp4Shape shape : kShapes) {
      const auto tiles = cuda::fp4_tiles(counts.data(), experts, shape);
      auto dt = upload_tiles(tiles);
      const std::string kernel = shape_name(shape) + ", " + std::to_string(k) + " rows an expert, scales up to " + std::to_string(exps.back());
      auto y = poisoned(size_t(experts * k * n) * 2);
      cuda::moe_fp4_products(dx.as<__nv_bfloat16>(), d.m, dt.as<cuda::Fp4Tile>(), int64_t(tiles.size()), shape, y.as<__nv_bfloat16>(), nullptr);
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = from_device_bf16(y, size_t(experts * k * n));
      int64_t differ = 0;
      for (int64_t e = 0; e < experts; ++e)
        for (int64_t i = 0; i < k; ++i)
          for (int64_t o = 0; o < n; ++o) {
            const float want = w[size_t((e * n + o) * k + i)], g = got[size_t((e * k + i) * n + o)];
            if (!(g == want)) {
              if (differ++ < 5) ADD_FAILURE() << kernel << ": expert " << e << " weight (" << o << ", " << i << "): " << g << " != " << want;
            }
          }
      EXPECT_EQ(differ, 0) << kernel;
    }
  }
#endif
}


TEST(CudaMoeFp4, GroupedProductsMatchTheF64ProductOfTheDequantizedWeights) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  if (!cuda::moe_fp4_products_supported(64, 128)) GTEST_SKIP() << "needs an sm_90 GPU: " << cuda::device_summary();
  // rows256: tiles of 1, 127 and 128 rows (multiplied as 128), 256 and 44 (the 300), 200 (multiplied as 256);
  // outputs256: 1 (as 64), 127, 128, 128 + 128 + 44 (as 64), 128 + 72 (as 128)
  const std::vector<int32_t> counts = {0, 1, 127, 128, 300, 200};
  ASSERT_EQ(cuda::fp4_tiles(counts.data(), int64_t(counts.size()), cuda::Fp4Shape::kRows256).size(), size_t(0 + 1 + 1 + 1 + 2 + 1));
  ASSERT_EQ(cuda::fp4_tiles(counts.data(), int64_t(counts.size()), cuda::Fp4Shape::kOutputs256).size(), size_t(0 + 1 + 1 + 1 + 3 + 2));
  for (const int64_t k : {int64_t(64), int64_t(512)}) check_grouped_products(counts, 128, k);
#endif
}

// Many tiles of 16-row code groups across 1,024 outputs: every (tile, 128 or 256 outputs) CTA of a launch that fills
// the GPU more than once reads its own groups of the repacked codes.
TEST(CudaMoeFp4, ManyTilesAcrossManyOutputGroups) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  if (!cuda::moe_fp4_products_supported(128, 1024)) GTEST_SKIP() << "needs an sm_90 GPU: " << cuda::device_summary();
  const std::vector<int32_t> counts = {2000, 77, 2100, 0, 1900};
  const int64_t items = int64_t(cuda::fp4_tiles(counts.data(), int64_t(counts.size()), cuda::Fp4Shape::kOutputs256).size()) * 4;
  ASSERT_GT(items, int64_t(cuda::multiprocessor_count())) << "the case must fill the GPU more than once";
  check_grouped_products(counts, 512, 128);
#endif
}

// The fused gate|up products (PDBRIDGE_DSV4_FP4_FUSE=1) against the three steps they replace, on the GPU: each token's
// rows gathered (gather_rows), the products into [gate | up] halves, the clamped SwiGLU (swiglu_clamp_rows). Tokens
// routed by moe_group as the engine routes them (skewed: tiles of 256 and of fewer, an expert without rows); with
// and without the clamp. The same bf16 bits everywhere: the fusion moves work, not arithmetic.
TEST(CudaMoeFp4, FusedGateUpIsTheGatherProductsAndSwigluBitForBit) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
#ifdef PDBRIDGE_HAVE_CUDA
  const int64_t experts = 6, half = 192, n = 2 * half, k = 256, tokens = 700, K = 3, g = tokens * K;
  if (!cuda::moe_fp4_products_supported(k, n)) GTEST_SKIP() << "needs an sm_90 GPU: " << cuda::device_summary();
  // each token's K distinct experts, expert 0 the likeliest and expert 5 never chosen
  std::vector<int32_t> choice(static_cast<size_t>(g));
  std::discrete_distribution<int> pick({8.0, 3.0, 2.0, 1.0, 0.3, 0.0});
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < K; ++j) {
      int e;
      do e = pick(rng()); while (std::find(choice.begin() + t * K, choice.begin() + t * K + j, e) != choice.begin() + t * K + j);
      choice[size_t(t * K + j)] = e;
    }
  cuda::DeviceBuffer dchoice(choice.size() * 4), counts(size_t(experts) * 4), offsets(size_t(experts) * 4), slot_of(size_t(g) * 4), token_of(size_t(g) * 4);
  dchoice.upload(choice.data(), choice.size() * 4);
  cuda::moe_group(dchoice.as<int32_t>(), tokens, int(K), int(experts), counts.as<int32_t>(), offsets.as<int32_t>(), slot_of.as<int32_t>(),
                  token_of.as<int32_t>(), nullptr);
  std::vector<int32_t> cnt(static_cast<size_t>(experts));
  counts.download(cnt.data(), cnt.size() * 4);
  auto dx = to_device_bf16(round_bf16(randn(size_t(tokens * k))));
  cuda::DeviceBuffer xg(size_t(g * k) * 2), gu(size_t(g * n) * 2);
  cuda::gather_rows(dx.as<__nv_bfloat16>(), token_of.as<int32_t>(), g, k, xg.as<__nv_bfloat16>(), nullptr);
  for (const cuda::Fp4Shape shape : kShapes) {
    const auto tiles = cuda::fp4_tiles(cnt.data(), experts, shape);
    bool short_tile = false, long_tile = false;
    for (const auto& t : tiles) (t.rows > cuda::fp4_tile_rows(shape) / 2 ? long_tile : short_tile) = true;
    ASSERT_TRUE(long_tile && cnt[5] == 0) << shape_name(shape) << ": the routing must give full tiles and an expert without rows";
    if (shape == cuda::Fp4Shape::kRows256) {
      ASSERT_TRUE(short_tile) << "the routing must give rows256 tiles of at most 128 rows";
    }
    auto dt = upload_tiles(tiles);
    // both of the kernel's scale paths: scales below 2^0 (real weights'), and some past it
    for (const bool wide : {false, true}) {
      const std::vector<uint8_t> exps = wide ? std::vector<uint8_t>{118, 120, 129, 131} : std::vector<uint8_t>{118, 119, 120, 121, 122};
      const auto gate = fp4_blocks(experts, half, k, exps), up = fp4_blocks(experts, half, k, exps);
      auto dg = upload(gate), du = upload(up);
      Fp4Device plain(experts, n, k), pairs(experts, n, k);
      pairs.m.gate_up_pairs = true;
      for (Fp4Device* d : {&plain, &pairs}) {
        d->m.wide_scales = cuda::repack_mxfp4(dg.as<uint8_t>(), half, 0, d->m, nullptr) | cuda::repack_mxfp4(du.as<uint8_t>(), half, half, d->m, nullptr);
        EXPECT_EQ(d->m.wide_scales, wide);
      }
      cuda::moe_fp4_products(xg.as<__nv_bfloat16>(), plain.m, dt.as<cuda::Fp4Tile>(), int64_t(tiles.size()), shape, gu.as<__nv_bfloat16>(), nullptr);
      const auto gu_host = from_device_bf16(gu, size_t(g * n));
      for (const float limit : {0.0f, 0.5f}) {
        const std::string name = shape_name(shape) + ", " + (wide ? "scales past 2^0" : "scales below 2^0") + ", limit " + std::to_string(limit);
        auto want = poisoned(size_t(g * half) * 2), got = poisoned(size_t(g * half) * 2);
        cuda::swiglu_clamp_rows(gu.as<__nv_bfloat16>(), want.as<__nv_bfloat16>(), g, half, limit, nullptr);
        cuda::moe_fp4_products(dx.as<__nv_bfloat16>(), pairs.m, dt.as<cuda::Fp4Tile>(), int64_t(tiles.size()), shape, got.as<__nv_bfloat16>(), nullptr,
                               {token_of.as<int32_t>(), true, limit});
        PDB_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<uint16_t> a(size_t(g * half)), b(size_t(g * half));
        want.download(a.data(), a.size() * 2);
        got.download(b.data(), b.size() * 2);
        int64_t differ = 0, clamped = 0;
        for (size_t i = 0; i < a.size(); ++i) {
          const size_t r = i / size_t(half), f = i % size_t(half);
          clamped += limit > 0 && (gu_host[r * size_t(n) + f] > limit || std::fabs(gu_host[r * size_t(n) + size_t(half) + f]) > limit);
          if (a[i] != b[i] && differ++ < 5) ADD_FAILURE() << name << ": grouped row " << r << " feature " << f << ": fused bits " << b[i] << " != " << a[i];
        }
        EXPECT_EQ(differ, 0) << name;
        if (limit > 0) {
          EXPECT_GT(clamped, g * half / 20) << name << ": the clamp must bite for the case to check it";
        }
      }
      // the fused form only as a whole: paired weights without the epilogue, or the epilogue without the gather, refused
      EXPECT_THROW(cuda::moe_fp4_products(xg.as<__nv_bfloat16>(), pairs.m, dt.as<cuda::Fp4Tile>(), int64_t(tiles.size()), shape, gu.as<__nv_bfloat16>(), nullptr),
                   std::invalid_argument);
      EXPECT_THROW(cuda::moe_fp4_products(xg.as<__nv_bfloat16>(), pairs.m, dt.as<cuda::Fp4Tile>(), int64_t(tiles.size()), shape, gu.as<__nv_bfloat16>(), nullptr,
                                          {nullptr, true, 0.0f}),
                   std::invalid_argument);
    }
  }
#endif
}

// A benchmark, run on request (PDBRIDGE_BENCH=1; the H200 figures in docs/RESULTS.md): one DeepSeek-V4-Flash layer's
// routed products at a 32K-token chunk (256 experts of 2048 x 4096, top 6, uniform and skewed routing), from the FP4
// codes (both shapes, alternating) against the path they replace in the same process: every expert expanded to bf16
// (mxfp4_to_bf16, three launches) and one cuBLAS product per expert. CUDA events, median of 5 after a warm-up; TFLOP/s
// of the routed rows.
TEST(CudaBench, MoeFp4ProductsAtV4FlashShapes) {
  if (cuda::device_count() == 0) GTEST_SKIP() << cuda::device_summary();
  const char* on = std::getenv("PDBRIDGE_BENCH");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "a benchmark: PDBRIDGE_BENCH=1 runs it";
#ifdef PDBRIDGE_HAVE_CUDA
  if (!cuda::moe_fp4_products_supported(4096, 4096)) GTEST_SKIP() << "needs an sm_90 GPU";
  const int64_t NE = 256, E = 4096, F = 2048, K = 6, T = 32768, g = T * K;
  cuda::DeviceBuffer gate(size_t(NE * F * E / 32) * 17), up(size_t(NE * F * E / 32) * 17), down(size_t(NE * E * F / 32) * 17);
  cuda::fill_random_mxfp4(gate.as<uint8_t>(), NE * F * E / 32, 1, 120, nullptr);
  cuda::fill_random_mxfp4(up.as<uint8_t>(), NE * F * E / 32, 2, 120, nullptr);
  cuda::fill_random_mxfp4(down.as<uint8_t>(), NE * E * F / 32, 3, 120, nullptr);
  Fp4Device gu4(NE, 2 * F, E), dn4(NE, E, F);
  gu4.m.wide_scales = cuda::repack_mxfp4(gate.as<uint8_t>(), F, 0, gu4.m, nullptr) | cuda::repack_mxfp4(up.as<uint8_t>(), F, F, gu4.m, nullptr);
  dn4.m.wide_scales = cuda::repack_mxfp4(down.as<uint8_t>(), E, 0, dn4.m, nullptr);
  cuda::DeviceBuffer x(size_t(g * E) * 2), gu(size_t(g * 2 * F) * 2), act(size_t(g * F) * 2), yexp(size_t(g * E) * 2);
  cuda::DeviceBuffer gu16(size_t(NE * 2 * F * E) * 2), dn16(size_t(NE * E * F) * 2);
  cuda::fill_random_bf16(x.as<__nv_bfloat16>(), g * E, 4, 1.0f, nullptr);
  cuda::fill_random_bf16(act.as<__nv_bfloat16>(), g * F, 5, 1.0f, nullptr);
  cuda::GroupedGemm per_expert(true);
  // the whole routed step as the engine runs it, gather to down, unfused and fused (PDBRIDGE_DSV4_FP4_FUSE=1): the
  // chunk's token rows and each grouped row's token (any token: the loads' addresses are what differs)
  Fp4Device gu4p(NE, 2 * F, E);
  gu4p.m.gate_up_pairs = true;
  gu4p.m.wide_scales = cuda::repack_mxfp4(gate.as<uint8_t>(), F, 0, gu4p.m, nullptr) | cuda::repack_mxfp4(up.as<uint8_t>(), F, F, gu4p.m, nullptr);
  cuda::DeviceBuffer hn(size_t(T * E) * 2), token_of(size_t(g) * 4);
  cuda::fill_random_bf16(hn.as<__nv_bfloat16>(), T * E, 6, 1.0f, nullptr);
  {
    std::vector<int32_t> tok(static_cast<size_t>(g));
    std::mt19937 r(12);
    for (auto& t : tok) t = int32_t(r() % uint32_t(T));
    token_of.upload(tok.data(), tok.size() * 4);
  }
  const double flops = 2.0 * double(g) * 3.0 * double(F) * double(E);
  for (const bool skewed : {false, true}) {
    std::vector<double> weight(static_cast<size_t>(NE));
    for (int64_t e = 0; e < NE; ++e) weight[size_t(e)] = skewed ? std::pow(double(e + 1), -0.6) : 1.0;
    std::discrete_distribution<int> pick(weight.begin(), weight.end());
    std::mt19937 r(11);
    std::vector<int32_t> counts(static_cast<size_t>(NE), 0);
    for (int64_t i = 0; i < g; ++i) ++counts[size_t(pick(r))];
    std::vector<cuda::GroupedProduct> p_up(static_cast<size_t>(NE)), p_down(static_cast<size_t>(NE));
    int64_t off = 0;
    for (int64_t e = 0; e < NE; ++e) {
      p_up[size_t(e)] = {x.as<__nv_bfloat16>() + off * E, gu16.as<__nv_bfloat16>() + e * 2 * F * E, gu.as<__nv_bfloat16>() + off * 2 * F, counts[size_t(e)]};
      p_down[size_t(e)] = {act.as<__nv_bfloat16>() + off * F, dn16.as<__nv_bfloat16>() + e * E * F, yexp.as<__nv_bfloat16>() + off * E, counts[size_t(e)]};
      off += counts[size_t(e)];
    }
    auto expand = [&] {
      const int64_t blocks_fe = F * E / 32, per = NE * blocks_fe;
      cuda::mxfp4_to_bf16(gate.as<uint8_t>(), per, gu16.as<__nv_bfloat16>(), nullptr, blocks_fe, 2 * F * E);
      cuda::mxfp4_to_bf16(up.as<uint8_t>(), per, gu16.as<__nv_bfloat16>() + F * E, nullptr, blocks_fe, 2 * F * E);
      cuda::mxfp4_to_bf16(down.as<uint8_t>(), per, dn16.as<__nv_bfloat16>(), nullptr);
    };
    auto cublas = [&] {
      per_expert.xwt(p_up, E, 2 * F, cuda::DType::BF16, nullptr);
      per_expert.xwt(p_down, F, E, cuda::DType::BF16, nullptr);
    };
    auto median_ms = [&](auto&& fn) {
      fn();
      PDB_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<double> t;
      for (int i = 0; i < 5; ++i) t.push_back(mean_ms(1, fn));
      std::sort(t.begin(), t.end());
      return t[2];
    };
    const double t_expand = median_ms(expand), t_cublas = median_ms(cublas);
    int64_t largest = 0;
    for (int32_t c : counts) largest = std::max<int64_t>(largest, c);
    const char* routing = skewed ? "skewed" : "uniform";
    std::printf("MOE FP4 V4-Flash layer, %s routing (largest expert %lld rows): expansion %.2f ms + cuBLAS per expert %.2f ms (%.0f TFLOP/s) = %.2f ms\n",
                routing, (long long)largest, t_expand, t_cublas, flops / (t_cublas * 1e-3) / 1e12, t_expand + t_cublas);
    // each shape twice, alternating (rows256, outputs256, rows256, outputs256): the second round says whether the
    // first one's order mattered
    for (int round = 0; round < 2; ++round)
      for (const cuda::Fp4Shape shape : kShapes) {
        const auto tiles = cuda::fp4_tiles(counts.data(), NE, shape);
        auto dt = upload_tiles(tiles);
        const auto* dtp = dt.as<cuda::Fp4Tile>();
        const int64_t n = int64_t(tiles.size());
        auto fp4 = [&] {
          cuda::moe_fp4_products(x.as<__nv_bfloat16>(), gu4.m, dtp, n, shape, gu.as<__nv_bfloat16>(), nullptr);
          cuda::moe_fp4_products(act.as<__nv_bfloat16>(), dn4.m, dtp, n, shape, yexp.as<__nv_bfloat16>(), nullptr);
        };
        auto step_unfused = [&] {
          cuda::gather_rows(hn.as<__nv_bfloat16>(), token_of.as<int32_t>(), g, E, x.as<__nv_bfloat16>(), nullptr);
          cuda::moe_fp4_products(x.as<__nv_bfloat16>(), gu4.m, dtp, n, shape, gu.as<__nv_bfloat16>(), nullptr);
          cuda::swiglu_clamp_rows(gu.as<__nv_bfloat16>(), act.as<__nv_bfloat16>(), g, F, 10.0f, nullptr);
          cuda::moe_fp4_products(act.as<__nv_bfloat16>(), dn4.m, dtp, n, shape, yexp.as<__nv_bfloat16>(), nullptr);
        };
        auto step_fused = [&] {
          cuda::moe_fp4_products(hn.as<__nv_bfloat16>(), gu4p.m, dtp, n, shape, act.as<__nv_bfloat16>(), nullptr, {token_of.as<int32_t>(), true, 10.0f});
          cuda::moe_fp4_products(act.as<__nv_bfloat16>(), dn4.m, dtp, n, shape, yexp.as<__nv_bfloat16>(), nullptr);
        };
        const double t_fp4 = median_ms(fp4), t_unfused = median_ms(step_unfused), t_fused = median_ms(step_fused);
        std::printf("MOE FP4 %s, %s routing, round %d (%zu tiles): FP4 products %.2f ms (%.0f TFLOP/s), against expansion + cuBLAS %.2fx; "
                    "step: gather + gate|up + SwiGLU + down %.2f ms, fused %.2f ms (%.3fx)\n",
                    shape_name(shape).c_str(), routing, round, tiles.size(), t_fp4, flops / (t_fp4 * 1e-3) / 1e12, (t_expand + t_cublas) / t_fp4,
                    t_unfused, t_fused, t_unfused / t_fused);
        std::fflush(stdout);
      }
  }
#endif
}

}  // namespace pdb
