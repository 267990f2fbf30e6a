#include "tools/make_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <stdexcept>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include "common/parallel.h"
#include "common/process.h"
#include "formats/ggml_types.h"
#include "formats/gguf.h"
#include "formats/hf_deepseek4.h"
#include "formats/hf_to_gguf.h"
#include "formats/numeric.h"
#include "formats/safetensors.h"
#include "model/presets.h"

namespace pdb {
namespace fs = std::filesystem;

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

// Initialization chosen so a random model stays numerically sane through every layer at 100K+
// tokens: unit-variance projections, residual branches scaled by 1/sqrt(2L), norms near 1 (but not
// 1, so a recipe that ignores the norm weight is caught), sharp enough logits for stable greedy decoding.
struct Init { double std; double mean; };
Init init_for(const std::string& name, int64_t fan_in, int64_t n_layers) {
  if (ends_with(name, "norm.weight") || ends_with(name, "layernorm.weight")) return {0.1, 1.0};
  if (name == "model.embed_tokens.weight") return {1.0, 0.0};
  if (name == "lm_head.weight") return {4.0 / std::sqrt(double(fan_in)), 0.0};
  double s = 1.0 / std::sqrt(double(fan_in));
  if (ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight")) s /= std::sqrt(2.0 * double(n_layers));
  return {s, 0.0};
}

// GPT-2 byte-level BPE stores each byte as a printable code point; invert that map.
std::vector<int> gpt2_unicode_to_byte() {
  std::vector<int> inv(512, -1);
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::vector<bool> in(256, false);
  for (int b : bs) { in[size_t(b)] = true; inv[size_t(b)] = b; }
  int n = 0;
  for (int b = 0; b < 256; ++b)
    if (!in[size_t(b)]) inv[size_t(256 + n++)] = b;
  return inv;
}

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = s[i];
    int n = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
    if (n < 0 || i + size_t(n) >= s.size() + (n == 0 ? 1 : 0)) {
      if (n != 0) return false;
    }
    for (int k = 1; k <= n; ++k)
      if (i + size_t(k) >= s.size() || (static_cast<unsigned char>(s[i + size_t(k)]) >> 6) != 2) return false;
    i += size_t(n) + 1;
  }
  return true;
}

}  // namespace

// Which tokens a random test model may emit: normal tokens whose bytes are complete UTF-8, so that
// llama-server's output parser (which rejects invalid UTF-8) can serve whatever it generates.
std::vector<bool> printable_tokens(const GgufFile& vocab) {
  const auto& toks = vocab.get("tokenizer.ggml.tokens").arr;
  const GgufValue* types = vocab.find("tokenizer.ggml.token_type");
  const bool byte_level = vocab.get_string("tokenizer.ggml.model") == "gpt2";
  const auto inv = gpt2_unicode_to_byte();
  std::vector<bool> ok(toks.size(), true);
  for (size_t t = 0; t < toks.size(); ++t) {
    if (types && t < types->arr.size() && types->arr[t].as_int() != 1) { ok[t] = false; continue; }
    if (!byte_level) continue;
    // decode the token's code points back to bytes
    const std::string& u = toks[t].s;
    std::string bytes;
    for (size_t i = 0; i < u.size();) {
      const unsigned char c = u[i];
      uint32_t cp;
      size_t len;
      if (c < 0x80) { cp = c; len = 1; }
      else if ((c >> 5) == 6 && i + 1 < u.size()) { cp = ((c & 0x1f) << 6) | (u[i + 1] & 0x3f); len = 2; }
      else { ok[t] = false; break; }
      if (cp >= inv.size() || inv[cp] < 0) { ok[t] = false; break; }
      bytes.push_back(char(inv[cp]));
      i += len;
    }
    if (ok[t]) ok[t] = !bytes.empty() && valid_utf8(bytes);
  }
  return ok;
}

namespace {

}  // namespace

