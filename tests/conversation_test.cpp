// Conversations: a slot's next turn bridges only its new tail. In process: a capture resumed from the prefix
// cache sends exactly the rows a full capture sends for the tail. Over real processes: a six-turn conversation
// through the front door (tail-only captures, answers equal to a native decoder's, cache_n = T-1 each turn),
// eviction and a restarted prefill server, an edited earlier message, two prefill servers with one killed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <tuple>

#include <httplib.h>

#include "arch/backends.h"
#include "formats/hf_config.h"
#include "model/cpu_engine.h"
#include "prefill/capture.h"
#include "prefill/prefix_cache.h"
#include "recipes/recipe.h"
#include "support/stack.h"

namespace pdb {
using json = nlohmann::json;

namespace {

struct CapturedRows {
  std::map<std::tuple<uint32_t, int, uint32_t>, std::vector<uint8_t>> rows;  // (layer, kind, position) -> row bytes
  std::map<std::pair<uint32_t, int>, int> frames;                           // (layer, kind) -> row frames
  json hello, trailer;
};

CapturedRows capture_rows(PrefillBackend& be, const std::vector<int32_t>& tokens, int64_t tail_from, const CacheSpec& spec,
                          int64_t chunk, PrefixCache* cache) {
  wire::PrefillRequest pr;
  pr.tokens = tokens;
  pr.fingerprint = recipe_fingerprint(be.info());
  pr.k_type = spec.k_type;
  pr.v_type = spec.v_type;
  pr.rot_k = spec.rot_k;
  pr.rot_v = spec.rot_v;
  pr.simd_width = spec.simd_width;
  pr.tail_from = tail_from;
  CapturedRows out;
  wire::FrameParser parser([&](const wire::FrameHeader& h, const uint8_t* p) {
    if (h.kind == wire::FrameKind::Hello) out.hello = json::parse(p, p + h.payload_bytes);
    else if (h.kind == wire::FrameKind::Trailer) out.trailer = json::parse(p, p + h.payload_bytes);
    else {
      ++out.frames[{h.layer, int(h.kind)}];
      const size_t rb = size_t(h.payload_bytes / h.n_rows);
      for (uint32_t r = 0; r < h.n_rows; ++r)
        out.rows[{h.layer, int(h.kind), h.pos0 + r}] = std::vector<uint8_t>(p + r * rb, p + (r + 1) * rb);
    }
  });
  run_capture(be, pr, chunk, EmitFn([&](wire::Bytes&& f, bool) { parser.feed(f.data(), f.size()); return Emit::Ok; }), cache);
  return out;
}

// Every row of `full` at positions >= from, and nothing else, is in `tail`, byte for byte.
void expect_tail_of(const CapturedRows& tail, const CapturedRows& full, int64_t from) {
  size_t want = 0, same = 0;
  for (const auto& [key, row] : full.rows) {
    if (std::get<2>(key) < from) continue;
    ++want;
    auto it = tail.rows.find(key);
    if (it != tail.rows.end() && it->second == row) ++same;
  }
  EXPECT_GT(want, 0u);
  EXPECT_EQ(same, want) << "tail rows that differ from a full capture's";
  EXPECT_EQ(tail.rows.size(), want) << "the tail capture sent rows the decoder holds";
}

struct TailCase { std::string model, gguf, cache; };
void PrintTo(const TailCase& c, std::ostream* os) { *os << c.model << "/" << c.gguf << "/" << c.cache; }

}  // namespace

class TailCapture : public ::testing::TestWithParam<TailCase> {};

// Mirrored class: the CPU engine's decoder-faithful numerics are batch-independent, so a forward resumed after a
// cached prefix (its chunks cut elsewhere) gives the rows of a from-scratch forward bit for bit.
TEST_P(TailCapture, ResumedFromTheCachedPrefixSendsExactlyTheFullCapturesTailRows) {
  const auto& c = GetParam();
  const std::string dir = test::models_dir() + "/" + c.model;
  std::shared_ptr<const Recipe> recipe = Recipe::load(dir + "/decoder-" + c.gguf + ".gguf", 2);
  auto be = make_cpu_backend(std::make_shared<CpuEngine>(dir + "/hf", 2), recipe);
  ASSERT_TRUE(be->resumable());
  const GgmlType t = *ggml_type_from_name(c.cache);
  CacheSpec spec = CacheSpec::decoder_default(t, t, recipe->info().head_dim);
  spec.simd_width = 8;
  std::mt19937 g(std::random_device{}());
  std::vector<int32_t> conv(700);
  for (auto& x : conv) x = int32_t(g() % uint32_t(be->config().vocab_size - 10) + 5);
  const std::vector<int32_t> turn1(conv.begin(), conv.begin() + 300);

  PrefixCache cache(size_t(1) << 30);
  const auto first = capture_rows(*be, turn1, 0, spec, 128, &cache);
  EXPECT_EQ(first.trailer.value("status", ""), "complete");
  EXPECT_EQ(cache.stats().entries, 1u);
  // turn 2: the decoder holds 420 tokens (turn 1 plus what it generated), the server's cache 300 of them
  const auto tail = capture_rows(*be, conv, 420, spec, 128, &cache);
  EXPECT_EQ(tail.trailer.value("status", ""), "complete") << tail.trailer.dump();
  EXPECT_EQ(tail.hello.value("tail_from", -1), 420);
  EXPECT_EQ(tail.hello.value("prefix_reused", -1), 300);
  EXPECT_EQ(tail.trailer.value("computed_tokens", -1), 400);
  EXPECT_EQ(cache.stats().entries, 1u) << "turn 2's state supersedes turn 1's";
  const auto full = capture_rows(*be, conv, 0, spec, 256, nullptr);
  expect_tail_of(tail, full, 420);

  // an edited earlier message: the cache must not serve past the edit
  auto edited = conv;
  edited[100] = edited[100] == 7 ? 8 : 7;
  const auto e_tail = capture_rows(*be, edited, 90, spec, 128, &cache);
  // the cache shares 100 tokens with the edited prompt, the decoder 90: the engine resumes after those 90
  EXPECT_EQ(e_tail.hello.value("prefix_reused", -1), 90);
  EXPECT_EQ(e_tail.trailer.value("computed_tokens", -1), 700 - 90);
  expect_tail_of(e_tail, capture_rows(*be, edited, 0, spec, 512, nullptr), 90);
}

INSTANTIATE_TEST_SUITE_P(Models, TailCapture,
                         ::testing::Values(TailCase{"llama-tiny", "f16", "f16"}, TailCase{"qwen3-tiny", "f32", "q8_0"},
                                           TailCase{"qwen3moe-tiny", "f32", "f16"}),
                         [](const auto& info) {
                           std::string n = info.param.model + "_" + info.param.gguf + "_" + info.param.cache;
                           for (auto& ch : n) if (ch == '-') ch = '_';
                           return n;
                         });

// A capture keeps the engine's state only for a cache to keep it in: asked for none (keep_max_bytes 0, what
// run_capture passes without an enabled prefix cache) the engine copies nothing; asked for one, it leaves it.
TEST(TailCapture, TheEngineKeepsItsStateOnlyWhenACacheWantsIt) {
  const std::string dir = test::models_dir() + "/llama-tiny";
  std::shared_ptr<const Recipe> recipe = Recipe::load(dir + "/decoder-f16.gguf", 2);
  auto be = make_cpu_backend(std::make_shared<CpuEngine>(dir + "/hf", 2), recipe);
  const CacheSpec spec = CacheSpec::decoder_default(GgmlType::F16, GgmlType::F16, recipe->info().head_dim);
  std::vector<int32_t> tokens(200);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(5 + i % 50);
  for (const size_t max_bytes : {size_t(0), SIZE_MAX}) {
    CaptureReuse reuse;
    reuse.keep_max_bytes = max_bytes;
    ASSERT_EQ(be->capture(tokens, 64, spec, [](const KvBlock&) { return true; }, {}, &reuse), 200);
    EXPECT_EQ(reuse.kept != nullptr, max_bytes > 0) << "keep_max_bytes " << max_bytes;
  }
  PrefixCache off(0);  // a disabled cache: run_capture asks for no state, and there is none to insert
  const auto rows = capture_rows(*be, tokens, 0, spec, 64, &off);
  EXPECT_EQ(rows.trailer.value("status", ""), "complete");
  EXPECT_EQ(off.stats().entries, 0u);
}

// The GPU capture's last block leaves in pieces (PDBRIDGE_TAIL_PIECES=4, each hashed as it lands): the same
// rows, byte for byte, as the block whole; only rows the GPU encodes (a BF16 cache's are converted on the host: whole).
TEST(CudaTailCapture, TheLastBlockInPiecesCarriesTheWholeBlocksRows) {
  if (!cuda_backend_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = test::models_dir() + "/llama-tiny";
  std::shared_ptr<const Recipe> recipe = Recipe::load(dir + "/decoder-f32.gguf", 2);
  auto be = make_cuda_backend(dir + "/hf", recipe, 2, 256);
  const int last = recipe->info().n_layer - 1;
  std::mt19937 g(std::random_device{}());
  std::vector<int32_t> tokens(700);  // chunks of 256: the last one 188 rows, in 2 pieces of at least 64
  for (auto& x : tokens) x = int32_t(g() % uint32_t(be->config().vocab_size - 10) + 5);
  for (const GgmlType t : {GgmlType::F16, GgmlType::Q8_0, GgmlType::BF16}) {
    const CacheSpec spec = CacheSpec::decoder_default(t, t, recipe->info().head_dim);
    setenv("PDBRIDGE_TAIL_PIECES", "1", 1);
    const auto whole = capture_rows(*be, tokens, 0, spec, 256, nullptr);
    setenv("PDBRIDGE_TAIL_PIECES", "4", 1);
    const auto pieces = capture_rows(*be, tokens, 0, spec, 256, nullptr);
    unsetenv("PDBRIDGE_TAIL_PIECES");
    ASSERT_EQ(pieces.trailer.value("status", ""), "complete") << ggml_type_name(t);
    EXPECT_EQ(whole.frames.at({last, int(wire::FrameKind::K)}), 3) << ggml_type_name(t);
    const int want = t == GgmlType::BF16 ? 3 : 4;  // two pieces
    EXPECT_EQ(pieces.frames.at({last, int(wire::FrameKind::K)}), want) << ggml_type_name(t);
    EXPECT_EQ(pieces.frames.at({last, int(wire::FrameKind::V)}), want) << ggml_type_name(t);
    EXPECT_EQ(pieces.frames.at({0, int(wire::FrameKind::K)}), 3) << ggml_type_name(t);
    ASSERT_EQ(pieces.rows.size(), whole.rows.size()) << ggml_type_name(t);
    size_t differ = 0;
    for (const auto& [key, row] : whole.rows) differ += pieces.rows.at(key) != row;
    EXPECT_EQ(differ, 0u) << ggml_type_name(t) << ": rows that differ between the whole last block and its pieces";
  }
}

// The GPU engine resumed after a cached prefix (its K/V copied back into the engine's cache): tolerance class,
// since cuBLAS's sums depend on the row counts of the chunks, which the resume cuts elsewhere.
TEST(CudaTailCapture, ResumedFromTheCachedPrefixMatchesTheFullCapturesTailWithinTolerance) {
  if (!cuda_backend_available()) GTEST_SKIP() << "no CUDA device";
  for (const std::string model : {"llama-tiny", "qwen3moe-tiny"}) {
    const std::string dir = test::models_dir() + "/" + model;
    std::shared_ptr<const Recipe> recipe = Recipe::load(dir + "/decoder-f32.gguf", 2);
    auto be = make_cuda_backend(dir + "/hf", recipe, 2, 256);
    ASSERT_TRUE(be->resumable());
    CacheSpec spec = CacheSpec::decoder_default(GgmlType::F16, GgmlType::F16, recipe->info().head_dim);
    std::mt19937 g(std::random_device{}());
    std::vector<int32_t> conv(700);
    for (auto& x : conv) x = int32_t(g() % uint32_t(be->config().vocab_size - 10) + 5);
    PrefixCache cache(size_t(1) << 30);
    capture_rows(*be, std::vector<int32_t>(conv.begin(), conv.begin() + 300), 0, spec, 128, &cache);
    const auto tail = capture_rows(*be, conv, 420, spec, 128, &cache);
    EXPECT_EQ(tail.hello.value("prefix_reused", -1), 300) << model;
    EXPECT_EQ(tail.trailer.value("computed_tokens", -1), 400) << model;
    const auto full = capture_rows(*be, conv, 0, spec, 256, nullptr);
    size_t rows = 0, elems = 0, same = 0;
    double worst = 0;
    for (const auto& [key, row] : full.rows) {
      if (std::get<2>(key) < 420) continue;
      ++rows;
      auto it = tail.rows.find(key);
      ASSERT_TRUE(it != tail.rows.end()) << model << " lacks a tail row";
      const size_t n = row.size() / 2;
      std::vector<float> a(n), b(n);
      dequantize_row(GgmlType::F16, row.data(), a.data(), int64_t(n));
      dequantize_row(GgmlType::F16, it->second.data(), b.data(), int64_t(n));
      for (size_t i = 0; i < n; ++i) {
        same += a[i] == b[i];
        worst = std::max(worst, double(std::fabs(a[i] - b[i])));
      }
      elems += n;
    }
    EXPECT_EQ(tail.rows.size(), rows) << model;
    std::printf("CUDA TAIL %s: %.4f%% of %zu elements identical, max |d| %.3g\n", model.c_str(), 100.0 * double(same) / double(elems), elems, worst);
    EXPECT_GE(double(same), 0.95 * double(elems)) << model;
    EXPECT_LT(worst, 0.1) << model;
  }
}

namespace {

std::string http_get(int port, const std::string& path) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(30, 0);
  auto r = c.Get(path.c_str());
  return r ? r->body : std::string();
}
// A Prometheus sample's value ("name{labels} value" or "name value"); -1 if absent.
double metric(const std::string& text, const std::string& series) {
  const auto p = text.find("\n" + series + " ");
  if (p == std::string::npos) return -1;
  return std::stod(text.substr(p + series.size() + 2));
}

std::vector<int32_t> tokenize(test::Stack& st, const std::string& text) {
  auto r = st.post_decoder("/tokenize", json{{"content", text}});
  std::vector<int32_t> t;
  const json j = r.json();  // (a range-for over a temporary's member would dangle)
  for (const auto& x : j["tokens"]) t.push_back(x.get<int32_t>());
  EXPECT_FALSE(t.empty()) << r.status << " " << r.body;
  return t;
}

// One conversation: each turn appends the last answer's tokens and ~1,500 tokens of new content, as a chat
// template would; every answer is compared with a second, independent decoder's (cache_prompt false).
class Conversation {
 public:
  Conversation(test::Stack& st, test::Stack& ref, uint64_t seed) : st_(st), ref_(ref), seed_(seed) {}
  std::vector<int32_t> prompt;
  struct Turn { json verdict, timings; std::vector<int32_t> answer; int64_t T = 0; };
  Turn next(int words = 1100) {  // ~1,500 tokens
    const auto add = tokenize(st_, test::random_text(seed_++, words));
    prompt.insert(prompt.end(), add.begin(), add.end());
    Turn t;
    t.T = int64_t(prompt.size());
    const json body = {{"prompt", prompt}, {"n_predict", 6}, {"temperature", 0}, {"return_tokens", true}};
    auto r = st_.post_front("/completion", body);
    EXPECT_EQ(r.status, 200) << r.body << st_.logs();
    if (r.status != 200) return t;
    t.verdict = r.verdict();
    const json out = r.json();
    t.timings = out["timings"];
    for (const auto& x : out["tokens"]) t.answer.push_back(x.get<int32_t>());
    json nb = body;
    nb["cache_prompt"] = false;
    nb["id_slot"] = 0;
    auto n = ref_.post_decoder("/completion", nb);
    std::vector<int32_t> native;
    const json nj = n.json();
    for (const auto& x : nj["tokens"]) native.push_back(x.get<int32_t>());
    EXPECT_FALSE(native.empty()) << n.body;
    EXPECT_EQ(t.answer, native) << "turn of " << t.T << " tokens: bridged answer differs from the native one; verdict " << t.verdict.dump();
    prompt.insert(prompt.end(), t.answer.begin(), t.answer.end());
    return t;
  }

 private:
  test::Stack& st_;
  test::Stack& ref_;
  uint64_t seed_;
};

test::StackOptions conversation_stack(int ctx = 24576) {
  test::StackOptions so;
  so.model_dir = test::models_dir() + "/llama-tiny";
  so.decoder_type = "f16";
  so.parallel = 2;
  so.ctx = ctx;
  so.min_tokens = 256;
  so.min_tail = 128;
  return so;
}
test::StackOptions reference_stack() {
  auto so = test::parity_stack_options(test::models_dir() + "/llama-tiny", "f16", "f16");
  so.ctx = 12288;
  return so;
}

}  // namespace

TEST(ConversationBridge, SixTurnsBridgeOnlyTheirTailsAndAnswerAsNative) {
  test::Stack st(conversation_stack());
  test::Stack ref(reference_stack());
  Conversation conv(st, ref, 4100);
  int64_t prev_T = 0, held_total = 0;
  double prev_reused = 0, prev_computed = 0, prev_front_bytes = 0;
  for (int turn = 1; turn <= 6; ++turn) {
    const auto t = conv.next();
    ASSERT_FALSE(t.verdict.is_null()) << st.logs();
    EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << "turn " << turn << ": " << t.verdict.dump() << st.logs();
    EXPECT_EQ(t.timings.value("cache_n", -1), t.T - 1) << "turn " << turn << ": " << t.timings.dump();
    EXPECT_EQ(t.timings.value("prompt_n", -1), 1) << t.timings.dump();
    const std::string pm = http_get(st.prefill_port, "/metrics");
    const double reused = metric(pm, "pdbridge_prefill_prefix_reused_tokens_total"), computed = metric(pm, "pdbridge_prefill_computed_tokens_total");
    const double wire = metric(http_get(st.front_port, "/metrics"), "pdbridge_front_wire_bytes_total");
    if (turn == 1) {
      EXPECT_FALSE(t.verdict.contains("tail_from"));
      EXPECT_EQ(t.verdict.value("bridged_tokens", -1), t.T);
      EXPECT_EQ(computed, double(t.T));
    } else {
      // the slot held the previous turn's prompt and the answer it generated (all but the last answer token,
      // which it sampled but never evaluated): the capture is the rest only
      // (from the front door's own file of the previous turn: its T tokens; the answer is computed with the tail)
      const int64_t P = t.verdict.value("tail_from", int64_t(-1));
      EXPECT_EQ(P, prev_T) << t.verdict.dump();
      EXPECT_EQ(t.verdict.value("held_from", ""), "kept") << t.verdict.dump();
      EXPECT_EQ(t.verdict.value("bridged_tokens", -1), t.T - P);
      held_total += P;
      // the prefill server resumed after the previous prompt (its cache) and computed only past it
      EXPECT_EQ(reused - prev_reused, double(prev_T)) << pm;
      EXPECT_EQ(computed - prev_computed, double(t.T - prev_T)) << pm;
      EXPECT_EQ(t.verdict.value("prefill_reused_tokens", -1), prev_T);
      // the wire carried the tail's rows: f16 K and V, 2 layers x 128 elements each, plus frame headers
      const double tail_rows_bytes = double(t.T - P) * 2 * 2 * 128 * 2;
      EXPECT_GE(wire - prev_front_bytes, tail_rows_bytes);
      EXPECT_LT(wire - prev_front_bytes, tail_rows_bytes * 1.1 + 4096) << "more than the tail's rows on the wire";
    }
    prev_T = t.T;
    prev_reused = reused;
    prev_computed = computed;
    prev_front_bytes = wire;
  }
  EXPECT_GT(conv.prompt.size(), 8000u);
  const std::string fm = http_get(st.front_port, "/metrics");
  EXPECT_EQ(metric(fm, "pdbridge_front_tail_bridges_total"), 5);
  EXPECT_EQ(metric(fm, "pdbridge_front_held_tokens_total"), double(held_total));
  EXPECT_EQ(metric(fm, "pdbridge_front_tail_prefix_source_total{source=\"kept\"}"), 5) << fm;
  EXPECT_EQ(metric(fm, "pdbridge_front_tail_prefix_source_total{source=\"slot\"}"), 0) << fm;
  EXPECT_EQ(st.stray_state_files(), 0u) << "state files left in the slot directory";
  EXPECT_EQ(st.kept_state_files(), 1u) << "each turn's file supersedes the one before";
}

TEST(ConversationBridge, EvictionARestartedServerAndAnEditedMessageStayCorrect) {
  auto so = conversation_stack();
  so.prefill_extra = {"--prefix-cache-gb", "0.00001"};  // ~10 KB: every prompt's state is refused
  so.front_extra = {"--keep-states-gb", "0"};           // the prefix from the slot's own saved state
  test::Stack st(so);
  test::Stack ref(reference_stack());
  Conversation conv(st, ref, 5200);
  auto t = conv.next();
  EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump();
  const int64_t first_T = t.T;
  t = conv.next();  // nothing cached: the server computes everything, sends the tail
  EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump();
  EXPECT_EQ(t.verdict.value("held_from", ""), "slot") << t.verdict.dump();
  // the slot also holds the answer the decoder generated (all but its last token, sampled but not evaluated)
  EXPECT_GE(t.verdict.value("tail_from", int64_t(0)), first_T);
  EXPECT_LT(t.verdict.value("tail_from", int64_t(0)), first_T + 6);
  EXPECT_EQ(t.verdict.value("prefill_reused_tokens", -1), 0);
  EXPECT_EQ(t.verdict.value("prefill_computed_tokens", -1), t.T);
  EXPECT_EQ(t.timings.value("cache_n", -1), t.T - 1);
  st.start_prefill();  // restarted: an empty cache, still a tail bridge
  t = conv.next();
  EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump();
  EXPECT_GT(t.verdict.value("tail_from", int64_t(0)), 0);
  EXPECT_EQ(t.verdict.value("prefill_computed_tokens", -1), t.T);
  EXPECT_EQ(t.timings.value("cache_n", -1), t.T - 1);
  // an edited earlier message: the decoder's slot agrees only up to the edit; the rest is bridged
  conv.prompt[40] = conv.prompt[40] == 1000 ? 1001 : 1000;
  t = conv.next();
  EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump();
  EXPECT_LE(t.verdict.value("tail_from", int64_t(0)), 40) << t.verdict.dump();
  EXPECT_GE(t.verdict.value("bridged_tokens", int64_t(0)), t.T - 40);
  EXPECT_EQ(t.timings.value("cache_n", -1), t.T - 1);
  EXPECT_EQ(st.stray_state_files(), 0u);
  EXPECT_EQ(st.kept_state_files(), 0u);
  EXPECT_EQ(test::files_in(st.slot_dir), 0u);
}

TEST(ConversationBridge, TwoPrefillServersOneKilledMidConversation) {
  auto so = conversation_stack();
  so.extra_prefill = 1;
  test::Stack st(so);
  test::Stack ref(reference_stack());
  const std::string h = http_get(st.front_port, "/health");
  ASSERT_EQ(json::parse(h)["prefill"].size(), 2u) << h;
  Conversation conv(st, ref, 6300);
  auto t = conv.next();
  ASSERT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump();
  const std::string first = t.verdict.value("prefill_server", "");
  t = conv.next();
  EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump();
  EXPECT_EQ(t.verdict.value("prefill_server", ""), first) << "the conversation's prefix is on " << first;
  EXPECT_GT(t.verdict.value("prefill_reused_tokens", int64_t(0)), 0) << t.verdict.dump();
  // the server holding the conversation dies: the next turn goes to the other one (nothing cached there)
  if (first == st.prefill_url(st.prefill_port)) st.stop_prefill();
  else st.stop_extra_prefill(0);
  t = conv.next();
  EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump() << st.logs();
  EXPECT_NE(t.verdict.value("prefill_server", ""), first);
  EXPECT_EQ(t.verdict.value("prefill_reused_tokens", -1), 0);
  EXPECT_GT(t.verdict.value("tail_from", int64_t(0)), 0);
  EXPECT_EQ(t.timings.value("cache_n", -1), t.T - 1);
  const json health = json::parse(http_get(st.front_port, "/health"));
  int up = 0;
  for (const auto& p : health["prefill"]) up += p.value("ok", false) ? 1 : 0;
  EXPECT_EQ(up, 1) << health.dump();
  const std::string fm = http_get(st.front_port, "/metrics");
  EXPECT_EQ(metric(fm, "pdbridge_front_prefill_up{server=\"" + first + "\"}"), 0) << fm;
  t = conv.next();  // and the conversation goes on there, now from its cache
  EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump();
  EXPECT_GT(t.verdict.value("prefill_reused_tokens", int64_t(0)), 0) << t.verdict.dump();
}

TEST(ConversationBridge, ThreeConversationsOnTwoSlotsEachBridgeOnlyTheirTails) {
  // More conversations than slots: a conversation's slot goes to another one between its turns. Its next turn
  // still bridges only the tail, from the front door's kept file of its previous turn.
  test::Stack st(conversation_stack());
  test::Stack ref(reference_stack());
  std::vector<Conversation> convs;
  convs.reserve(3);
  for (uint64_t c = 0; c < 3; ++c) convs.emplace_back(st, ref, 7100 + 100 * c);
  std::vector<int64_t> prev_T(3, 0);
  for (int round = 0; round < 2; ++round)
    for (size_t c = 0; c < 3; ++c) {
      const auto t = convs[c].next(500);
      EXPECT_EQ(t.verdict.value("verdict", ""), "complete") << t.verdict.dump() << st.logs();
      EXPECT_EQ(t.timings.value("cache_n", -1), t.T - 1) << t.timings.dump();
      if (round == 1) {
        EXPECT_EQ(t.verdict.value("tail_from", int64_t(-1)), prev_T[c]) << "conversation " << c << ": " << t.verdict.dump();
        EXPECT_EQ(t.verdict.value("held_from", ""), "kept") << t.verdict.dump();
        EXPECT_EQ(t.verdict.value("prefill_reused_tokens", int64_t(-1)), prev_T[c]) << t.verdict.dump();
      }
      prev_T[c] = t.T;
    }
  EXPECT_EQ(st.kept_state_files(), 3u);
  EXPECT_EQ(st.stray_state_files(), 0u);
}

}  // namespace pdb
