// The per-token cache kind: llama.cpp's KV cache, one K row and one V row per token and layer (MLA: K only). Its
// layout is the probe state's (formats/state_file), checked against the GGUF's rows; its files are written by
// CaptureAssembler, a tail capture's prefix copied from an earlier state of the same rows.
#include <fmt/format.h>

#include "cache/decoder_cache.h"

namespace pdb {
namespace {

class TokenRowsCache final : public DecoderCache {
 public:
  TokenRowsCache(StateLayout layout, int64_t head_dim, std::string attn_rot)
      : layout_(std::move(layout)), head_dim_(head_dim), attn_rot_(std::move(attn_rot)) {}
  std::string describe() const override { return layout_.describe(); }
  CacheSpec spec(int simd_width) const override {
    CacheSpec s = CacheSpec::decoder_default(layout_.layers[0].k_type, layout_.layers[0].v_type, head_dim_);
    if (attn_rot_ == "off") s.rot_k = s.rot_v = false;
    else if (attn_rot_ == "on") s.rot_k = s.rot_v = true;
    s.simd_width = simd_width;
    return s;
  }
  int64_t file_tokens(int64_t prompt_tokens) const override { return prompt_tokens; }
  bool carries_turns() const override { return true; }
  int64_t usable_prefix(const ParsedState& held, const std::vector<int32_t>& tokens) const override {
    return usable_held_prefix(held, layout_, tokens);
  }
  std::unique_ptr<StateAssembler> assembler(const std::string& path, const std::vector<int32_t>& tokens, const std::string& fingerprint,
                                            int64_t tail_from) const override {
    return std::make_unique<CaptureAssembler>(path, layout_, tokens, fingerprint, tail_from);
  }

 private:
  StateLayout layout_;
  int64_t head_dim_;
  std::string attn_rot_;
};

}  // namespace

LearnedCache learn_token_rows(std::vector<uint8_t> state, const CacheProbe& probe) {
  const ParsedState s = parse_state_bytes(std::move(state), "(probe)");
  const RecipeInfo& info = probe.info;
  if (int64_t(s.layout.n_layer()) != info.n_layer)
    throw std::runtime_error(fmt::format("decoder state has {} layers, its GGUF {}", s.layout.n_layer(), info.n_layer));
  for (const auto& L : s.layout.layers)
    if (L.n_embd_k != info.n_embd_kv() || L.n_embd_v != info.n_embd_v())
      throw std::runtime_error(fmt::format("decoder state rows ({} K / {} V elements) do not match the GGUF's ({} / {})", L.n_embd_k,
                                           L.n_embd_v, info.n_embd_kv(), info.n_embd_v()));
  auto cache = std::make_shared<TokenRowsCache>(s.layout, info.head_dim, probe.attn_rot);
  LearnedCache out;
  out.streams = int(s.layout.n_stream);
  out.state_version = s.layout.file_version;
  if (probe.calibrate) {
    out.fidelity = calibrate_layer0(probe.decoder_gguf, s, probe.tokens, cache->spec(0), probe.calibration);
    if (out.fidelity->cls == FidelityClass::mismatch) out.refusal = calibration_refusal(*out.fidelity, probe.decoder_gguf);
  }
  out.cache = std::move(cache);
  return out;
}

}  // namespace pdb
