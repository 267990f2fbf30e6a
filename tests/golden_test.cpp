// Golden: what the bridge produces, hashed, against tests/golden/hashes.json, so that a change meant to leave
// behaviour as it was (a refactor) is checked byte for byte: every architecture's and cache type's wire frames and
// assembled state files (whole, sealed, a tail) at SIMD widths 8 and 16, and the front door's verdicts through the
// real processes.
//
// Fidelity class asserted: the hashed outputs are the CPU engine's decoder-faithful ones, whose arithmetic is
// compiled with fixed instructions on x86-64 (src/CMakeLists.txt, pdbridge_mirror_ggml_arithmetic), so they are
// the same on every x86-64 host; the layouts come from the pinned llama-server's own probe files. Timings, ports
// and what depends on the decoder's ISA (its fidelity numbers, its answers) are left out of the hashes.
// On another CPU family the test says so and skips. PDBRIDGE_GOLDEN_WRITE=1 rewrites the file (then review the diff);
// PDBRIDGE_GOLDEN_DUMP=1 prints every frame line hashed (to diff two runs).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "arch/backends.h"
#include "formats/state_file.h"
#include "formats/state_file_dsv4.h"
#include "cache/assembler.h"
#include "model/cpu_engine.h"
#include "prefill/backend.h"
#include "prefill/capture.h"
#include "recipes/deepseek4.h"
#include "recipes/recipe.h"
#include "support/stack.h"
#include "support/test_env.h"

namespace pdb {
namespace {
using json = nlohmann::json;

const std::string kGoldenFile = std::string(PDBRIDGE_TESTS_DIR) + "/golden/hashes.json";

std::string hex(uint64_t h) { return fmt::format("{:016x}", h); }

std::string file_hash(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> b{std::istreambuf_iterator<char>(in), {}};
  if (b.empty()) throw std::runtime_error("no file " + path);
  return hex(XXH3_64bits(b.data(), b.size()));
}

// A JSON frame (HELLO, TRAILER, SEAL) without what the clock decides.
json without_timings(json j) {
  if (!j.is_object()) return j;
  json out = json::object();
  for (auto& [k, v] : j.items())
    if (!(k.size() > 2 && k.compare(k.size() - 2, 2, "_s") == 0) && k != "tok_s") out[k] = without_timings(v);
  return out;
}

// Every frame of a capture, in order: its header fields and its payload's hash (a JSON payload without timings).
class FrameDigest {
 public:
  FrameDigest()
      : parser_([this](const wire::FrameHeader& h, const uint8_t* p) {
          std::string payload;  // a JSON payload's size too depends on the timings' digits
          if (h.kind == wire::FrameKind::Hello || h.kind == wire::FrameKind::Trailer || h.kind == wire::FrameKind::Seal)
            payload = without_timings(json::parse(p, p + h.payload_bytes)).dump();
          else
            payload = fmt::format("{} {}", h.payload_bytes, hex(h.payload_hash));
          const std::string line = fmt::format("{} {} {} {} {} {}\n", int(h.kind), int(h.type), h.layer, h.pos0, h.n_rows, payload);
          if (std::getenv("PDBRIDGE_GOLDEN_DUMP")) std::fputs(line.c_str(), stdout);
          XXH3_64bits_update(state_, line.data(), line.size());
          ++frames_;
        }) {
    state_ = XXH3_createState();
    XXH3_64bits_reset(state_);
  }
  ~FrameDigest() { XXH3_freeState(state_); }
  void feed(const wire::Bytes& f) { parser_.feed(f.data(), f.size()); }
  std::string hash() const { return fmt::format("{}:{}", frames_, hex(XXH3_64bits_digest(state_))); }

 private:
  XXH3_state_t* state_ = nullptr;
  uint64_t frames_ = 0;
  wire::FrameParser parser_;
};

class Golden {
 public:
  void put(const std::string& key, const std::string& value) {
    std::printf("GOLDEN %-58s %s\n", key.c_str(), value.c_str());
    got_[key] = value;
  }
  // Compares with the recorded file (or writes it): every key recorded must be produced, with its value.
  void check(const std::string& group) {
    json all = json::object();
    if (std::filesystem::exists(kGoldenFile)) all = json::parse(std::ifstream(kGoldenFile));
    if (std::getenv("PDBRIDGE_GOLDEN_WRITE")) {
      all[group] = got_;
      std::filesystem::create_directories(std::filesystem::path(kGoldenFile).parent_path());
      std::ofstream(kGoldenFile) << all.dump(1) << "\n";
      std::printf("GOLDEN written: %s [%s]\n", kGoldenFile.c_str(), group.c_str());
      return;
    }
    ASSERT_TRUE(all.contains(group)) << "no golden hashes recorded for " << group << " in " << kGoldenFile;
    const auto want = all[group].get<std::map<std::string, std::string>>();
    for (const auto& [k, v] : want) {
      auto it = got_.find(k);
      if (it == got_.end()) ADD_FAILURE() << k << ": recorded but not produced";
      else EXPECT_EQ(it->second, v) << k << " differs from the recorded output";
    }
    for (const auto& [k, v] : got_) EXPECT_TRUE(want.count(k)) << k << ": produced but not recorded (PDBRIDGE_GOLDEN_WRITE=1)";
  }

