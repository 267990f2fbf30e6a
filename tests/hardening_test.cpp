// Faults and load: auth, metrics, a busy prefill server, the prefill server killed mid-capture, a
// capture slower than the timeout, corrupt frames, and concurrent mixed traffic on 4 slots.
#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <future>
#include <random>
#include <sstream>
#include <fstream>
#include <iterator>
#include <thread>

#include <httplib.h>

#include "arch/backends.h"
#include "common/process.h"
#include "cache/assembler.h"
#include "prefill/capture.h"
#include "support/stack.h"

namespace pdb {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

json body(const std::string& prompt, int n = 16) { return {{"prompt", prompt}, {"n_predict", n}, {"temperature", 0}}; }
std::string native(test::Stack& st, const std::string& prompt, int slot = 0) {
  auto b = body(prompt);
  b["cache_prompt"] = false;
  b["id_slot"] = slot;
  auto r = st.post_decoder("/completion", b);
  return r.status == 200 ? r.json().value("content", "") : "HTTP " + std::to_string(r.status);
}
std::string tiny(const std::string& m = "llama-tiny") { return test::models_dir() + "/" + m; }
test::HttpReply post_with_key(int port, const std::string& path, const json& b, const std::string& key) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(300, 0);
  httplib::Headers h;
  if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
  auto r = c.Post(path.c_str(), h, b.dump(), "application/json");
  test::HttpReply out;
  if (r) { out.status = r->status; out.body = r->body; out.bridge_header = r->get_header_value("X-PD-Bridge"); }
  return out;
}
std::string get(int port, const std::string& path) {
  httplib::Client c("127.0.0.1", port);
  auto r = c.Get(path.c_str());
  return r ? r->body : "";
}

}  // namespace

TEST(Hardening, BearerAuthOnBothServers) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.front_extra = {"--api-key", "front-secret", "--prefill-api-key", "prefill-secret"};
  so.prefill_extra = {"--api-key", "prefill-secret"};
  test::Stack st(so);
  const std::string prompt = test::random_text(11, 600);
  auto r = post_with_key(st.front_port, "/completion", body(prompt), "");
  EXPECT_EQ(r.status, 401) << r.body;
  EXPECT_NE(r.body.find("Authorization"), std::string::npos);
  r = post_with_key(st.front_port, "/completion", body(prompt), "wrong");
  EXPECT_EQ(r.status, 401);
  r = post_with_key(st.front_port, "/completion", body(prompt), "front-secret");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.verdict().value("verdict", ""), "complete") << r.verdict().dump() << st.logs();
  // the prefill server itself refuses anonymous captures
  auto p = test::http_post(st.prefill_port, "/v1/bridge/prefill", R"({"wire_version":1})", 10);
  EXPECT_EQ(p.status, 401);
}

TEST(Hardening, FrontWithTheWrongPrefillKeyDeclinesAndServes) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.prefill_extra = {"--api-key", "prefill-secret"};
  so.front_extra = {"--prefill-api-key", "nope"};
  test::Stack st(so);
  const std::string prompt = test::random_text(12, 600);
  auto r = st.post_front("/completion", body(prompt));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.verdict().value("verdict", "").find("401"), std::string::npos) << r.verdict().dump();
  EXPECT_EQ(r.json()["content"].get<std::string>(), native(st, prompt));
}

TEST(Hardening, MetricsCountVerdictsBytesAndTokens) {
  test::StackOptions so;
  so.model_dir = tiny("qwen3-tiny");
  test::Stack st(so);
  ASSERT_EQ(st.post_front("/completion", body(test::random_text(13, 600))).status, 200);
  ASSERT_EQ(st.post_front("/completion", body("short one")).status, 200);
  const std::string fm = get(st.front_port, "/metrics");
  EXPECT_NE(fm.find("pdbridge_front_requests_total{verdict=\"complete\"} 1"), std::string::npos) << fm;
  EXPECT_NE(fm.find("pdbridge_front_requests_total{verdict=\"native_short\"} 1"), std::string::npos) << fm;
  EXPECT_NE(fm.find("pdbridge_front_stage_seconds_count{stage=\"engine\"} 1"), std::string::npos) << fm;
  const std::string pm = get(st.prefill_port, "/metrics");
  EXPECT_NE(pm.find("pdbridge_prefill_requests_total{status=\"complete\"} 1"), std::string::npos) << pm;
  EXPECT_NE(pm.find("pdbridge_prefill_queue_wait_seconds_count 1"), std::string::npos) << pm;
  EXPECT_EQ(pm.find("pdbridge_prefill_wire_bytes_total 0\n"), std::string::npos) << pm;
}

