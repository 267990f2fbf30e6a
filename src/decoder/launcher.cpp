#include "decoder/launcher.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "common/process.h"

namespace pdb {
namespace fs = std::filesystem;

namespace {
volatile sig_atomic_t g_child = 0;
void forward(int sig) { if (g_child > 0) kill(pid_t(g_child), sig); }
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
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    std::vector<char*> args;
    for (auto& s : argv) args.push_back(s.data());
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::fprintf(stderr, "[pdbridge decoder] exec %s failed: %s\n", args[0], std::strerror(errno));
    _exit(127);
  }
  g_child = pid;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace pdb