float master_weight(uint64_t seed, const std::string& name, int64_t i, int64_t n_layers) {
  (void)n_layers;
  const uint64_t key = XXH3_64bits_withSeed(name.data(), name.size(), seed);
  const uint64_t r = splitmix64(key ^ (uint64_t(i) * 0xd1b54a32d192ed03ull));
  // uniform in [-sqrt(3), sqrt(3)): unit variance
  return float((double(r >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0) * 1.7320508075688772);
}

void write_decoder_ggufs(const HfConfig& c, const HfWeightSource& master, const std::string& vocab, const std::vector<std::string>& types,
                         const std::string& out, const std::string& name, int threads, const std::string& llama_bin, const std::string& tool,
                         GgmlType quantize_from) {
  if (quantize_from != GgmlType::F32 && quantize_from != GgmlType::Q8_0) throw std::invalid_argument("quantize from f32 or q8_0");
  // Decoder GGUFs: float types written directly from the master, quantized ones by llama-quantize
  // from the most precise float GGUF written here (as users do: convert, then quantize).
    std::string source_gguf;
  std::vector<std::string> quantized, temporary;
  for (const auto& t : types) {
    if (t == "f32" || t == "f16" || t == "bf16" || (t == "q8_0" && quantize_from == GgmlType::Q8_0)) {
      GgufConvertOptions co;
      co.type = *ggml_type_from_name(t);
      co.vocab_gguf = vocab;
      co.name = name;
      co.threads = threads;
      const std::string path = fmt::format("{}/decoder-{}.gguf", out, t);
      spdlog::info("{}: writing {}", tool, path);
      write_decoder_gguf(c, master, co, path);
      if (t == "q8_0") continue;
      if (t == "f32" || source_gguf.empty() || (t == "f16" && source_gguf.find("bf16") != std::string::npos)) source_gguf = path;
    } else {
      quantized.push_back(t);
    }
  }
  if (!quantized.empty()) {
    if (quantize_from == GgmlType::Q8_0) {
      source_gguf = out + "/decoder-q8_0.gguf";
      if (std::find(types.begin(), types.end(), "q8_0") == types.end()) {
        source_gguf = out + "/.decoder-q8_0-source.gguf";
        GgufConvertOptions co;
        co.type = GgmlType::Q8_0; co.vocab_gguf = vocab; co.name = name; co.threads = threads;
        write_decoder_gguf(c, master, co, source_gguf);
        temporary.push_back(source_gguf);
      }
    } else if (source_gguf.empty() || source_gguf.find("-f32") == std::string::npos) {
      // Quantize from F32 for exactness; keep it only if asked for.
      source_gguf = out + "/.decoder-f32-source.gguf";
      GgufConvertOptions co;
      co.type = GgmlType::F32; co.vocab_gguf = vocab; co.name = name; co.threads = threads;
      write_decoder_gguf(c, master, co, source_gguf);
      temporary.push_back(source_gguf);
    }
    const std::string bin = (llama_bin.empty() ? self_dir() + "/llama/bin" : llama_bin) + "/llama-quantize";
    if (!fs::exists(bin)) throw std::runtime_error("llama-quantize not found at " + bin + " (run scripts/setup.sh)");
    for (const auto& t : quantized) {
      std::string upper = t;
      for (auto& ch : upper) ch = char(std::toupper(ch));
      const std::string path = fmt::format("{}/decoder-{}.gguf", out, t);
      spdlog::info("{}: llama-quantize {} -> {}", tool, upper, path);
      std::vector<std::string> args = {bin, source_gguf, path, upper, std::to_string(threads)};
      if (quantize_from == GgmlType::Q8_0) args.insert(args.begin() + 1, "--allow-requantize");
      auto r = run_capture(args);
      if (r.exit_code != 0) {
        for (auto& tmp : temporary) fs::remove(tmp);
        throw std::runtime_error(fmt::format("llama-quantize {} failed (exit {}):\n{}", upper, r.exit_code,
                                             r.output.size() > 4000 ? r.output.substr(r.output.size() - 4000) : r.output));
      }
    }
  }
  for (auto& tmp : temporary) fs::remove(tmp);
}

namespace {

// The preset's config with the options' layers, context, dtype and the vocabulary's size.
HfConfig make_model_config(const MakeModelOptions& o, const std::string& vocab) {
  HfConfig c = preset_config(o.arch, o.preset);
  if (o.context_length < 0) throw std::invalid_argument("--context-length must be positive");
  if (o.context_length > 0) c.max_position_embeddings = o.context_length;
  if (o.layers < 0) throw std::invalid_argument("--layers must be positive");
  if (o.layers > 0) {
    if (c.arch == "deepseek2" && o.layers <= c.first_k_dense_replace) throw std::invalid_argument("--layers must leave at least one MoE layer");
    c.num_layers = o.layers;
  }
  if (!fs::exists(vocab)) throw std::runtime_error("vocab GGUF not found: " + vocab + " (run scripts/setup.sh)");
  c.vocab_size = vocab_size_of(vocab);
  if (o.hf_dtype == "fp8") { c.fp8 = true; c.torch_dtype = "bfloat16"; }
  else if (o.hf_dtype == "bf16") c.torch_dtype = "bfloat16";
  else if (o.hf_dtype == "f16") c.torch_dtype = "float16";
  else if (o.hf_dtype == "f32") c.torch_dtype = "float32";
  else throw std::invalid_argument("--hf-dtype must be f32, f16, bf16 or fp8");
  return c;
}

using FillFn = std::function<void(const HfTensorSpec&, float*)>;

// A block-FP8 matrix and its weight_scale_inv (e4m3 codes, one f32 scale per block), quantized once when the writer
// asks for either half; block rows in parallel (an 8B checkpoint has 7e9 weights).
void add_fp8_tensor(SafetensorsWriter& sw, const HfConfig& c, const HfTensorSpec& sp, const FillFn& fill, int threads) {
  const int64_t rows = sp.shape[0], cols = sp.shape[1], br = c.fp8_block_rows, bc = c.fp8_block_cols;
  const int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
  auto cache = std::make_shared<std::pair<std::vector<uint8_t>, std::vector<float>>>();
  auto quantize = [=, &fill]() {
    if (!cache->first.empty()) return;
    std::vector<float> f(static_cast<size_t>(rows * cols));
    fill(sp, f.data());
    cache->first.resize(f.size());
    cache->second.assign(size_t(sr * sc), 0.0f);
    parallel_for(sr, threads, [&](int64_t b0, int64_t b1) {
      for (int64_t bi = b0; bi < b1; ++bi)
        for (int64_t bj = 0; bj < sc; ++bj) {
          float amax = 0;
          for (int64_t r = bi * br; r < std::min(rows, (bi + 1) * br); ++r)
            for (int64_t col = bj * bc; col < std::min(cols, (bj + 1) * bc); ++col) amax = std::max(amax, std::fabs(f[r * cols + col]));
          const float scale = amax > 0 ? amax / 448.0f : 1.0f;
          cache->second[bi * sc + bj] = scale;
          for (int64_t r = bi * br; r < std::min(rows, (bi + 1) * br); ++r)
            for (int64_t col = bj * bc; col < std::min(cols, (bj + 1) * bc); ++col)
              cache->first[r * cols + col] = f32_to_fp8_e4m3(f[r * cols + col] / scale);
        }
    });
  };
  sw.add(sp.hf_name, StDtype::F8_E4M3, sp.shape, [quantize, cache](uint8_t* dst, size_t n) { quantize(); std::memcpy(dst, cache->first.data(), n); });
  const std::string sname = sp.hf_name.substr(0, sp.hf_name.size() - std::string("weight").size()) + "weight_scale_inv";
  sw.add(sname, StDtype::F32, {sr, sc}, [quantize, cache](uint8_t* dst, size_t n) {
    quantize(); std::memcpy(dst, cache->second.data(), n); cache->first.clear(); cache->first.shrink_to_fit();
  });
}

// The HF checkpoint (safetensors, config.json, generation_config.json) under out/hf, unless --no-hf.
void write_hf_checkpoint(const MakeModelOptions& o, const HfConfig& c, const std::vector<HfTensorSpec>& specs, const FillFn& fill, int threads) {
  SafetensorsWriter sw;
  for (const auto& sp : specs) {
    if (sp.hf_name.empty()) continue;  // a GGUF-only stack of HF tensors (MoE experts)
    const bool matrix = sp.shape.size() == 2;
    if (c.fp8 && matrix && sp.hf_name != "model.embed_tokens.weight" && sp.hf_name != "lm_head.weight") {
      add_fp8_tensor(sw, c, sp, fill, threads);
      continue;
    }
    const StDtype dt = o.hf_dtype == "f32" ? StDtype::F32 : o.hf_dtype == "f16" ? StDtype::F16 : StDtype::BF16;
    sw.add(sp.hf_name, dt, sp.shape, [sp, dt, &fill](uint8_t* dst, size_t n) {
      std::vector<float> f(n / st_dtype_size(dt));
      fill(sp, f.data());
      if (dt == StDtype::F32) std::memcpy(dst, f.data(), n);
      else
        for (size_t i = 0; i < f.size(); ++i) {
          const uint16_t h = dt == StDtype::F16 ? f32_to_fp16(f[i]) : f32_to_bf16(f[i]);
          std::memcpy(dst + 2 * i, &h, 2);
        }
    });
  }
  if (o.no_hf) return;
  sw.write(o.out + "/hf", size_t(4) << 30, 1);
  std::ofstream(o.out + "/hf/config.json") << c.to_json().dump(2) << "\n";
  nlohmann::json gen = {{"bos_token_id", nullptr}, {"do_sample", false}};
  std::ofstream(o.out + "/hf/generation_config.json") << gen.dump(2) << "\n";
}

}  // namespace

void make_model(const MakeModelOptions& o) {
  if (o.out.empty()) throw std::invalid_argument("--out is required");
  const int threads = o.threads > 0 ? o.threads : default_threads();
  const std::string vocab_dir = o.vocab_dir.empty() ? self_dir() + "/llama/src/models" : o.vocab_dir;
  const std::string vocab = vocab_dir + "/" + vocab_name_for_arch(o.arch);
  if (o.arch == "deepseek4") {
    std::filesystem::create_directories(o.out);
    return make_deepseek4_model(o, vocab);
  }
  const HfConfig c = make_model_config(o, vocab);
  fs::create_directories(o.no_hf ? o.out : o.out + "/hf");
  const uint64_t seed = o.seed;
  const int64_t L = c.num_layers;
  const std::vector<bool> emit_ok = printable_tokens(*GgufFile::open(vocab));
  const FillFn fill_master = [seed, L, threads, &emit_ok](const HfTensorSpec& sp, float* dst) {
    int64_t n = 1;
    for (auto d : sp.shape) n *= d;
    const Init in = init_for(sp.hf_name, sp.shape.back(), L);
    const bool head = sp.hf_name == "lm_head.weight";
    const int64_t cols = sp.shape.back();
    parallel_for(n, threads, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        dst[i] = head && !emit_ok[size_t(i / cols)] ? 0.0f : float(in.mean + in.std * master_weight(seed, sp.hf_name, i, L));
    });
  };
  const auto specs = hf_tensor_specs(c);
  std::map<std::string, HfTensorSpec> by_name;
  for (const auto& s : specs)
    if (!s.hf_name.empty()) by_name[s.hf_name] = s;

  spdlog::info("make-model: {} {} seed {} -> {} ({}, vocab {})", o.arch, o.preset, seed, o.no_hf ? o.out : o.out + "/hf",
               o.no_hf ? "the decoder GGUFs only" : o.hf_dtype, c.vocab_size);
  write_hf_checkpoint(o, c, specs, fill_master, threads);

  // The GGUFs are what converting this checkpoint gives: its f16/bf16 values, not the f32 master's
  // (norms stay F32 in a GGUF but hold the checkpoint's rounded values). Block-FP8 checkpoints convert
  // from the master (their bf16 originals).
  HfWeightSource converted = [&](const std::string& name, float* dst) {
    const HfTensorSpec& sp = by_name.at(name);
    fill_master(sp, dst);
    if (c.fp8 || o.hf_dtype == "f32") return;
    int64_t n = 1;
    for (auto d : sp.shape) n *= d;
    const bool f16 = o.hf_dtype == "f16";
    parallel_for(n, threads, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dst[i] = f16 ? round_f16(dst[i]) : round_bf16(dst[i]);
    });
  };
  const auto from = ggml_type_from_name(o.quantize_from);
  if (!from) throw std::invalid_argument("--quantize-from: unknown type " + o.quantize_from);
  write_decoder_ggufs(c, converted, vocab, o.gguf_types, o.out, fmt::format("pdbridge-{}-{}-seed{}", o.arch, o.preset, seed), threads,
                      o.llama_bin, "make-model", *from);
  nlohmann::json manifest = {{"arch", o.arch}, {"preset", o.preset}, {"seed", seed}, {"hf_dtype", o.no_hf ? "none" : o.hf_dtype},
                             {"gguf_types", o.gguf_types}, {"vocab", vocab_name_for_arch(o.arch)}, {"vocab_size", c.vocab_size}};
  std::ofstream(o.out + "/pdbridge-model.json") << manifest.dump(2) << "\n";
  spdlog::info("make-model: done");
}