// Prometheus convention: a fresh front door exposes its series at 0, so rate() and alerts work
// before the first request.
TEST(Hardening, FreshFrontDoorExposesItsSeriesAtZero) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.start_prefill = false;
  test::Stack st(so);
  const std::string fm = get(st.front_port, "/metrics");
  for (const char* line : {"pdbridge_front_requests_total{verdict=\"complete\"} 0", "pdbridge_front_requests_total{verdict=\"declined\"} 0",
                           "pdbridge_front_declines_total{reason=\"calibration\"} 0", "pdbridge_front_bridged_tokens_total 0",
                           "pdbridge_front_wire_bytes_total 0", "pdbridge_front_active_requests 0",
                           "pdbridge_front_stage_seconds_count{stage=\"total\"} 0"})
    EXPECT_NE(fm.find(line), std::string::npos) << line << " missing from\n" << fm;
}

// A body that is not UTF-8 is the client's error: 400 with a plain message, on both servers, and the
// servers go on serving.
TEST(Hardening, InvalidUtf8BodyIsA400WithAPlainMessage) {
  test::StackOptions so;
  so.model_dir = tiny();
  test::Stack st(so);
  const std::string bad = std::string("{\"prompt\": \"caf") + char(0xC3) + char(0x28) + " " + char(0xFF) + "\", \"n_predict\": 4}";
  for (const auto& [port, path] : std::vector<std::pair<int, std::string>>{{st.front_port, "/completion"},
                                                                             {st.front_port, "/v1/chat/completions"},
                                                                             {st.prefill_port, "/v1/bridge/prefill"}}) {
    auto r = test::http_post(port, path, bad, 30);
    EXPECT_EQ(r.status, 400) << path << ": " << r.body;
    json j = json::parse(r.body);  // itself valid JSON (UTF-8)
    const std::string msg = j["error"]["message"].get<std::string>();
    EXPECT_NE(msg.find("UTF-8"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("json.exception"), std::string::npos) << msg;
  }
  EXPECT_EQ(st.post_front("/completion", body("still serving")).status, 200);
}

// No compiled Python among the repository's files (one was once committed). In a git checkout the
// tracked files are checked (an ignored local __pycache__ is not the repository's); else the tree.
TEST(Repository, HoldsNoCompiledPython) {
  const fs::path root = fs::path(PDBRIDGE_TESTS_DIR).parent_path();
  std::vector<std::string> files;
  if (fs::exists(root / ".git")) {
    FILE* p = popen(("git -C '" + root.string() + "' ls-files").c_str(), "r");
    ASSERT_NE(p, nullptr);
    char line[4096];
    while (fgets(line, sizeof line, p)) files.emplace_back(line, strcspn(line, "\n"));
    ASSERT_EQ(pclose(p), 0) << "git ls-files failed";
    ASSERT_FALSE(files.empty());
  } else {
    for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
      const auto name = it->path().filename().string();
      if (it->is_directory() && (name == "build" || name == ".dev" || name == ".cache" || name == "node_modules")) it.disable_recursion_pending();
      else files.push_back(fs::relative(it->path(), root).string());
    }
  }
  std::vector<std::string> found;
  for (const auto& f : files)
    if (f.find("__pycache__/") != std::string::npos || fs::path(f).extension() == ".pyc") found.push_back(f);
  EXPECT_TRUE(found.empty()) << found.size() << " compiled Python files, e.g. " << (found.empty() ? "" : found[0]);
}

