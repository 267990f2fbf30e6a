#include "cache/calibration.h"

#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "formats/gguf.h"
#include "recipes/deepseek4.h"

namespace pdb {

const char* to_string(FidelityClass c) {
  switch (c) {
    case FidelityClass::mirrored: return "mirrored";
    case FidelityClass::tolerance: return "tolerance";
    default: return "mismatch";
  }
}

FidelityBounds fidelity_bounds(GgmlType t) {
  switch (t) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16: return {0.02};
    case GgmlType::Q8_0: return {0.03};
    default: return {0.05};  // Q4_0 and other block types: a flipped code is 1/8 of the block's range
  }
}

std::string isa_name(int w) {
  switch (w) {
    case 16: return "avx512";
    case 8: return "avx2";
    case 4: return "neon";
    case 0: return "none";
    default: return fmt::format("simd{}", w);
  }
}

nlohmann::json CalibrationResult::to_json() const {
  auto sec = [](const TensorDiff& d) {
    return nlohmann::json{{"elements", d.elements}, {"pct_identical", d.pct_identical()}, {"pct_within_1_ulp", d.pct_within(0)},
                          {"pct_within_2_ulp", d.pct_within(1)}, {"pct_within_4_ulp", d.pct_within(2)}, {"max_ulp", d.max_ulp},
                          {"rel_rms", d.rel_rms()}, {"max_rel", d.max_rel()}};
  };
  return {{"class", to_string(cls)}, {"decoder_isa", isa}, {"simd_width", simd_width}, {"isa_source", isa_source},
          {"layer0_k", sec(k)}, {"layer0_v", sec(v)}, {"pct_identical", pct_identical}, {"note", note}};
}

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

namespace {

bool float_type(GgmlType t) { return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16; }

// Layer 0 of `st` against the recipe's rows for `h` (the decoder's embedding rows) at one width.
StateDiff layer0_diff(const Recipe& recipe, const ParsedState& st, const std::vector<float>& h, int64_t n, CacheSpec spec, int width) {
  spec.simd_width = width;
  std::vector<uint8_t> k, v;
  recipe.kv_rows(0, h.data(), n, 0, spec, k, v);
  const auto& L = st.layout.layers[0];
  if (k.size() != L.k_row_bytes * size_t(n) || v.size() != L.v_row_bytes * size_t(n))
    throw std::runtime_error(fmt::format("the recipe's layer-0 rows ({} / {} bytes per cell) differ in size from the decoder's ({} / {})",
                                         k.size() / size_t(n), v.size() / size_t(n), L.k_row_bytes, L.v_row_bytes));
  ParsedState ours;
  ours.tokens = st.tokens;
  ours.cell_count = st.cell_count;
  ours.layout = st.layout;
  ours.layout.layers.resize(1);
  ours.k_data = {k.data()};
  if (L.has_v()) ours.v_data = {v.data()};
  std::vector<uint8_t> vt;
  if (L.has_v() && st.layout.v_trans) {  // our V is row-major; transpose to the decoder's element-major order
    const size_t el = L.v_row_bytes / L.n_embd_v;
    vt.resize(v.size());
    for (size_t c = 0; c < size_t(n); ++c)
      for (size_t j = 0; j < L.n_embd_v; ++j) std::memcpy(vt.data() + (j * size_t(n) + c) * el, v.data() + c * L.v_row_bytes + j * el, el);
    ours.v_data = {vt.data()};
  }
  ParsedState theirs;
  theirs.tokens = st.tokens;
  theirs.cell_count = st.cell_count;
  theirs.layout = ours.layout;
  theirs.k_data = {st.k_data[0]};
  if (L.has_v()) theirs.v_data = {st.v_data[0]};
  return diff_states(theirs, ours, 1);  // the decoder's values are the reference of the relative errors
}

double worst_rel_rms(const StateDiff& d) {
  double w = 0;
  for (const auto& t : d.tensors) w = std::max(w, t.rel_rms());
  return w;
}

}  // namespace

