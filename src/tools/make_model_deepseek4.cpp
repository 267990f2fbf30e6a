// make-model for DeepSeek-V4 (`deepseek4`): random weights at the preset's shapes, written as the HF checkpoint
// (formats/hf_deepseek4.h: every float tensor F32 with --hf-dtype f32; with fp8 the official layout: block-FP8
// matrices with ue8m0 scales, FP4 routed experts, bf16 embedding / head / router) and converted to the decoder
// GGUF as llama.cpp's converter does (decoder-f32.gguf; decoder-mxfp4_moe.gguf for the official layout).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include "common/parallel.h"
#include "formats/gguf.h"
#include "formats/hf_deepseek4.h"
#include "formats/hf_to_gguf.h"
#include "formats/numeric.h"
#include "formats/safetensors.h"
#include "formats/deepseek4_config.h"
#include "tools/make_model.h"

namespace pdb {
namespace fs = std::filesystem;

namespace {

// Deterministic per tensor: the same seed and name give the same values whatever the order of writing.
std::vector<float> master_values(uint64_t seed, const Dsv4HfTensor& t, const std::vector<bool>& emit_ok) {
  std::vector<float> v(static_cast<size_t>(t.elements()));
  std::mt19937_64 g(seed ^ XXH3_64bits(t.hf.data(), t.hf.size()));
  std::normal_distribution<float> d(t.init_mean, t.init_sd);
  for (auto& x : v) x = t.init_sd > 0 ? d(g) : t.init_mean;
  if (t.hf == "head.weight") {  // a random model emits only whole-UTF-8 tokens (llama-server's parser rejects the rest)
    const int64_t cols = t.shape[1];
    for (int64_t r = 0; r < t.shape[0]; ++r)
      if (size_t(r) < emit_ok.size() && !emit_ok[size_t(r)]) std::fill_n(v.begin() + r * cols, cols, 0.0f);
  }
  return v;
}

// k distinct experts per token
std::vector<int64_t> tid2eid_values(uint64_t seed, const Dsv4HfTensor& t, int64_t n_expert) {
  const int64_t k = t.shape[1];
  std::vector<int64_t> e(static_cast<size_t>(t.elements()));
  std::mt19937_64 g(seed ^ XXH3_64bits(t.hf.data(), t.hf.size()));
  for (int64_t tok = 0; tok < t.shape[0]; ++tok) {
    const int64_t first = int64_t(g() % uint64_t(n_expert));
    for (int64_t j = 0; j < k; ++j) e[size_t(tok * k + j)] = (first + j) % n_expert;
  }
  return e;
}

uint8_t ue8m0_at_least(float ratio) {  // the smallest power of two >= ratio, as a ue8m0 byte
  if (!(ratio > 0.0f)) return 127;
  const int e = int(std::ceil(std::log2(double(ratio))));
  return uint8_t(std::clamp(127 + e, 1, 254));
}

uint8_t e2m1_code(float x) {  // nearest e2m1 value (ties to the even code)
  static const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float a = std::fabs(x);
  int best = 0;
  for (int i = 1; i < 8; ++i)
    if (std::fabs(mag[i] - a) < std::fabs(mag[best] - a) || (std::fabs(mag[i] - a) == std::fabs(mag[best] - a) && i % 2 == 0)) best = i;
  return uint8_t(best | (x < 0 && best ? 8 : 0));
}

// The preset with the options' layers, compress ratios, hash layers and context applied.
Deepseek4Config deepseek4_model_config(const MakeModelOptions& o) {
  Deepseek4Config c = Deepseek4Config::preset(o.preset);
  if (o.layers > 0) {
    if (o.layers > int64_t(c.compress_ratios.size())) throw std::invalid_argument("--layers: the preset has fewer compress ratios");
    c.layers = o.layers;
    c.compress_ratios.resize(size_t(o.layers));
  }
  if (!o.compress_ratios.empty()) {
    c.compress_ratios.clear();
    for (int r : o.compress_ratios) {
      if (r != 0 && r != 4 && r != 128) throw std::invalid_argument("--compress-ratios: each ratio is 0, 4 or 128");
      c.compress_ratios.push_back(r);
    }
    c.layers = int64_t(c.compress_ratios.size());
    c.hash_layers = std::min(c.hash_layers, c.layers);
  }
  if (o.hash_layers >= 0) {
    if (o.hash_layers > c.layers) throw std::invalid_argument("--hash-layers: more than the model's layers");
    c.hash_layers = o.hash_layers;
  }
  if (o.context_length > 0) c.context = o.context_length;
  return c;
}

std::string scale_name(const std::string& weight_name) { return weight_name.substr(0, weight_name.size() - std::string("weight").size()) + "scale"; }

// e4m3 values of w / scale, one ue8m0 scale per 128 x 128 block (amax fits 448): the official checkpoint's matrices.
void add_block_fp8(SafetensorsWriter& w, const Dsv4HfTensor& t, uint64_t seed, const std::vector<bool>& emit_ok) {
  const int64_t rows = t.shape[0], cols = t.shape[1], br = (rows + 127) / 128, bc = (cols + 127) / 128;
  auto scales = [=, &emit_ok]() {
    const auto v = master_values(seed, t, emit_ok);
    std::vector<uint8_t> s(static_cast<size_t>(br * bc));
    for (int64_t bi = 0; bi < br; ++bi)
      for (int64_t bj = 0; bj < bc; ++bj) {
        float amax = 0.0f;
        for (int64_t r = bi * 128; r < std::min(rows, bi * 128 + 128); ++r)
          for (int64_t q = bj * 128; q < std::min(cols, bj * 128 + 128); ++q) amax = std::max(amax, std::fabs(v[size_t(r * cols + q)]));
        s[size_t(bi * bc + bj)] = ue8m0_at_least(amax / 448.0f);
      }
    return std::make_pair(v, s);
  };
  w.add(t.hf, StDtype::F8_E4M3, t.shape, [=](uint8_t* dst, size_t) {
    const auto [v, s] = scales();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t q = 0; q < cols; ++q) dst[r * cols + q] = f32_to_fp8_e4m3(v[size_t(r * cols + q)] / e8m0_to_f32(s[size_t((r / 128) * bc + q / 128)]));
  });
  w.add(scale_name(t.hf), StDtype::F8_E8M0, {br, bc}, [=](uint8_t* dst, size_t n) { std::memcpy(dst, scales().second.data(), n); });
}

// An FP4 routed expert: e2m1 pairs (low nibble first), one ue8m0 scale per 32 values (amax fits 6).
void add_mxfp4(SafetensorsWriter& w, const Dsv4HfTensor& t, uint64_t seed, const std::vector<bool>& emit_ok) {
  const int64_t n = t.elements();
  auto scales = [=, &emit_ok]() {
    const auto v = master_values(seed, t, emit_ok);
    std::vector<uint8_t> s(static_cast<size_t>(n / 32));
    for (int64_t b = 0; b < n / 32; ++b) {
      float amax = 0.0f;
      for (int64_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[size_t(32 * b + i)]));
      s[size_t(b)] = ue8m0_at_least(amax / 6.0f);
    }
    return std::make_pair(v, s);
  };
  w.add(t.hf, StDtype::I8, {t.shape[0], t.shape[1] / 2}, [=](uint8_t* dst, size_t) {
    const auto [v, s] = scales();
    for (int64_t i = 0; i < n; i += 2) {
      const float d = e8m0_to_f32(s[size_t(i / 32)]);
      dst[i / 2] = uint8_t(e2m1_code(v[size_t(i)] / d) | (e2m1_code(v[size_t(i + 1)] / d) << 4));
    }
  });
  w.add(scale_name(t.hf), StDtype::F8_E8M0, {t.shape[0], t.shape[1] / 32}, [=](uint8_t* dst, size_t bytes) { std::memcpy(dst, scales().second.data(), bytes); });
}

