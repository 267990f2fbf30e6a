#include "front/calibration.h"

#include <cstring>

#include <fmt/format.h>

#include "formats/gguf.h"
#include "tools/verify_state.h"

namespace pdb {

std::vector<int32_t> calibration_tokens(int64_t vocab_size, int n) {
  std::vector<int32_t> t;
  uint64_t x = 0x9e3779b97f4a7c15ull;
  const int64_t lo = std::min<int64_t>(1000, vocab_size / 4), span = std::max<int64_t>(1, std::min<int64_t>(vocab_size, 100000) - lo);
  for (int i = 0; i < n; ++i) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    t.push_back(int32_t(lo + int64_t(x % uint64_t(span))));
  }
  return t;
}

CalibrationResult calibrate_layer0(const std::string& decoder_gguf, const ParsedState& st, const std::vector<int32_t>& tokens,
                                   const CacheSpec& spec) {
  CalibrationResult res;
  if (st.cell_count != tokens.size()) {
    res.note = fmt::format("decoder state holds {} cells for {} probe tokens", st.cell_count, tokens.size());
    return res;
  }
  auto g = GgufFile::open(decoder_gguf);
  auto recipe = Recipe::load(decoder_gguf, 2, 1);
  const int64_t E = recipe->info().n_embd;
  const auto& emb = g->tensor("token_embd.weight");
  const size_t rb = ggml_row_bytes(emb.type, emb.ne[0]);
  std::vector<float> h(tokens.size() * size_t(E));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= emb.ne[1]) { res.note = "probe token outside the vocabulary"; return res; }
    dequantize_row(emb.type, g->data(emb) + size_t(tokens[i]) * rb, h.data() + i * size_t(E), E);
  }
  std::vector<uint8_t> k, v;
  recipe->kv_rows(0, h.data(), int64_t(tokens.size()), 0, spec, k, v);
  // Build a one-layer state from our rows and compare it with the decoder's layer 0.
  ParsedState ours;
  ours.tokens = st.tokens;
  ours.cell_count = st.cell_count;
  ours.layout = st.layout;
  ours.layout.layers.resize(1);
  ours.k_data = {k.data()};
  ours.v_data = {v.data()};
  std::vector<uint8_t> vt;
  if (st.layout.v_trans) {  // our V is row-major; transpose to the decoder's element-major order
    const auto& L = st.layout.layers[0];
    const size_t el = L.v_row_bytes / L.n_embd_v;
    vt.resize(v.size());
    for (size_t c = 0; c < tokens.size(); ++c)
      for (size_t j = 0; j < L.n_embd_v; ++j) std::memcpy(vt.data() + (j * tokens.size() + c) * el, v.data() + c * L.v_row_bytes + j * el, el);
    ours.v_data = {vt.data()};
  }
  ParsedState theirs;
  theirs.tokens = st.tokens;
  theirs.cell_count = st.cell_count;
  theirs.layout = ours.layout;
  theirs.k_data = {st.k_data[0]};
  theirs.v_data = {st.v_data[0]};
  if (k.size() != st.layout.layers[0].k_row_bytes * tokens.size()) {
    res.note = "K row size differs from the decoder's";
    return res;
  }
  auto d = diff_states(theirs, ours, 1);
  res.pct_identical = d.pct_identical();
  res.elements = d.elements();
  res.note = fmt::format("layer 0: {:.3f}% of {} K/V elements identical to the decoder's own", res.pct_identical, res.elements);
  return res;
}

}  // namespace pdb