CalibrationResult calibrate_layer0(const std::string& decoder_gguf, const ParsedState& st, const std::vector<int32_t>& tokens,
                                   const CacheSpec& spec, const CalibrationOptions& opt) {
  CalibrationResult res;
  if (st.cell_count != tokens.size()) {
    res.note = fmt::format("decoder state holds {} cells for {} probe tokens", st.cell_count, tokens.size());
    return res;
  }
  auto g = GgufFile::open(decoder_gguf);
  // up to three widths of 512 rows at the 8B shape: a few seconds, once per decoder (re)start
  auto recipe = Recipe::load(decoder_gguf, int(std::max(2u, std::thread::hardware_concurrency())), 1);
  const int64_t E = recipe->info().n_embd, n = int64_t(tokens.size());
  const auto& emb = g->tensor("token_embd.weight");
  const size_t rb = ggml_row_bytes(emb.type, emb.ne[0]);
  std::vector<float> h(tokens.size() * size_t(E));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= emb.ne[1]) { res.note = "probe token outside the vocabulary"; return res; }
    dequantize_row(emb.type, g->data(emb) + size_t(tokens[i]) * rb, h.data() + i * size_t(E), E);
  }
  std::vector<int> widths = opt.widths;
  if (widths.empty()) {
    const int host = host_simd_width();
    if (host) widths.push_back(host);
    for (int w : {8, 16, 4}) if (w != host) widths.push_back(w);
  }
  // With quantized K/V weights the products are integer block sums: their result does not depend on
  // the SIMD width, so layer 0 cannot tell the decoder's ISA.
  bool width_observable = false;
  for (const char* t : {"blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_kv_a_mqa.weight"})
    if (const auto* ti = g->find_tensor(t)) width_observable = width_observable || float_type(ti->type);
  if (!width_observable) widths.resize(1);
  StateDiff best;
  int best_w = 0;
  std::vector<int> identical_at;  // every width at which layer 0 is bit-identical
  try {
    for (int w : widths) {
      StateDiff d = layer0_diff(*recipe, st, h, n, spec, w);
      if (!d.same_layout) { res.note = "layer 0 layout differs from the decoder's: " + d.layout_note; return res; }
      if (d.identical() == d.elements()) identical_at.push_back(w);
      if (best.tensors.empty() || worst_rel_rms(d) < worst_rel_rms(best) || (d.identical() == d.elements() && identical_at.size() == 1)) {
        best = d;
        best_w = w;
      }
    }
  } catch (const std::exception& e) {
    res.note = e.what();
    return res;
  }
  res.k = best.tensors[0];
  const bool has_v = best.tensors.size() > 1;  // MLA: the K row is the whole cache
  if (has_v) res.v = best.tensors[1];
  res.pct_identical = best.pct_identical();
  res.elements = best.elements();
  res.simd_width = best_w;
  const auto& L = st.layout.layers[0];
  const FidelityBounds bk = fidelity_bounds(L.k_type), bv = fidelity_bounds(L.v_type);
  const bool within = res.k.rel_rms() <= bk.max_rel_rms && (!has_v || res.v.rel_rms() <= bv.max_rel_rms);
  res.cls = !identical_at.empty() ? FidelityClass::mirrored : within ? FidelityClass::tolerance : FidelityClass::mismatch;
  if (res.cls == FidelityClass::mirrored) {
    res.isa = isa_name(best_w);
    if (opt.width_from_operator) res.isa_source = "--decoder-simd";
    else if (!width_observable)
      res.isa_source = "assumed from the front door's host (quantized K/V weights: layer 0 is the same at every width)";
    else if (identical_at.size() == 1) res.isa_source = fmt::format("probe: layer 0 bit-identical at SIMD width {} only", best_w);
    else
      res.isa_source = fmt::format("probe: layer 0 bit-identical at {} widths (the cache type's rounding hides the order); took {}, tried first",
                                   identical_at.size(), best_w);
  } else {
    res.isa = "not mirrored";
    res.isa_source = res.cls == FidelityClass::tolerance
                         ? fmt::format("no SIMD width reproduces layer 0 (closest: {}): a GPU, BLAS or unmirrored CPU backend", best_w)
                         : fmt::format("no SIMD width reproduces layer 0 (closest: {}), and the errors are of a different geometry", best_w);
  }
  const std::string mirrored_isa = res.cls == FidelityClass::mirrored ? " (" + res.isa + ")" : "";
  if (!has_v)
    res.note = fmt::format(
        "layer 0: {:.3f}% of {} K elements identical (no V section); K rel RMS {:.3g}, max {:.3g} RMS, {:.2f}% within 4 ulp (bound {} K {:.3g}): {}{}",
        res.pct_identical, res.elements, res.k.rel_rms(), res.k.max_rel(), res.k.pct_within(2), ggml_type_name(L.k_type), bk.max_rel_rms,
        to_string(res.cls), mirrored_isa);
  else
    res.note = fmt::format(
        "layer 0: {:.3f}% of {} K/V elements identical; K rel RMS {:.3g}, max {:.3g} RMS, {:.2f}% within 4 ulp; V rel RMS {:.3g}, max {:.3g} "
        "RMS, {:.2f}% within 4 ulp (bounds {} K {:.3g} / {} V {:.3g}): {}{}",
        res.pct_identical, res.elements, res.k.rel_rms(), res.k.max_rel(), res.k.pct_within(2), res.v.rel_rms(), res.v.max_rel(),
        res.v.pct_within(2), ggml_type_name(L.k_type), bk.max_rel_rms, ggml_type_name(L.v_type), bv.max_rel_rms, to_string(res.cls),
        mirrored_isa);
  return res;
}

