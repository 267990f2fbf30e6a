#include "decoder/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>
#include <httplib.h>

#include "common/process.h"

namespace pdb {
namespace fs = std::filesystem;

namespace {
volatile sig_atomic_t g_child = 0, g_forwarded = 0;
void forward(int sig) {
  g_forwarded = 1;
  if (g_child > 0) kill(pid_t(g_child), sig);
}
}  // namespace

std::vector<std::string> decoder_argv(const DecoderOptions& o) {
  static const char* kTypes[] = {"f32", "f16", "bf16", "q8_0", "q4_0"};
  bool ok = false;
  for (auto t : kTypes) ok = ok || o.cache_type == t;
  if (!ok) throw std::invalid_argument("--cache-type must be one of f32, f16, bf16, q8_0, q4_0");
  if (o.parallel < 1 || o.ctx < 16) throw std::invalid_argument("--parallel must be >= 1 and --ctx >= 16");
  const std::string bin = o.server_bin.empty() ? self_dir() + "/llama/bin/llama-server" : o.server_bin;
  std::vector<std::string> a = {bin, "--model", o.gguf, "--host", o.host, "--port", std::to_string(o.port),
                                "--slot-save-path", o.slot_dir,
                                // One KV stream per slot (explicit -np), each slot `ctx` cells.
                                "--parallel", std::to_string(o.parallel), "--ctx-size", std::to_string(o.ctx * o.parallel),
                                "--cache-type-k", o.cache_type, "--cache-type-v", o.cache_type,
                                // A restored slot must stay in its slot until the request that follows it.
                                "--cache-ram", "0", "--no-cache-idle-slots", "--no-webui"};
  if (o.threads > 0) { a.push_back("--threads"); a.push_back(std::to_string(o.threads)); }
  a.insert(a.end(), o.extra.begin(), o.extra.end());
  return a;
}

namespace {
bool health_ok(const std::string& host, int port) {
  httplib::Client c(host == "0.0.0.0" ? "127.0.0.1" : host, port);
  c.set_connection_timeout(1, 0);
  c.set_read_timeout(2, 0);
  auto r = c.Get("/health");
  return r && r->status == 200;
}

// Polls the child and its /health until it answers (true) or exits (false, *code set) or the time is up.
bool wait_ready(pid_t pid, const std::string& host, int port, double timeout_s, int* code) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < end) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      *code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return false;
    }
    if (health_ok(host, port)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  *code = -1;
  return false;
}

pid_t spawn(std::vector<std::string> argv, const std::string& log_path) {
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    if (!log_path.empty()) {
      const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) { dup2(fd, 1); dup2(fd, 2); close(fd); }
    }
    std::vector<char*> args;
    for (auto& s : argv) args.push_back(s.data());
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::fprintf(stderr, "[pdbridge decoder] exec %s failed: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  return pid;
}
}  // namespace

std::string diagnose_load_death(const std::string& gguf, int code) {
  std::string s = "llama-server " + describe_exit_status(code) + " while loading " + gguf + ", before it answered /health";
  const bool crashed = code == 128 + SIGSEGV || code == 128 + SIGILL || code == 128 + SIGBUS;
  if (crashed && cpu_has_amx())
    s += ". This CPU has AMX (amx_tile/amx_int8 in /proc/cpuinfo): a llama.cpp built with -march=native runs its AMX matmul, which "
         "crashes loading Q4_0/Q8_0 GGUFs (llama.cpp issue 20824). Rebuild llama.cpp with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 "
         "(scripts/setup.sh builds the pinned llama-server so), or run an F16 GGUF";
  else if (code == 128 + SIGABRT)
    s += ": it aborted (a GGML_ASSERT or an exception; its last lines above say which)";
  else if (code == 127)
    s += ": it could not be started";
  else if (!crashed)
    s += ": its last lines above say why (a GGUF it cannot read, a flag it does not know, a port in use, too little memory)";
  return s;
}

LoadCheck check_decoder_loads(const std::string& gguf, const std::string& server_bin, double timeout_s) {
  const std::string bin = server_bin.empty() ? self_dir() + "/llama/bin/llama-server" : server_bin;
  if (!fs::exists(bin)) return {false, "llama-server not found at " + bin};
  int port = 0;
  {
    const int s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (s >= 0 && bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
    if (s >= 0) close(s);
  }
  if (port == 0) return {false, "no free loopback port"};
  const std::string log = (fs::temp_directory_path() / ("pdbridge-load-check-" + std::to_string(getpid()) + ".log")).string();
  const pid_t pid = spawn({bin, "--model", gguf, "--host", "127.0.0.1", "--port", std::to_string(port), "--ctx-size", "512",
                           "--parallel", "1", "--no-webui"},
                          log);
  int code = 0;
  LoadCheck r;
  r.loaded = wait_ready(pid, "127.0.0.1", port, timeout_s, &code);
  if (r.loaded || code == -1) {
    kill(pid, SIGTERM);
    int st;
    waitpid(pid, &st, 0);
  }
  std::string tail;
  {
    std::ifstream f(log);
    std::string line;
    std::vector<std::string> lines;
    while (std::getline(f, line)) lines.push_back(line);
    for (size_t i = lines.size() > 3 ? lines.size() - 3 : 0; i < lines.size(); ++i) tail += "\n         | " + lines[i];
  }
  std::error_code ec;
  fs::remove(log, ec);
  if (r.loaded) r.detail = bin + " loads " + gguf + " on this host";
  else if (code == -1) r.detail = fmt::format("{} did not answer /health within {:.0f} s loading {}", bin, timeout_s, gguf) + tail;
  else r.detail = diagnose_load_death(gguf, code) + tail;
  return r;
}

int run_decoder(const DecoderOptions& o) {
  if (!fs::exists(o.gguf)) throw std::runtime_error("decoder GGUF not found: " + o.gguf);
  fs::create_directories(o.slot_dir);
  auto argv = decoder_argv(o);
  if (!fs::exists(argv[0])) throw std::runtime_error("llama-server not found at " + argv[0] + " (run scripts/setup.sh)");
  std::fprintf(stderr, "[pdbridge decoder] %s\n", join_command(argv).c_str());
  std::fflush(stderr);
  struct sigaction sa{};
  sa.sa_handler = forward;
  sigemptyset(&sa.sa_mask);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaction(s, &sa, nullptr);
  const pid_t pid = spawn(argv, "");
  g_child = pid;
  int code = 0;
  // a large model on a slow disk loads for minutes: the wait for readiness only reports, it never gives up
  while (!wait_ready(pid, o.host, o.port, 3600, &code)) {
    if (code == -1) continue;
    if (g_forwarded) return code;  // stopped by the operator while it loaded
    std::fprintf(stderr, "[pdbridge decoder] %s\n", diagnose_load_death(o.gguf, code).c_str());
    return code;
  }
  std::fprintf(stderr, "[pdbridge decoder] ready: llama-server answers on http://%s:%d\n", o.host.c_str(), o.port);
  std::fflush(stderr);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace pdb