TEST(Hardening, PromptLongerThanADecoderSlotIsRefusedBeforeAnyCapture) {
  // llama-server caps a slot at -c / --parallel and at the model's training context: a prompt past
  // that fits neither a restored cache nor a native prefill, so the front door says so up front
  // instead of running the engine for nothing (what an H200 scale run ran into).
  test::StackOptions so;
  so.model_dir = tiny();
  so.parallel = 1;
  so.ctx = 1024;
  test::Stack st(so);
  const std::string prompt = test::random_text(14, 1400);
  auto r = st.post_front("/completion", body(prompt));
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("the decoder's slots hold 1024"), std::string::npos) << r.body;
  EXPECT_EQ(get(st.prefill_port, "/metrics").find("pdbridge_prefill_requests_total{status="), std::string::npos)
      << "the engine ran for a prompt that could not be served";
  // a prompt that fits is still bridged
  r = st.post_front("/completion", body(test::random_text(15, 400)));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.verdict().value("verdict", ""), "complete") << r.verdict().dump() << st.logs();
}

TEST(Hardening, Fp8KvOnTheCpuIsRefusedWithItsReason) {
  const std::string model = tiny();
  const auto r = run_capture({test::pdbridge_bin(), "prefill", "--model", model + "/hf", "--recipe", model + "/decoder-f32.gguf", "--port", "1",
                              "--device", "cpu", "--kv-dtype", "fp8"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--kv-dtype fp8 is the CUDA engine's option"), std::string::npos) << r.output;
  const auto bad = run_capture({test::pdbridge_bin(), "prefill", "--model", model + "/hf", "--recipe", model + "/decoder-f32.gguf", "--port", "1",
                                "--kv-dtype", "fp4"});
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("--kv-dtype"), std::string::npos) << bad.output;
}

TEST(Hardening, ServersListenWithARealAcceptBacklog) {
  // Debian's httplib listens with a backlog of 5: a burst of clients on a busy machine overflowed it
  // and lost a request (the kernel logged SYN cookies on the front door's port). Both servers raise it.
  test::StackOptions so;
  so.model_dir = tiny();
  test::Stack st(so);
  for (int port : {st.front_port, st.prefill_port}) {
    const auto r = run_capture({"ss", "-ltnH", "sport = :" + std::to_string(port)});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::istringstream in(r.output);
    std::string state, recvq;
    int backlog = 0;
    in >> state >> recvq >> backlog;  // LISTEN  Recv-Q  Send-Q (the backlog of a listening socket)
    EXPECT_EQ(state, "LISTEN") << r.output;
    EXPECT_GE(backlog, 128) << "port " << port << ": " << r.output;
  }
  // A second server on a taken port says so at once and exits (httplib's default SO_REUSEPORT let it bind
  // and silently share the port; the front door's layout probe starts only once it holds the port).
  const std::vector<std::vector<std::string>> seconds = {
      {test::pdbridge_bin(), "front", "--decoder", "http://127.0.0.1:" + std::to_string(st.decoder_port), "--decoder-gguf", st.decoder_gguf,
       "--slot-dir", st.slot_dir, "--prefill", "http://127.0.0.1:" + std::to_string(st.prefill_port), "--port", std::to_string(st.front_port)},
      {test::pdbridge_bin(), "prefill", "--model", tiny() + "/hf", "--recipe", st.decoder_gguf, "--port", std::to_string(st.prefill_port)}};
  for (const auto& argv : seconds) {
    test::Child second(argv, st.dir + "/second-" + argv[1] + ".log");
    for (int i = 0; i < 200 && second.running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(second.running()) << "a second " << argv[1] << " is serving on a taken port: " << second.log();
    EXPECT_NE(second.stop(), 0) << second.log();
    EXPECT_NE(second.log().find("cannot listen"), std::string::npos) << second.log();
  }
}

TEST(Hardening, BusyPrefillDeclinesFastInsteadOfQueueing) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.prefill_extra = {"--max-queue", "0", "--chunk", "64"};
  test::Stack st(so);
  // occupy the engine with a long capture straight on the prefill server
  auto h = json::parse(get(st.prefill_port, "/health"));
  std::vector<int32_t> toks;
  for (int i = 0; i < 5000; ++i) toks.push_back(1000 + (i * 7919) % 50000);
  json pr = {{"wire_version", 1}, {"tokens", toks}, {"fingerprint", h["fingerprint"]}, {"k_type", "f16"}, {"v_type", "f16"}};
  auto hog = std::async(std::launch::async, [&] { return test::http_post(st.prefill_port, "/v1/bridge/prefill", pr.dump(), 300); });
  for (int i = 0; i < 200 && json::parse(get(st.prefill_port, "/health")).value("active", 0.0) < 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // until the hog holds the engine
  const auto t0 = std::chrono::steady_clock::now();
  const std::string prompt = test::random_text(14, 600);
  auto r = st.post_front("/completion", body(prompt));
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.verdict().value("verdict", "").find("busy"), std::string::npos) << r.verdict().dump();
  EXPECT_LT(r.verdict()["t_bridge_s"].get<double>(), 2.0);
  EXPECT_EQ(r.json()["content"].get<std::string>(), native(st, prompt));
  (void)dt;
  EXPECT_EQ(hog.get().status, 200);
}

TEST(Hardening, PrefillKilledMidCaptureIsServedCorrectly) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.prefill_extra = {"--chunk", "64"};
  test::Stack st(so);
  std::mt19937 g(1234);
  // 3 trials in CI; PDBRIDGE_FAULT_TRIALS=50 for the longer local job recorded in docs/RESULTS.md
  const int trials = std::getenv("PDBRIDGE_FAULT_TRIALS") ? std::atoi(std::getenv("PDBRIDGE_FAULT_TRIALS")) : 3;
  int complete = 0, declined = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const std::string prompt = test::random_text(1000 + uint64_t(trial), 2500);
    const std::string want = native(st, prompt, 1);
    auto fut = std::async(std::launch::async, [&] { return st.post_front("/completion", body(prompt)); });
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + g() % 1200));
    st.stop_prefill();  // SIGTERM at a random point of the capture
    auto r = fut.get();
    ASSERT_EQ(r.status, 200) << r.body;
    const std::string v = r.verdict().value("verdict", "");
    // either the capture finished before the kill (complete) or it was declined; never a lie
    if (v == "complete") { ++complete; EXPECT_GE(r.json()["timings"]["cache_n"].get<int64_t>(), r.verdict()["tokens"].get<int64_t>() - 1); }
    else { ++declined; EXPECT_EQ(v.rfind("declined: ", 0), 0u) << v; }
    EXPECT_EQ(r.json()["content"].get<std::string>(), want) << "trial " << trial << " verdict " << v;
    EXPECT_EQ(st.stray_state_files(), 0u);
    st.start_prefill();
  }
  std::printf("prefill killed mid-capture: %d trials, %d complete before the kill, %d declined, all answers correct unless reported above\n",
              trials, complete, declined);
}

