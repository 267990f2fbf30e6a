#include "support/stack.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <thread>

#include <httplib.h>

#include "cache/assembler.h"
#include "prefill/capture.h"
#include "tools/make_model.h"

namespace pdb::test {
namespace fs = std::filesystem;

HttpReply http_post(int port, const std::string& path, const std::string& body, int timeout_s) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(timeout_s, 0);
  auto r = c.Post(path.c_str(), body, "application/json");
  HttpReply h;
  if (!r) return h;
  h.status = r->status;
  h.body = r->body;
  h.bridge_header = r->get_header_value("X-PD-Bridge");
  return h;
}

Stack::Stack(const StackOptions& o) {
  dir = temp_dir("stack");
  slot_dir = dir + "/slots";
  fs::create_directories(slot_dir);
  decoder_gguf = o.model_dir + "/decoder-" + o.decoder_type + ".gguf";
  const std::string recipe = o.recipe_gguf.empty() ? decoder_gguf : o.recipe_gguf;
  decoder_port = free_port();
  std::vector<std::string> da = {decode_side_bin(), "decoder", "--gguf", decoder_gguf, "--port", std::to_string(decoder_port), "--slot-dir",
                                 slot_dir, "--ctx", std::to_string(o.ctx), "--parallel", std::to_string(o.parallel), "--cache-type",
                                 o.cache_type, "--threads", "2"};
  if (!o.decoder_bin.empty()) { da.push_back("--server-bin"); da.push_back(o.decoder_bin); }
  if (!o.decoder_extra.empty()) { da.push_back("--"); da.insert(da.end(), o.decoder_extra.begin(), o.decoder_extra.end()); }
  if (o.decoder_by_hand) {
    const char* env_bin = std::getenv("PDBRIDGE_LLAMA_SERVER");
    const std::string bin = !o.decoder_bin.empty() ? o.decoder_bin : env_bin && *env_bin ? env_bin : build_dir() + "/llama/bin/llama-server";
    da = {bin, "--model", decoder_gguf, "--port", std::to_string(decoder_port), "--threads", "2"};
    if (o.by_hand_slot_save_path) da.insert(da.end(), {"--slot-save-path", slot_dir});
    da.insert(da.end(), o.decoder_extra.begin(), o.decoder_extra.end());
  }
  decoder_argv_ = da;
  decoder_ = std::make_unique<Child>(da, dir + "/decoder.log");
  prefill_port = free_port();
  prefill_argv_ = {pdbridge_bin(), "prefill", "--model", o.hf_dir.empty() ? o.model_dir + "/hf" : o.hf_dir, "--port",
                   std::to_string(prefill_port), "--threads", "2"};
  if (o.recipe_gguf != "-") prefill_argv_.insert(prefill_argv_.begin() + 4, {"--recipe", recipe});  // "-": none (--model is the GGUF)
  prefill_argv_.insert(prefill_argv_.end(), o.prefill_extra.begin(), o.prefill_extra.end());
  if (o.start_prefill) prefill_ = std::make_unique<Child>(prefill_argv_, dir + "/prefill.log");
  std::string prefill_urls = "http://127.0.0.1:" + std::to_string(prefill_port);
  for (int i = 0; i < o.extra_prefill; ++i) {
    const int port = free_port();
    auto argv = prefill_argv_;
    for (size_t a = 0; a + 1 < argv.size(); ++a)
      if (argv[a] == "--port") argv[a + 1] = std::to_string(port);
    extra_prefill_.push_back(std::make_unique<Child>(argv, dir + "/prefill-extra-" + std::to_string(i) + ".log"));
    extra_prefill_ports.push_back(port);
    prefill_urls += ",http://127.0.0.1:" + std::to_string(port);
  }
  if (!wait_http_ok("127.0.0.1", decoder_port, "/health", 120, decoder_.get())) throw std::runtime_error("decoder did not start:\n" + decoder_->log());
  if (prefill_ && !wait_http_ok("127.0.0.1", prefill_port, "/health", 120, prefill_.get())) throw std::runtime_error("prefill did not start:\n" + prefill_->log());
  for (size_t i = 0; i < extra_prefill_.size(); ++i)
    if (!wait_http_ok("127.0.0.1", extra_prefill_ports[i], "/health", 120)) throw std::runtime_error("prefill did not start:\n" + extra_prefill_[i]->log());
  if (!o.start_front) return;
  front_port = free_port();
  const std::string front_decoder = o.front_decoder_url ? o.front_decoder_url(decoder_port, slot_dir) : "http://127.0.0.1:" + std::to_string(decoder_port);
  std::vector<std::string> fa = {decode_side_bin(), "front", "--decoder", front_decoder,
                                 "--decoder-gguf", decoder_gguf, "--slot-dir", slot_dir, "--prefill",
                                 prefill_urls, "--port", std::to_string(front_port),
                                 "--min-tokens", std::to_string(o.min_tokens), "--min-tail", std::to_string(o.min_tail)};
  fa.insert(fa.end(), o.front_extra.begin(), o.front_extra.end());
  front_ = std::make_unique<Child>(fa, dir + "/front.log");
  if (!wait_http_ok("127.0.0.1", front_port, "/health", 60, front_.get())) throw std::runtime_error("front did not start:\n" + front_->log());
  // The front door probes a decoder slot as it starts: tests that then use the decoder's slots
  // directly must not race that probe, so the stack is ready once the probe has ended (either way).
  for (int i = 0; i < 600; ++i) {
    const std::string log = front_->log();
    if (log.find("layout learned at startup") != std::string::npos || log.find("startup layout probe:") != std::string::npos) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  throw std::runtime_error("the front door's startup probe did not end in 60 s:\n" + front_->log());
}

Stack::~Stack() {
  if (front_) front_->stop();
  if (prefill_) prefill_->stop();
  for (auto& p : extra_prefill_) p->stop();
  if (decoder_) decoder_->stop();
}

HttpReply Stack::post_front(const std::string& path, const nlohmann::json& body, int timeout_s) {
  return http_post(front_port, path, body.dump(), timeout_s);
}
HttpReply Stack::post_decoder(const std::string& path, const nlohmann::json& body, int timeout_s) {
  return http_post(decoder_port, path, body.dump(), timeout_s);
}
void Stack::stop_prefill() { if (prefill_) prefill_->stop(); }
void Stack::stop_extra_prefill(size_t i) { extra_prefill_.at(i)->stop(); }
void Stack::start_prefill() {
  if (prefill_) prefill_->stop();
  prefill_ = std::make_unique<Child>(prefill_argv_, dir + "/prefill-" + std::to_string(++prefill_starts_) + ".log");
  if (!wait_http_ok("127.0.0.1", prefill_port, "/health", 120)) throw std::runtime_error("prefill did not restart:\n" + prefill_->log());
}
void Stack::restart_decoder(bool wait_healthy) {
  decoder_->stop();
  decoder_ = std::make_unique<Child>(decoder_argv_, dir + "/decoder-restarted.log");
  if (wait_healthy && !wait_http_ok("127.0.0.1", decoder_port, "/health", 120)) throw std::runtime_error("decoder did not restart");
}

std::vector<int32_t> random_token_ids(uint64_t seed, int n, int vocab) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(int32_t(1000 + g() % uint64_t(std::min(vocab, 100000) - 1000)));
  return t;
}