void write_vocab_gguf_from_json(const std::string& json_path, const std::string& gguf_path) {
  std::ifstream in(json_path);
  if (!in) throw std::runtime_error("cannot read " + json_path);
  const nlohmann::json j = nlohmann::json::parse(in);
  GgufWriter w;
  const auto& toks = j.at("tokens");
  const size_t n = toks.size();
  std::vector<GgufValue> t, sc, ty;
  for (size_t i = 0; i < n; ++i) {
    t.push_back(GgufValue::of_str(toks[i].get<std::string>()));
    sc.push_back(GgufValue::of_f32(j.contains("scores") ? j["scores"][i].get<float>() : 0.0f));
    ty.push_back(GgufValue::of_i32(j.contains("token_type") ? j["token_type"][i].get<int32_t>() : 1));
  }
  w.set("tokenizer.ggml.model", GgufValue::of_str(j.value("model", "llama")));
  w.set("tokenizer.ggml.pre", GgufValue::of_str(j.value("pre", "default")));
  w.set("tokenizer.ggml.tokens", GgufValue::of_array(GgufType::STRING, std::move(t)));
  w.set("tokenizer.ggml.scores", GgufValue::of_array(GgufType::F32, std::move(sc)));
  w.set("tokenizer.ggml.token_type", GgufValue::of_array(GgufType::I32, std::move(ty)));
  for (const char* k : {"bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"})
    if (j.contains(k)) w.set(std::string("tokenizer.ggml.") + k, GgufValue::of_u32(j[k].get<uint32_t>()));
  for (const char* k : {"add_bos_token", "add_eos_token", "add_space_prefix"})
    if (j.contains(k)) w.set(std::string("tokenizer.ggml.") + k, GgufValue::of_bool(j[k].get<bool>()));
  if (j.contains("chat_template")) w.set("tokenizer.chat_template", GgufValue::of_str(j["chat_template"].get<std::string>()));
  w.write(gguf_path);
}