TEST(Hardening, CaptureSlowerThanTheTimeoutIsDeclined) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.prefill_extra = {"--chunk", "100000"};  // one chunk: layer 1's rows come only after layer 0's full attention
  so.front_extra = {"--bridge-timeout", "1"};
  test::Stack st(so);
  const std::string prompt = test::random_text(15, 6000);
  auto r = st.post_front("/completion", body(prompt));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.verdict().value("verdict", "").rfind("declined: ", 0), 0u) << r.verdict().dump();
  EXPECT_EQ(r.json()["content"].get<std::string>(), native(st, prompt));
  EXPECT_EQ(st.stray_state_files(), 0u);
}

TEST(Hardening, SlotDirectoryFullIsDeclinedAndLeavesNothing) {
  test::StackOptions so;
  so.model_dir = tiny();
  test::Stack st(so);
  // a 2 MiB tmpfs over the slot directory: room for the calibration probe, not for a 3K-token cache
  const std::string cmd = "mount -t tmpfs -o size=2m pdbridge-test " + st.slot_dir + " 2>/dev/null";
  if (std::system(cmd.c_str()) != 0) GTEST_SKIP() << "cannot mount a tmpfs here (needs root): slot-dir-full not exercised";
  struct Unmount { std::string d; ~Unmount() { std::system(("umount " + d + " 2>/dev/null").c_str()); } } unmount{st.slot_dir};
  const std::string prompt = test::random_text(31, 2400);
  auto r = st.post_front("/completion", body(prompt));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.verdict().value("verdict", "").rfind("declined: ", 0), 0u) << r.verdict().dump();
  EXPECT_EQ(r.json()["content"].get<std::string>(), native(st, prompt));
  EXPECT_EQ(st.stray_state_files(), 0u);
}