CalibrationResult calibrate_dsv4_layer0(const std::string& decoder_gguf, const Dsv4State& st, const std::vector<int32_t>& tokens) {
  CalibrationResult res;
  res.simd_width = 0;
  res.isa = "not mirrored";
  if (st.cells() != tokens.size()) {
    res.note = fmt::format("decoder state holds {} cells for {} probe tokens", st.cells(), tokens.size());
    return res;
  }
  try {
    Deepseek4Recipe recipe(decoder_gguf);
    const auto secs = st.sections();
    const Dsv4Section* win = nullptr;
    for (const auto& s : secs)
      if (s.kind == Dsv4SectionKind::Window && s.layer == 0) { win = &s; break; }
    if (!win) { res.note = "the decoder's state has no layer-0 window"; return res; }
    const GgmlType kt = GgmlType(win->block.type);
    const auto x = recipe.layer0_input(tokens);
    const Dsv4LayerBytes ours = recipe.to_bytes(recipe.sections(0, x.data(), int64_t(tokens.size()), kt), kt);
    const int64_t D = recipe.config().head_dim;
    for (const auto& s : secs) {
      if (s.layer != 0) continue;
      const auto& mine = dsv4_section_bytes(ours, s.kind);
      if (mine.size() != s.block.bytes()) {
        res.note = fmt::format("layer 0 {}: the recipe's {} bytes vs the decoder's {}: another geometry", to_string(s.kind), mine.size(), s.block.bytes());
        return res;
      }
      const GgmlType t = GgmlType(s.block.type);
      const int64_t ne0 = t == GgmlType::F32 ? int64_t(s.block.row_bytes / 4) : s.block.ne0 ? int64_t(s.block.ne0) : D;
      const bool ring = t == GgmlType::F32 && s.kind != Dsv4SectionKind::Window;
      compare_rows(t, st.storage.data() + s.block.offset, mine.data(), int64_t(s.block.rows), ne0, ring ? res.v : res.k);
    }
    res.elements = res.k.elements + res.v.elements;
    res.pct_identical = res.elements ? 100.0 * double(res.k.identical + res.v.identical) / double(res.elements) : 100.0;
    const FidelityBounds bk = fidelity_bounds(kt), bv = fidelity_bounds(GgmlType::F32);
    const bool identical = res.k.identical == res.k.elements && res.v.identical == res.v.elements;
    const bool within = res.k.rel_rms() <= bk.max_rel_rms && res.v.rel_rms() <= bv.max_rel_rms;
    res.cls = identical ? FidelityClass::mirrored : within ? FidelityClass::tolerance : FidelityClass::mismatch;
    res.isa_source = "the deepseek4 recipe sums in plain f32 (the decoder's SIMD expf and matmul order are not mirrored)";
    res.note = fmt::format(
        "layer 0 (DeepSeek-V4 sections): {:.3f}% of {} elements identical; cache rows rel RMS {:.3g} (bound {} {:.3g}), rings rel RMS {:.3g} "
        "(bound {:.3g}): {}",
        res.pct_identical, res.elements, res.k.rel_rms(), ggml_type_name(kt), bk.max_rel_rms, res.v.rel_rms(), bv.max_rel_rms, to_string(res.cls));
  } catch (const std::exception& e) {
    res.cls = FidelityClass::mismatch;
    res.note = e.what();
  }
  return res;
}

}  // namespace pdb