std::string make_hf_checkpoint(const std::string& name, const std::string& arch, const std::string& preset, uint64_t seed,
                               const std::string& dtype) {
  MakeModelOptions o;
  o.arch = arch; o.preset = preset; o.seed = seed; o.out = temp_dir(name); o.hf_dtype = dtype; o.gguf_types = {};
  o.vocab_dir = llama_src() + "/models";
  make_model(o);
  return o.out + "/hf";
}

size_t Stack::kept_state_files() {
  if (!front_) return 0;
  httplib::Client c("127.0.0.1", front_port);
  c.set_read_timeout(30, 0);
  auto r = c.Get("/health");
  if (!r || r->status != 200) throw std::runtime_error("front door /health failed");
  return nlohmann::json::parse(r->body).at("kept_states").at("files").get<size_t>();
}

size_t Stack::stray_state_files() {
  auto count = [&] {
    size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator(slot_dir)) { (void)e; ++n; }
    const size_t kept = kept_state_files();
    return n > kept ? n - kept : 0;
  };
  size_t n = count();
  for (int i = 0; i < 200 && n > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    n = count();
  }
  return n;
}

int Stack::run_doctor(std::string* output) {
  Child d({decode_side_bin(), "doctor", "--front", "http://127.0.0.1:" + std::to_string(front_port)}, dir + "/doctor.log");
  const int rc = d.stop(0, 120);
  if (output) *output = d.log();
  return rc;
}

