// Writes valid seed inputs for the fuzzers: a small GGUF, a complete capture stream, a bridge
// request and a state file, so fuzzing starts from deep inside each format.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "formats/gguf.h"
#include "formats/state_file.h"
#include "formats/state_file_dsv4.h"
#include "wire/protocol.h"

namespace fs = std::filesystem;

static void write(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}
static std::vector<uint8_t> slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

int main(int argc, char** argv) {
  if (argc != 2) { std::fprintf(stderr, "usage: fuzz_seeds DIR\n"); return 2; }
  const std::string d = argv[1];
  for (auto s : {"fuzz_frames", "fuzz_gguf", "fuzz_requests", "fuzz_dsv4_state"}) fs::create_directories(d + "/corpus-" + s);
  // GGUF
  pdb::GgufWriter w;
  w.set("general.architecture", pdb::GgufValue::of_str("llama"));
  w.set("llama.block_count", pdb::GgufValue::of_u32(2));
  w.set("tokenizer.ggml.tokens", pdb::GgufValue::of_array(pdb::GgufType::STRING, {pdb::GgufValue::of_str("a"), pdb::GgufValue::of_str("b")}));
  w.add_tensor_bytes("x.weight", pdb::GgmlType::F32, {4, 2}, std::vector<uint8_t>(32, 0));
  w.add_tensor_bytes("q.weight", pdb::GgmlType::Q8_0, {32, 1}, std::vector<uint8_t>(34, 1));
  w.write(d + "/corpus-fuzz_gguf/seed.gguf");
  // capture streams matching the fuzz_frames layouts: 2 layers, 64-wide f16 rows, 8 tokens, fingerprint "fp";
  // a leading selector byte: 0 K and V sections, 1 K only (MLA)
  for (const bool k_only : {false, true}) {
    std::vector<uint8_t> s = {uint8_t(k_only ? 1 : 0)};
    pdb::wire::encode_json_frame(pdb::wire::FrameKind::Hello,
                                 {{"fingerprint", "fp"}, {"n_tokens", 8}, {"k_row_bytes", 128}, {"v_row_bytes", k_only ? 0 : 128}}, s);
    std::vector<uint8_t> rows(128 * 8, 0x3c);
    for (uint32_t l = 0; l < 2; ++l)
      for (auto k : {pdb::wire::FrameKind::K, pdb::wire::FrameKind::V}) {
        if (k_only && k == pdb::wire::FrameKind::V) continue;
        pdb::wire::FrameHeader h;
        h.kind = k; h.type = 1; h.layer = l; h.pos0 = 0; h.n_rows = 8;
        pdb::wire::encode_frame(h, rows.data(), rows.size(), s);
      }
    pdb::wire::encode_json_frame(pdb::wire::FrameKind::Trailer, {{"status", "complete"}, {"tokens", 8}}, s);
    write(d + (k_only ? "/corpus-fuzz_frames/seed-k-only.bin" : "/corpus-fuzz_frames/seed.bin"), s);
  }
  // request + state file
  pdb::wire::PrefillRequest r;
  r.tokens = {1, 2, 3};
  r.fingerprint = "fp";
  const std::string j = r.to_json().dump();
  write(d + "/corpus-fuzz_requests/request.json", std::vector<uint8_t>(j.begin(), j.end()));
  pdb::StateLayout L;
  for (int l = 0; l < 2; ++l) { pdb::StateLayerTypes t; t.n_embd_k = t.n_embd_v = 32; t.k_row_bytes = t.v_row_bytes = 64; L.layers.push_back(t); }
  {
    pdb::StateFileWriter sw(d + "/state.bin", L, {5, 6, 7}, 3);
    std::vector<uint8_t> row(64 * 3, 0);
    for (uint32_t l = 0; l < 2; ++l) { sw.write_k_rows(l, 0, 3, row.data()); sw.write_v_rows(l, 0, 3, row.data()); }
    sw.commit();
  }
  write(d + "/corpus-fuzz_requests/state.bin", slurp(d + "/state.bin"));
  fs::remove(d + "/state.bin");
  // an MLA state: K sections only, no V headers
  for (auto& t : L.layers) { t.n_embd_v = 0; t.v_row_bytes = 0; }
  {
    pdb::StateFileWriter sw(d + "/state.bin", L, {5, 6, 7}, 3);
    std::vector<uint8_t> row(64 * 3, 0);
    for (uint32_t l = 0; l < 2; ++l) sw.write_k_rows(l, 0, 3, row.data());
    sw.commit();
  }
  write(d + "/corpus-fuzz_requests/state-k-only.bin", slurp(d + "/state.bin"));
  fs::remove(d + "/state.bin");
  // a DeepSeek-V4 state as llama-server lays it out: 9 cells, a window of 8, layers with ratios [0, 4],
  // 2 CSA and LID rows, no HCA layer, the three rings
  std::vector<uint8_t> b;
  auto put = [&](auto v) { const auto* p = reinterpret_cast<const uint8_t*>(&v); b.insert(b.end(), p, p + sizeof v); };
  auto zeros = [&](size_t n) { b.insert(b.end(), n, 0); };
  put(pdb::kStateMagic); put(pdb::kStateVersion); put(uint32_t(9));
  for (int32_t t = 0; t < 9; ++t) put(int32_t(100 + t));
  put(pdb::kDsv4Magic); put(uint32_t(1)); put(uint32_t(0));
  for (int part = 0; part < 2; ++part) {  // base (no layers), then the window
    const uint32_t cells = part ? 8 : 9;
    put(uint32_t(1)); put(cells);
    for (uint32_t c = 0; c < cells; ++c) { put(int32_t(9 - cells + c)); put(uint32_t(1)); put(int32_t(0)); }
    put(uint32_t(0)); put(uint32_t(part ? 2 : 0));
    for (int l = 0; l < (part ? 2 : 0); ++l) { put(int32_t(1)); put(uint64_t(32)); zeros(32 * cells); }
  }
  for (int pool = 0; pool < 3; ++pool) {  // CSA, HCA, LID
    const uint32_t rows = pool == 1 ? 0 : 2, layers = pool == 1 ? 0 : 1, ne0 = pool == 2 ? 64 : 16;
    put(uint32_t(2)); put(rows); put(uint32_t(1)); put(layers);
    for (uint32_t l = 0; l < layers; ++l) { put(uint32_t(1)); put(int32_t(1)); put(uint64_t(ne0)); put(uint64_t(rows)); put(uint64_t(2 * ne0)); zeros(2 * ne0 * rows); }
  }
  for (int ring = 0; ring < 3; ++ring) {
    const uint32_t ratio = ring == 1 ? 128 : 4, size = ring == 1 ? 128 : 8, embd = ring == 2 ? 128 : 32, layers = ring == 1 ? 0 : 1;
    put(uint32_t(1)); put(ratio); put(size); put(embd); put(uint32_t(1)); put(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      put(uint32_t(1));
      for (int t = 0; t < 2; ++t) { put(int32_t(0)); put(uint64_t(embd)); put(uint64_t(size)); put(uint64_t(4 * embd)); zeros(4 * embd * size); }
    }
  }
  const auto parsed = pdb::parse_dsv4_state_bytes(b, "dsv4 seed");  // throws if the seed is not a valid state
  if (pdb::serialize_dsv4_state(parsed) != b || parsed.csa.n_rows != 2) { std::fprintf(stderr, "dsv4 seed does not round-trip\n"); return 1; }
  write(d + "/corpus-fuzz_dsv4_state/dsv4.bin", b);
  return 0;
}