TEST(Hardening, DecoderRestartedMidRequestStillAnswersCorrectly) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.prefill_extra = {"--link-gbps", "0.004"};  // a ~3 s capture
  test::Stack st(so);
  const std::string prompt = test::random_text(32, 1200);
  const std::string want = native(st, prompt);
  auto fut = std::async(std::launch::async, [&] { return st.post_front("/completion", body(prompt)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  st.restart_decoder(false);
  auto r = fut.get();
  ASSERT_EQ(r.status, 200) << r.body << st.logs();
  const std::string v = r.verdict().value("verdict", "");
  if (v == "complete") EXPECT_GE(r.json()["timings"]["cache_n"].get<int64_t>(), r.verdict()["tokens"].get<int64_t>() - 1);
  else EXPECT_EQ(v.rfind("declined: ", 0), 0u) << v;
  EXPECT_EQ(r.json()["content"].get<std::string>(), want) << v;
  EXPECT_EQ(st.stray_state_files(), 0u);
}

TEST(Hardening, EveryFrameCorruptionIsDetected) {
  const std::string mdir = tiny();
  CpuEngine engine(mdir + "/hf", 2);
  auto recipe = Recipe::load(mdir + "/decoder-f32.gguf", 2);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 96; ++i) tokens.push_back(1000 + i * 37);
  wire::PrefillRequest req;
  req.tokens = tokens;
  req.fingerprint = recipe_fingerprint(recipe->info());
  std::vector<wire::Bytes> frames;
  ASSERT_EQ(run_capture(engine, *recipe, req, 32, [&](wire::Bytes&& f) { frames.push_back(std::move(f)); return true; }).status, "complete");
  StateLayout layout;
  for (int l = 0; l < recipe->info().n_layer; ++l) {
    StateLayerTypes t;
    t.n_embd_k = t.n_embd_v = uint32_t(recipe->info().n_embd_kv());
    t.k_row_bytes = t.v_row_bytes = ggml_row_bytes(GgmlType::F16, t.n_embd_k);
    layout.layers.push_back(t);
  }
  std::vector<uint8_t> stream;
  for (auto& f : frames) stream.insert(stream.end(), f.begin(), f.end());
  const std::string dir = test::temp_dir("corrupt");
  std::vector<uint8_t> clean_file;
  auto read_file = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::vector<uint8_t>{std::istreambuf_iterator<char>(in), {}};
  };
  // A stream is accepted only if it assembles into exactly the clean state file.
  int harmless = 0;
  auto accepted = [&](const std::vector<uint8_t>& s) {
    try {
      CaptureAssembler a(dir + "/s.bin", layout, tokens, req.fingerprint);
      for (size_t off = 0; off < s.size(); off += 4096) a.feed(s.data() + off, std::min<size_t>(4096, s.size() - off));
      a.finish();
      auto got = read_file(dir + "/s.bin");
      fs::remove(dir + "/s.bin");
      if (clean_file.empty()) clean_file = got;
      else EXPECT_EQ(got, clean_file) << "an accepted stream produced a different state file";
      return true;
    } catch (const std::exception&) {
      return false;
    }
  };
  ASSERT_TRUE(accepted(stream));
  std::mt19937_64 g(99);
  int detected = 0, trials = 0;
  for (int i = 0; i < 300; ++i, ++trials) {  // single bit flips anywhere
    auto s = stream;
    const size_t pos = g() % s.size();
    s[pos] ^= uint8_t(1u << (g() % 8));
    detected += !accepted(s);
  }
  for (int i = 0; i < 50; ++i, ++trials) {  // truncation
    auto s = stream;
    s.resize(g() % s.size());
    detected += !accepted(s);
  }
  for (int i = 0; i < 30; ++i) {  // two frames swapped
    auto f = frames;
    const size_t a = 1 + g() % (f.size() - 2), b = 1 + g() % (f.size() - 2);
    if (a == b) continue;
    std::swap(f[a], f[b]);
    std::vector<uint8_t> s;
    for (auto& x : f) s.insert(s.end(), x.begin(), x.end());
    // Frames of different layers may travel in any order (rows land at their own offsets); a swap
    // that keeps every layer's rows in order is harmless and must give the identical file.
    if (accepted(s)) ++harmless;
    else { ++detected; ++trials; }
  }
  for (int i = 0; i < 20; ++i, ++trials) {  // a frame dropped or duplicated
    auto f = frames;
    const size_t a = 1 + g() % (f.size() - 2);
    if (i % 2) f.erase(f.begin() + long(a)); else f.insert(f.begin() + long(a), f[a]);
    std::vector<uint8_t> s;
    for (auto& x : f) s.insert(s.end(), x.begin(), x.end());
    detected += !accepted(s);
  }
  std::printf("corrupted streams detected: %d / %d (plus %d harmless cross-layer reorders assembled identically)\n", detected, trials, harmless);
  EXPECT_EQ(detected, trials);
  EXPECT_FALSE(fs::exists(dir + "/s.bin.partial"));
}