std::string Stack::logs() const {
  std::string s;
  if (front_) s += "--- front ---\n" + front_->log();
  if (prefill_) s += "--- prefill ---\n" + prefill_->log();
  for (size_t i = 0; i < extra_prefill_.size(); ++i) s += "--- prefill " + std::to_string(i + 1) + " ---\n" + extra_prefill_[i]->log();
  return s;
}

std::string blas_llama_server() {
  const std::string p = build_dir() + "/llama/bin-blas/llama-server";
  if (!fs::exists(p))
    throw std::runtime_error(p + " is missing: scripts/setup.sh builds it (unless PDBRIDGE_BLAS_DECODER=0); run `make build`");
  return p;
}

std::string release_llama_server(const std::string& version) {
  const std::string p = build_dir() + "/llama/releases/" + version + "/llama-server";
  if (!fs::exists(p))
    throw std::runtime_error(p + " is missing: scripts/setup.sh builds it (PDBRIDGE_RELEASES, default 3.19.1); run `make build`");
  return p;
}

std::string random_text(uint64_t seed, int words) {
  static const char* kWords[] = {"river", "stone", "quantum", "ledger", "orbit", "maple", "cipher", "harbor", "velvet", "signal",
                                 "tundra", "lantern", "paradox", "copper", "meadow", "vector", "echo", "saffron", "glacier", "thread",
                                 "42", "1999", "x", "—", "über", "naïve", "(", ")", ";", "def", "return", "class"};
  std::mt19937_64 g(seed);
  std::string s;
  for (int i = 0; i < words; ++i) {
    if (i) s += (g() % 11 == 0) ? "\n" : " ";
    s += kWords[g() % (sizeof kWords / sizeof *kWords)];
  }
  return s;
}

StackOptions parity_stack_options(const std::string& model_dir, const std::string& decoder_type, const std::string& cache_type) {
  StackOptions so;
  so.model_dir = model_dir;
  so.decoder_type = decoder_type;
  so.cache_type = cache_type;
  so.parallel = 1;
  so.start_prefill = false;
  return so;
}

StackOptions gguf_alone_stack_options(const std::string& model, const std::string& decoder_type) {
  StackOptions so;
  so.model_dir = models_dir() + "/" + model;
  so.decoder_type = decoder_type;
  so.hf_dir = so.model_dir + "/decoder-" + decoder_type + ".gguf";  // --model; --recipe defaults to it
  so.recipe_gguf = "-";                                             // no --recipe
  return so;
}

StatePair native_and_bridged_states(Stack& st, PrefillBackend& backend, const std::vector<int32_t>& tokens, int64_t chunk) {
  auto r = st.post_decoder("/completion", {{"prompt", tokens}, {"n_predict", 0}, {"id_slot", 0}, {"cache_prompt", true}});
  if (r.status != 200) throw std::runtime_error("native prefill failed: " + r.body);
  r = st.post_decoder("/slots/0?action=save", {{"filename", "native.bin"}});
  if (r.status != 200) throw std::runtime_error("slot save failed: " + r.body);
  StatePair out;
  out.native = parse_state_file(st.slot_dir + "/native.bin");
  const RecipeInfo& info = backend.info();
  const auto& L0 = out.native.layout.layers.at(0);
  wire::PrefillRequest req;
  req.tokens = tokens;
  req.fingerprint = recipe_fingerprint(info);
  const CacheSpec spec = CacheSpec::decoder_default(L0.k_type, L0.v_type, info.head_dim);
  req.k_type = spec.k_type; req.v_type = spec.v_type; req.rot_k = spec.rot_k; req.rot_v = spec.rot_v;
  // The width the front door would send: the one the decoder's own layer 0 shows (its ISA).
  out.fidelity = calibrate_layer0(st.decoder_gguf, out.native, tokens, spec);
  req.simd_width = out.fidelity.simd_width ? out.fidelity.simd_width : 8;
  {
    CaptureAssembler as(st.slot_dir + "/bridged.bin", out.native.layout, tokens, req.fingerprint);
    auto cr = run_capture(backend, req, chunk, EmitFn([&](wire::Bytes&& f, bool) { as.feed(f.data(), f.size()); return Emit::Ok; }));
    if (cr.status != "complete") throw std::runtime_error("capture " + cr.status + ": " + cr.reason);
    as.finish();
  }
  out.bridged = parse_state_file(st.slot_dir + "/bridged.bin");
  return out;
}

}  // namespace pdb::test
