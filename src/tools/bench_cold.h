// `pdbridge bench cold` / `bench plot`: the seed's cold-prompt protocol. Documents of shuffled Python
// standard-library sources with a ZEBRA-<seed>-<n> marker in the middle, a fresh seed per run, the
// native leg straight to the decoder and the bridged leg through the front door, streaming, T=0.
#pragma once
#include <string>
#include <vector>

namespace pdb {

struct BenchColdOptions {
  std::string front_url, native_url, out = "bench-cold.jsonl", corpus_dir, api_key;
  std::vector<int64_t> chars = {32000};
  int runs = 3, max_tokens = 300;
  int stop_after = 0;  // >0: hang up after this many streamed pieces (TTFT runs at very long contexts)
  uint64_t seed = 0;  // 0: from the clock (fresh seeds every invocation)
  bool skip_native = false;
  bool skip_bridged = false;  // only the native leg (a baseline where bridged rows exist already)
};

int run_bench_cold(const BenchColdOptions& o);

// One cold needle prompt of the protocol (what bench cold, make demo and the shipped model's tests
// send): `text` is the user message, `marker` the right answer.
struct NeedleDocument { std::string text, marker; };
NeedleDocument make_needle_document(int64_t chars, uint64_t seed, const std::string& corpus_dir = "");
int run_bench_plot(const std::string& jsonl, const std::string& png);

}  // namespace pdb
