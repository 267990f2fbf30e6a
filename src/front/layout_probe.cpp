// The front door learns the running decoder's cache: a probe prompt on a slot it holds, its state file read by the
// cache kinds (cache/decoder_cache.h), layer 0 calibrated against the GGUF; what the server's flags mean for the bridge.
#include "front/front_door.h"

namespace pdb {

void Front::warm_layout() {
  size_t cached = 0;
  const int slot = slots_.acquire({}, &cached);
  try {
    const auto t0 = Clock::now();
    decoder_cache(slot);
    spdlog::info("front: decoder layout learned at startup in {:.2f}s", secs(t0));
  } catch (const std::exception& e) {
    // Not sticky: traffic sent straight to the decoder's slots can disturb a probe; the first
    // request probes again (and a real mismatch, a wrong --rope-* say, is found again there).
    spdlog::warn("front: startup layout probe: {} (the first request probes again)", e.what());
    std::lock_guard<std::mutex> l(layout_m_);
    // a flag the bridge cannot work without is said where the operator looks (/health, doctor), not only in the log
    if (std::string(e.what()).find("--slot-save-path") != std::string::npos) setup_.problems.push_back(e.what());
    cache_.reset();
    calibration_.clear();
    calibration_error_.clear();  // fidelity_ keeps the numbers measured, for /health and doctor
  }
  slots_.release(slot, std::vector<int32_t>{});  // the slot now holds the probe prompt: no prefix to offer
}

std::shared_ptr<const DecoderCache> Front::decoder_cache(int slot) {
  std::lock_guard<std::mutex> l(layout_m_);
  if (cache_) {
    if (!calibration_error_.empty()) throw std::runtime_error(calibration_error_);
    return cache_;
  }
  CacheProbe probe;
  probe.decoder_gguf = o_.decoder_gguf;
  probe.info = info_;
  probe.tokens = o_.calibrate ? calibration_tokens(info_vocab_) : calibration_tokens(info_vocab_, 4);
  probe.calibrate = o_.calibrate;
  if (o_.decoder_simd >= 0) { probe.calibration.widths = {o_.decoder_simd}; probe.calibration.width_from_operator = true; }
  probe.attn_rot = o_.attn_rot;
  LearnedCache learned = learn_decoder_cache(dec_.probe_state(slot, o_.slot_dir, probe.tokens), probe);
  spdlog::info("front: decoder state layout: {}", learned.cache->describe());
  note_setup(learned.streams, learned.state_version);
  calibration_error_ = learned.refusal;
  fidelity_ = learned.fidelity;
  if (fidelity_) {
    calibration_ = fidelity_->note;
    spdlog::info("front: calibration {}; decoder ISA {} ({})", fidelity_->note, fidelity_->isa, fidelity_->isa_source);
  }
  if (!learned.refusal.empty()) spdlog::warn("front: {}", learned.refusal);
  cache_ = std::move(learned.cache);
  if (!calibration_error_.empty()) throw std::runtime_error(calibration_error_);
  return cache_;
}

void Front::note_setup(int streams, uint32_t state_version) {
  setup_ = assess_decoder(props_, streams, state_version, o_.min_tokens);
  spdlog::info("front: decoder build '{}' ({}), state version {}, {} slots of {} tokens", setup_.build,
               setup_.release.empty() ? "not a release pdbridge was measured against" : setup_.release, state_version, setup_.slots,
               setup_.slot_ctx);
  for (const auto& p : setup_.problems) spdlog::warn("front: decoder setup: {}", p);
}

void Front::forget_layout() {
  std::lock_guard<std::mutex> l(layout_m_);
  cache_.reset();
  kept_.clear();  // computed for the decoder before its restart: its arithmetic may have changed with it
}

void Front::remove_stale_files() {
  size_t n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(o_.slot_dir, ec)) {
    const std::string f = e.path().filename().string();
    if (e.is_regular_file() && f.rfind("pdbridge-", 0) == 0 && f.size() > 4 && f.compare(f.size() - 4, 4, ".bin") == 0) {
      remover_.remove(e.path().string());
      ++n;
    }
  }
  if (n) spdlog::info("front: removing {} state files an earlier front door left in {}", n, o_.slot_dir);
}

}  // namespace pdb
