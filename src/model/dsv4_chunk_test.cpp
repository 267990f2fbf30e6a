// The DeepSeek-V4 GPU engine's default chunk (model/dsv4_chunk.h): host arithmetic, any machine.
#include "model/dsv4_chunk.h"

#include <gtest/gtest.h>

namespace pdb {

TEST(Dsv4Chunk, RowBytesGrowWithTheModelAndItsLayers) {
  const auto flash = Deepseek4Config::preset("v4-flash"), tiny = Deepseek4Config::preset("tiny");
  const int64_t f = dsv4_cuda_bytes_per_chunk_row(flash), t = dsv4_cuda_bytes_per_chunk_row(tiny);
  // V4-Flash: ~0.77 MB of buffers per row and ~0.34 MB of its 43 layers' windows and rings: a 32K chunk ~36 GB
  EXPECT_GT(f, 800'000);
  EXPECT_LT(f, 1'200'000);
  EXPECT_LT(t, f / 10);
  auto fewer = flash;
  fewer.compress_ratios = {0, 4, 128};
  EXPECT_LT(dsv4_cuda_bytes_per_chunk_row(fewer), f);
  EXPECT_GT(dsv4_cuda_bytes_per_chunk_row(fewer), f / 2);
}

TEST(Dsv4Chunk, TheLargestChunkThatFitsTheFreeMemory) {
  const int64_t row = 1'000'000, gb = int64_t(1) << 30;
  EXPECT_EQ(dsv4_cuda_largest_chunk(row, 80 * gb), 32768);  // 32.8 GB <= 0.6 x 80 GiB
  EXPECT_EQ(dsv4_cuda_largest_chunk(row, 40 * gb), 16384);
  EXPECT_EQ(dsv4_cuda_largest_chunk(row, 20 * gb), 8192);
  EXPECT_EQ(dsv4_cuda_largest_chunk(row, 2 * gb), 4096);   // nothing larger fits: the server's default
  EXPECT_EQ(dsv4_cuda_largest_chunk(row, 0), 4096);
  EXPECT_EQ(dsv4_cuda_largest_chunk(row, 80 * gb, 8192), 8192);  // never past the cap
}

}  // namespace pdb