 private:
  std::map<std::string, std::string> got_;
};

bool x86_64() {
#if defined(__x86_64__)
  return true;
#else
  return false;
#endif
}

wire::PrefillRequest request_for(const PrefillBackend& be, const std::vector<int32_t>& tokens, const CacheSpec& spec) {
  wire::PrefillRequest req;
  req.tokens = tokens;
  req.fingerprint = recipe_fingerprint(be.info());
  req.k_type = spec.k_type; req.v_type = spec.v_type; req.rot_k = spec.rot_k; req.rot_v = spec.rot_v;
  req.simd_width = spec.simd_width;
  return req;
}

// The capture's frames into a digest and an assembler; a seal after `seal_at` emits when > 0.
CaptureResult capture(PrefillBackend& be, const wire::PrefillRequest& req, int64_t chunk, FrameDigest& digest, StateAssembler* as,
                      int seal_at = 0) {
  int emits = 0;
  return run_capture(be, req, chunk, EmitFn([&](wire::Bytes&& f, bool force) {
    if (!force && seal_at && ++emits >= seal_at) return Emit::Seal;
    digest.feed(f);
    if (as) as->feed(f.data(), f.size());
    return Emit::Ok;
  }));
}

struct RowsCase {
  std::string model, gguf, cache;
};

// Per-token rows (K+V, or MLA's K only): a whole capture at widths 8 and 16, a sealed one, and a tail's frames.
void rows_case(Golden& g, const RowsCase& c) {
  const std::string mdir = test::models_dir() + "/" + c.model;
  test::Stack st(test::parity_stack_options(mdir, c.gguf, c.cache));
  const auto tokens = test::random_token_ids(3401, 333, 100000);
  ASSERT_EQ(st.post_decoder("/completion", {{"prompt", tokens}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}}).status, 200);
  ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "probe.bin"}}).status, 200);
  const ParsedState probe = parse_state_file(st.slot_dir + "/probe.bin");
  auto backend = make_cpu_backend(std::make_shared<CpuEngine>(mdir + "/hf", 2), std::shared_ptr<const Recipe>(Recipe::load(st.decoder_gguf, 2)));
  const auto& L0 = probe.layout.layers.at(0);
  const std::string name = c.model + "/" + c.gguf + "/" + c.cache;
  for (const int width : {8, 16}) {
    CacheSpec spec = CacheSpec::decoder_default(L0.k_type, L0.v_type, backend->info().head_dim);
    spec.simd_width = width;
    const auto req = request_for(*backend, tokens, spec);
    const std::string path = st.slot_dir + "/golden.bin";
    FrameDigest whole;
    {
      CaptureAssembler as(path, probe.layout, tokens, req.fingerprint);
      const auto r = capture(*backend, req, 100, whole, &as);
      ASSERT_EQ(r.status, "complete") << r.reason;
      ASSERT_EQ(as.commit(), int64_t(tokens.size()));
    }
    g.put(fmt::format("{} w{} frames", name, width), whole.hash());
    g.put(fmt::format("{} w{} state", name, width), file_hash(path));
    FrameDigest sealed;
    {
      CaptureAssembler as(path, probe.layout, tokens, req.fingerprint);
      const auto r = capture(*backend, req, 100, sealed, &as, 5);
      ASSERT_EQ(r.status, "partial") << r.reason;
      g.put(fmt::format("{} w{} sealed tokens", name, width), std::to_string(as.commit()));
    }
    g.put(fmt::format("{} w{} sealed frames", name, width), sealed.hash());
    g.put(fmt::format("{} w{} sealed state", name, width), file_hash(path));
    auto tail = req;
    tail.tail_from = 200;
    FrameDigest tail_frames;
    const auto r = capture(*backend, tail, 100, tail_frames, nullptr);
    ASSERT_EQ(r.status, "complete") << r.reason;
    g.put(fmt::format("{} w{} tail frames", name, width), tail_frames.hash());
  }
}

