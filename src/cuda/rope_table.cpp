#include "cuda/rope_table.h"

#include <algorithm>
#include <cstring>

#include "common/parallel.h"

namespace pdb::cuda {

void RopeTable::upload(int64_t pos0, int64_t rows, float* dst, cudaStream_t s) {
  const size_t nd = size_t(p_.n_dims);
  if (pos0 + rows > rows_) {  // grown, and filled past what earlier prompts reached
    const int64_t need = (pos0 + rows + 4095) / 4096 * 4096, grown = std::max(need, std::min(2 * rows_, need + (int64_t(1) << 18)));
    PinnedBuffer table(size_t(grown) * nd * 4);
    PDB_CUDA_CHECK(cudaDeviceSynchronize());  // no copy from the old table is in flight when it is freed
    if (rows_) std::memcpy(table.as<float>(), table_.as<float>(), size_t(rows_) * nd * 4);
    float* t = table.as<float>();
    parallel_for(grown - rows_, threads_, [&, from = rows_](int64_t b, int64_t e) {
      for (int64_t i = from + b; i < from + e; ++i) ggml_rope_cache(p_, i, t + size_t(i) * nd);
    });
    table_ = std::move(table);
    rows_ = grown;
  }
  PDB_CUDA_CHECK(cudaMemcpyAsync(dst, table_.as<float>() + size_t(pos0) * nd, size_t(rows) * nd * 4, cudaMemcpyHostToDevice, s));
}

}  // namespace pdb::cuda