// One tensor in its store: every float tensor F32 for tests, the official layout's stores with fp8.
void add_tensor(SafetensorsWriter& w, const Dsv4HfTensor& t, bool official, uint64_t seed, const std::vector<bool>& emit_ok, int64_t n_expert) {
  using S = Dsv4HfTensor::Store;
  if (t.store == S::I64) {
    w.add(t.hf, StDtype::I64, t.shape, [=](uint8_t* dst, size_t n) {
      const auto e = tid2eid_values(seed, t, n_expert);
      std::memcpy(dst, e.data(), n);
    });
    return;
  }
  const S store = official ? t.store : S::F32;
  if (store == S::F32) {
    w.add(t.hf, StDtype::F32, t.shape, [=, &emit_ok](uint8_t* dst, size_t n) { std::memcpy(dst, master_values(seed, t, emit_ok).data(), n); });
  } else if (store == S::Bf16) {
    w.add(t.hf, StDtype::BF16, t.shape, [=, &emit_ok](uint8_t* dst, size_t) {
      const auto v = master_values(seed, t, emit_ok);
      for (size_t i = 0; i < v.size(); ++i) { const uint16_t b = f32_to_bf16(v[i]); std::memcpy(dst + 2 * i, &b, 2); }
    });
  } else if (store == S::Fp8) {
    add_block_fp8(w, t, seed, emit_ok);
  } else {
    add_mxfp4(w, t, seed, emit_ok);
  }
}

}  // namespace

void make_deepseek4_model(const MakeModelOptions& o, const std::string& vocab_gguf) {
  Deepseek4Config c = deepseek4_model_config(o);
  if (o.hf_dtype != "f32" && o.hf_dtype != "fp8")
    throw std::invalid_argument("--hf-dtype for deepseek4: f32 (tests) or fp8 (the official layout: FP8 matrices, FP4 experts, bf16 elsewhere)");
  if (!fs::exists(vocab_gguf)) throw std::runtime_error("vocab GGUF not found: " + vocab_gguf + " (run scripts/setup.sh)");
  c.vocab = vocab_size_of(vocab_gguf);
  const bool official = o.hf_dtype == "fp8";
  const auto emit_ok = printable_tokens(*GgufFile::open(vocab_gguf));
  const std::string hf = o.out + "/hf";
  fs::create_directories(hf);
  {
    std::ofstream f(hf + "/config.json");
    f << deepseek4_hf_config_json(c, official).dump(2) << "\n";
  }
  SafetensorsWriter w;
  for (const auto& t : deepseek4_hf_tensors(c)) add_tensor(w, t, official, o.seed, emit_ok, c.experts);
  w.write(hf, size_t(4) << 30, o.threads > 0 ? o.threads : default_threads());
  auto ck = Deepseek4Checkpoint::open(hf);
  const std::string path = o.out + (official ? "/decoder-mxfp4_moe.gguf" : "/decoder-f32.gguf");
  write_deepseek4_gguf(*ck, vocab_gguf, path, "pdbridge-deepseek4-" + o.preset);
  spdlog::info("make-model: deepseek4 {} seed {} -> {} ({} checkpoint) and {}", o.preset, o.seed, hf, official ? "FP8/FP4 official-layout" : "f32", path);
}

}  // namespace pdb
