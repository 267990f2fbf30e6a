#include "model/tensor_parallel.h"

#include <fmt/format.h>

#include "formats/hf_config.h"

namespace pdb {

TpShard tp_shard(int64_t heads, int64_t kv_heads, int64_t ff, int64_t expert_ff, int rank, int world, int64_t align) {
  if (world < 1 || rank < 0 || rank >= world) throw std::invalid_argument(fmt::format("tensor parallel: rank {} of {}", rank, world));
  auto split = [&](int64_t n, int64_t unit, const char* what) {
    if (n % world || (n / world) % unit)
      throw std::invalid_argument(fmt::format("tensor parallel {}: the model's {} ({}) do not split into {} slices{}", world, what, n, world,
                                              unit > 1 ? fmt::format(" of a multiple of {}", unit) : std::string()));
    return n / world;
  };
  TpShard s;
  s.rank = rank;
  s.world = world;
  s.q_heads = split(heads, 1, "attention heads");
  s.kv_heads = split(kv_heads, 1, "kv heads");
  s.q_head0 = s.q_heads * rank;
  s.kv_head0 = s.kv_heads * rank;
  if (ff > 0) {
    s.ff = split(ff, align, "FFN columns");
    s.ff0 = s.ff * rank;
  }
  if (expert_ff > 0) {
    s.expert_ff = split(expert_ff, align, "expert FFN columns");
    s.expert_ff0 = s.expert_ff * rank;
  }
  return s;
}

TpShard tp_shard(const HfConfig& c, int rank, int world, int64_t align) {
  if (c.mla() && world > 1) throw std::invalid_argument("tensor parallel: MLA (deepseek2) is not split by heads yet");
  return tp_shard(c.num_heads, c.num_kv_heads, c.moe() ? 0 : c.intermediate_size, c.moe() ? c.moe_intermediate_size : 0, rank, world, align);
}

}  // namespace pdb