// DeepSeek-V4's pooled sections: the T-1 tokens the bridge sends, whole and sealed.
void pooled_case(Golden& g, const std::string& model, const std::string& cache) {
  test::StackOptions so = test::parity_stack_options(test::models_dir() + "/" + model, "f32", cache);
  so.decoder_type = "f32";
  test::Stack st(so);
  const auto probe_tokens = test::random_token_ids(3402, 40, 100000);
  ASSERT_EQ(st.post_decoder("/completion", {{"prompt", probe_tokens}, {"n_predict", 0}, {"id_slot", 0}}).status, 200);
  ASSERT_EQ(st.post_decoder("/slots/0?action=save", {{"filename", "probe.bin"}}).status, 200);
  const Dsv4State like = parse_dsv4_state_file(st.slot_dir + "/probe.bin");
  auto backend = make_cpu_dsv4_backend(st.decoder_gguf, st.decoder_gguf);
  const uint32_t window = uint32_t(Deepseek4Recipe(st.decoder_gguf).config().window);
  const auto toks = test::random_token_ids(3403, 517, 100000);
  const std::vector<int32_t> head(toks.begin(), toks.end() - 1);
  CacheSpec spec;
  spec.k_type = spec.v_type = cache == "f16" ? GgmlType::F16 : GgmlType::Q8_0;
  spec.rot_k = spec.rot_v = spec.k_type == GgmlType::Q8_0;
  const auto req = request_for(*backend, head, spec);
  const std::string name = model + "/" + cache;
  const std::string path = st.slot_dir + "/golden.bin";
  FrameDigest whole, sealed;
  {
    Dsv4CaptureAssembler as(path, like, head, window, req.fingerprint);
    const auto r = capture(*backend, req, 100, whole, &as);
    ASSERT_EQ(r.status, "complete") << r.reason;
    ASSERT_EQ(as.commit(), int64_t(head.size()));
  }
  g.put(name + " frames", whole.hash());
  g.put(name + " state", file_hash(path));
  {
    Dsv4CaptureAssembler as(path, like, head, window, req.fingerprint);
    const auto r = capture(*backend, req, 100, sealed, &as, 6);
    ASSERT_EQ(r.status, "partial") << r.reason;
    g.put(name + " sealed tokens", std::to_string(as.commit()));
  }
  g.put(name + " sealed frames", sealed.hash());
  g.put(name + " sealed state", file_hash(path));
}

// A verdict without what the clock, the ports and the decoder's ISA decide.
std::string verdict_digest(json v) {
  json out = json::object();
  for (auto& [k, val] : v.items()) {
    if (k.rfind("t_", 0) == 0 || k == "bytes") continue;  // bytes: the trailer's timing digits; the frames are hashed above
    if (k == "prefill_server") out[k] = "<server>";
    else if (k == "fidelity") out[k] = val.value("class", "");
    else out[k] = val;
  }
  return out.dump();
}

}  // namespace

TEST(Golden, TokenRowCachesFramesAndStates) {
  if (!x86_64()) GTEST_SKIP() << "the golden hashes are recorded for x86-64's mirrored arithmetic";
  Golden g;
  for (const RowsCase& c : {RowsCase{"llama-tiny", "f32", "f16"}, RowsCase{"llama-tiny", "f32", "q8_0"}, RowsCase{"llama-tiny", "q4_0", "q4_0"},
                            RowsCase{"llama-tiny", "q8_0", "f16"}, RowsCase{"qwen3-tiny", "f16", "f16"}, RowsCase{"qwen3-tiny", "q8_0", "q8_0"},
                            RowsCase{"qwen3moe-tiny", "f32", "f16"}, RowsCase{"qwen3moe-tiny", "q8_0", "q8_0"},
                            RowsCase{"deepseek2-tiny", "f32", "f16"}, RowsCase{"deepseek2-tiny", "q8_0", "q8_0"}}) {
    rows_case(g, c);
    if (HasFatalFailure()) return;
  }
  g.check("token_rows");
}

TEST(Golden, PooledCachesFramesAndStates) {
  if (!x86_64()) GTEST_SKIP() << "the golden hashes are recorded for x86-64's mirrored arithmetic";
  Golden g;
  for (const auto& [model, cache] : std::vector<std::pair<std::string, std::string>>{
           {"deepseek4-tiny", "f16"}, {"deepseek4-tiny", "q8_0"}, {"deepseek4-tiny-hca", "f16"}}) {
    pooled_case(g, model, cache);
    if (HasFatalFailure()) return;
  }
  g.check("pooled");
}

// The front door's verdicts for a first turn and a conversation's next one, each architecture, through the real
// processes.
TEST(Golden, Verdicts) {
  if (!x86_64()) GTEST_SKIP() << "the golden hashes are recorded for x86-64's mirrored arithmetic";
  Golden g;
  for (const std::string model : {"llama-tiny", "qwen3moe-tiny", "deepseek2-tiny", "deepseek4-tiny"}) {
    test::StackOptions so;
    so.model_dir = test::models_dir() + "/" + model;
    test::Stack st(so);
    const std::string first = test::random_text(3404, 400);
    const std::string second = first + " " + test::random_text(3405, 200);
    int turn = 0;
    for (const std::string& prompt : {first, second, second + " " + test::random_text(3406, 5)}) {
      const auto r = st.post_front("/completion", {{"prompt", prompt}, {"n_predict", 4}, {"temperature", 0}, {"cache_prompt", true}});
      ASSERT_EQ(r.status, 200) << r.body;
      g.put(fmt::format("{} turn {}", model, ++turn), verdict_digest(r.verdict()));
    }
  }
  g.check("verdicts");
}

}  // namespace pdb
