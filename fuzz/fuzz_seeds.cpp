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
#include "dsv4_fuzz_state.h"
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
  for (auto s : {"fuzz_frames", "fuzz_gguf", "fuzz_requests", "fuzz_dsv4_state", "fuzz_dsv4_frames"}) fs::create_directories(d + "/corpus-" + s);
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
    pdb::wire::Bytes s;
    const uint8_t selector = k_only ? 1 : 0;
    s.append(&selector, 1);
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
    write(d + (k_only ? "/corpus-fuzz_frames/seed-k-only.bin" : "/corpus-fuzz_frames/seed.bin"), std::vector<uint8_t>(s.begin(), s.end()));
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
  const std::vector<uint8_t> b = dsv4_fuzz_state();
  const auto parsed = pdb::parse_dsv4_state_bytes(b, "dsv4 seed");  // throws if the seed is not a valid state
  if (pdb::serialize_dsv4_state(parsed) != b || parsed.csa.n_rows != 2) { std::fprintf(stderr, "dsv4 seed does not round-trip\n"); return 1; }
  write(d + "/corpus-fuzz_dsv4_state/dsv4.bin", b);
  {  // a complete DSV4 capture of 8 tokens for that layout: window 8 rows x 2 layers, 2 CSA and LID rows, the rings
    fs::create_directories(d + "/corpus-fuzz_dsv4_frames");
    pdb::wire::Bytes s;
    pdb::wire::encode_json_frame(pdb::wire::FrameKind::Hello, {{"fingerprint", "fp"}, {"n_tokens", 8}, {"cache", "dsv4"}, {"window", 8}, {"k_row_bytes", 32}}, s);
    auto rows = [&](pdb::wire::FrameKind k, uint8_t type, uint32_t layer, uint32_t n, size_t row_bytes) {
      pdb::wire::FrameHeader h;
      h.kind = k; h.type = type; h.layer = layer; h.pos0 = 0; h.n_rows = n;
      std::vector<uint8_t> payload(n * row_bytes, 0);
      pdb::wire::encode_frame(h, payload.data(), payload.size(), s);
    };
    using K = pdb::wire::FrameKind;
    rows(K::Window, 1, 0, 8, 32);
    rows(K::Window, 1, 1, 8, 32);
    rows(K::Csa, 1, 1, 2, 32);
    rows(K::Lid, 1, 1, 2, 128);
    rows(K::CsaKvRing, 0, 1, 8, 128);
    rows(K::CsaScoreRing, 0, 1, 8, 128);
    rows(K::LidKvRing, 0, 1, 8, 512);
    rows(K::LidScoreRing, 0, 1, 8, 512);
    pdb::wire::encode_json_frame(K::Trailer, {{"status", "complete"}, {"tokens", 8}, {"n_tokens", 8}}, s);
    write(d + "/corpus-fuzz_dsv4_frames/capture.bin", std::vector<uint8_t>(s.begin(), s.end()));
  }
  return 0;
}
