// The pooled cache kind: DeepSeek-V4's window, compressed pools and rings (formats/state_file_dsv4). The probe's own
// file is the layout (streams, types, layer lists, ring sizes) each bridged file is planned after; the file holds
// the first T-1 tokens of a prompt (a state of all T makes llama-server prefill everything again: measured), is
// written by Dsv4CaptureAssembler and is never extended by a later turn.
#include <fmt/format.h>

#include "cache/decoder_cache.h"
#include "formats/state_file_dsv4.h"

namespace pdb {
namespace {

class PooledSectionsCache final : public DecoderCache {
 public:
  PooledSectionsCache(Dsv4State like, uint32_t window) : like_(std::move(like)), window_(window) {}
  std::string describe() const override { return like_.describe(); }
  // The window's type; quantized rows are Hadamard-rotated (the recipe knows the rule). The recipe does not
  // follow the decoder's SIMD order.
  CacheSpec spec(int) const override {
    uint32_t kt = 0;
    for (const auto& st : like_.swa.streams)
      if (st.cell_count && !st.layers.empty()) kt = uint32_t(st.layers[0].type);
    CacheSpec s;
    s.k_type = s.v_type = GgmlType(kt);
    s.rot_k = s.rot_v = s.k_type != GgmlType::F32 && s.k_type != GgmlType::F16 && s.k_type != GgmlType::BF16;
    s.simd_width = 0;
    return s;
  }
  int64_t file_tokens(int64_t prompt_tokens) const override { return prompt_tokens - 1; }
  bool carries_turns() const override { return false; }
  int64_t usable_prefix(const ParsedState&, const std::vector<int32_t>&) const override { return 0; }
  std::unique_ptr<StateAssembler> assembler(const std::string& path, const std::vector<int32_t>& tokens, const std::string& fingerprint,
                                            int64_t) const override {
    return std::make_unique<Dsv4CaptureAssembler>(path, like_, tokens, window_, fingerprint);
  }

 private:
  Dsv4State like_;
  uint32_t window_;
};

}  // namespace

LearnedCache learn_pooled_sections(std::vector<uint8_t> state, const CacheProbe& probe) {
  Dsv4State s = parse_dsv4_state_bytes(std::move(state), "the decoder's probe state");
  uint32_t window_layers = 0;
  for (const auto& st : s.swa.streams)
    if (st.cell_count) window_layers = uint32_t(st.layers.size());
  if (int64_t(window_layers) != probe.info.n_layer)
    throw std::runtime_error(fmt::format("decoder state has {} layers, its GGUF {}", window_layers, probe.info.n_layer));
  LearnedCache out;
  out.streams = int(s.swa.streams.size());
  out.state_version = s.file_version;
  if (const std::string why = dsv4_unwritable_reason(s); !why.empty()) {
    out.refusal = why;
  } else if (probe.calibrate) {
    out.fidelity = calibrate_dsv4_layer0(probe.decoder_gguf, s, probe.tokens);
    if (out.fidelity->cls == FidelityClass::mismatch) out.refusal = calibration_refusal(*out.fidelity, probe.decoder_gguf);
  }
  // plans need the layout only: drop the probe's row bytes (each bridge copies this)
  s.storage.clear();
  s.storage.shrink_to_fit();
  out.cache = std::make_shared<PooledSectionsCache>(std::move(s), uint32_t(probe.info.window));
  return out;
}

}  // namespace pdb