void convert_model(const ConvertOptions& o) {
  const int threads = o.threads > 0 ? o.threads : default_threads();
  {
    std::ifstream f(o.hf_dir + "/config.json");
    if (f && nlohmann::json::parse(f, nullptr, false).value("model_type", "") == "deepseek_v4") {
      // DeepSeek-V4: the types are the converter's, per tensor (block-FP8 -> Q8_0, FP4 experts -> MXFP4, ...)
      auto ck = Deepseek4Checkpoint::open(o.hf_dir);
      fs::create_directories(o.out);
      const std::string vocab = o.vocab_gguf.empty() ? (o.vocab_dir.empty() ? self_dir() + "/llama/src/models" : o.vocab_dir) + "/" +
                                                           vocab_name_for_arch("deepseek4")
                                                     : o.vocab_gguf;
      const std::string path = o.out + (ck->official_layout() ? "/decoder-mxfp4_moe.gguf" : "/decoder-f32.gguf");
      write_deepseek4_gguf(*ck, vocab, path, o.name.empty() ? fs::path(o.hf_dir).filename().string() : o.name);
      spdlog::info("convert: done ({} -> {}; deepseek_v4: the converter's own type per tensor, --types is not used)", o.hf_dir, path);
      return;
    }
  }
  const HfConfig c = HfConfig::load(o.hf_dir);
  auto ck = SafetensorsCheckpoint::open(o.hf_dir);
  fs::create_directories(o.out);
  std::string vocab = o.vocab_gguf, temporary;
  if (vocab.empty() && fs::exists(o.hf_dir + "/pdbridge-vocab.json")) {
    temporary = o.out + "/.vocab.gguf";
    write_vocab_gguf_from_json(o.hf_dir + "/pdbridge-vocab.json", temporary);
    vocab = temporary;
  }
  if (vocab.empty()) vocab = (o.vocab_dir.empty() ? self_dir() + "/llama/src/models" : o.vocab_dir) + "/" + vocab_name_for_arch(c.arch);
  HfWeightSource src = [&](const std::string& name, float* dst) {
    const StTensor* t = ck->find(name);
    if (!t && name == "lm_head.weight" && c.tie_word_embeddings) t = ck->find("model.embed_tokens.weight");
    if (!t) throw std::runtime_error(o.hf_dir + ": tensor " + name + " missing");
    if (t->dtype == StDtype::F8_E4M3) throw std::runtime_error(name + ": convert block-FP8 checkpoints with their scales is not supported; convert from bf16");
    auto v = ck->to_f32(t->name);
    std::copy(v.begin(), v.end(), dst);
  };
  const std::string name = o.name.empty() ? fs::path(o.hf_dir).filename().string() : o.name;
  try {
    write_decoder_ggufs(c, src, vocab, o.gguf_types, o.out, name, threads, o.llama_bin, "convert");
  } catch (...) {
    if (!temporary.empty()) fs::remove(temporary);
    throw;
  }
  if (!temporary.empty()) fs::remove(temporary);
  spdlog::info("convert: done ({} -> {})", o.hf_dir, o.out);
}

}  // namespace pdb