TEST(Hardening, SixteenConcurrentMixedRequestsOnFourSlots) {
  test::StackOptions so;
  so.model_dir = tiny();
  so.parallel = 4;
  so.ctx = 4096;
  so.prefill_extra = {"--max-concurrent", "4"};
  test::Stack st(so);
  struct Job { std::string prompt; bool stream; };
  std::vector<Job> jobs;
  for (int i = 0; i < 16; ++i) {
    const int kind = i % 4;  // 0 cold, 1 warm (repeat of a cold one), 2 short, 3 cold streaming
    const std::string p = kind == 2 ? "short prompt " + std::to_string(i) : test::random_text(kind == 1 ? 2000 + uint64_t(i - 1) : 2000 + uint64_t(i), 600);
    jobs.push_back({p, kind == 3});
  }
  std::vector<std::string> want;
  for (const auto& j : jobs) want.push_back(native(st, j.prompt, 0));
  std::vector<std::future<std::pair<std::string, std::string>>> futs;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& j : jobs)
    futs.push_back(std::async(std::launch::async, [&st, j] {
      auto b = body(j.prompt);
      b["stream"] = j.stream;
      auto r = st.post_front("/completion", b, 300);
      if (r.status != 200) return std::make_pair(std::string("HTTP ") + std::to_string(r.status) + r.body, std::string());
      std::string content;
      if (!j.stream) content = r.json().value("content", "");
      else {
        size_t pos = 0;
        while ((pos = r.body.find("data: ", pos)) != std::string::npos) {
          const size_t end = r.body.find('\n', pos);
          auto ev = json::parse(r.body.substr(pos + 6, end - pos - 6), nullptr, false);
          if (!ev.is_discarded() && ev.contains("content")) content += ev["content"].get<std::string>();
          pos = end;
        }
      }
      return std::make_pair(content, r.verdict().value("verdict", ""));
    }));
  std::map<std::string, int> verdicts;
  for (size_t i = 0; i < futs.size(); ++i) {
    ASSERT_EQ(futs[i].wait_for(std::chrono::seconds(300)), std::future_status::ready) << "request " << i << " hangs";
    auto [content, verdict] = futs[i].get();
    EXPECT_EQ(content, want[i]) << "request " << i << " (" << verdict << ")";
    verdicts[verdict.substr(0, verdict.find(':'))]++;
  }
  std::printf("16 concurrent requests in %.1fs:", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  for (auto& [v, n] : verdicts) std::printf(" %s=%d", v.c_str(), n);
  std::printf("\n");
  EXPECT_GE(verdicts["complete"], 4);
  EXPECT_EQ(st.stray_state_files(), 0u);
  // bridges on different slots ran side by side, not one behind the other
  const std::string pm = get(st.prefill_port, "/metrics");
  const std::string key = "\npdbridge_prefill_peak_concurrent_captures ";
  const auto at = pm.find(key);
  ASSERT_NE(at, std::string::npos) << pm;
  const double peak = std::stod(pm.substr(at + key.size()));
  std::printf("peak concurrent captures: %.0f\n", peak);
  EXPECT_GE(peak, 2.0);
}

}  // namespace pdb
