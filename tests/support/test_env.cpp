#include "support/test_env.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <httplib.h>

namespace pdb::test {
namespace fs = std::filesystem;

std::string build_dir() { return PDBRIDGE_BUILD_DIR; }
std::string llama_bin() { return build_dir() + "/llama/bin"; }
std::string llama_src() { return build_dir() + "/llama/src"; }
std::string models_dir() { return build_dir() + "/test-models"; }
std::string pdbridge_bin() { return build_dir() + "/pdbridge"; }
std::string decode_side_bin() {
  const char* b = std::getenv("PDBRIDGE_DECODE_BIN");
  return b && *b ? std::string(b) : pdbridge_bin();
}

namespace {
// Test directories hold models, slot files and states of hundreds of MB: thousands of test processes
// that left them behind filled a CI disk. Each process removes its own at exit; PDBRIDGE_KEEP_TEST_DIRS=1
// keeps them for a post-mortem.
class ScratchDirs {
 public:
  std::string make(const std::string& tag) {
    fs::path p = fs::temp_directory_path() / ("pdbridge-test-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(counter_++));
    fs::remove_all(p);
    fs::create_directories(p);
    dirs_.push_back(p);
    return p.string();
  }
  ~ScratchDirs() {
    const char* keep = std::getenv("PDBRIDGE_KEEP_TEST_DIRS");
    if (keep != nullptr && std::string(keep) == "1") return;
    for (const auto& d : dirs_) {
      std::error_code ec;
      fs::remove_all(d, ec);
    }
  }

 private:
  int counter_ = 0;
  std::vector<fs::path> dirs_;
};

ScratchDirs& scratch_dirs() {
  static ScratchDirs dirs;
  return dirs;
}
}  // namespace

std::string temp_dir(const std::string& tag) { return scratch_dirs().make(tag); }

size_t files_in(const std::string& dir) {
  auto count = [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir)) { (void)e; ++n; }
    return n;
  };
  // The front door removes restored state files on a worker after the response has started: give it 10 s.
  size_t n = count();
  for (int i = 0; i < 200 && n > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    n = count();
  }
  return n;
}

namespace {
// Binds (and releases) 127.0.0.1:port; port 0 asks the kernel for one. The bound port, or -1.
int try_bind(int port) {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(port));
  int got = -1;
  if (bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    socklen_t len = sizeof a;
    getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
    got = ntohs(a.sin_port);
  }
  close(s);
  return got;
}
}  // namespace

// A port below the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be taken, before the
// server started on it binds, by any outgoing connection of the tests running beside it (a CI run lost
// BridgeEndToEnd's decoder that way: "couldn't bind HTTP server socket"). Random, so that tests picking at the same
// moment rarely collide; the kernel's choice only where no such range is free.
int free_port() {
  int lo = 32768;
  if (std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range"); f) f >> lo;
  if (lo > 11000) {
    static std::mt19937 rng(std::random_device{}() ^ uint32_t(getpid()));
    for (int attempt = 0; attempt < 200; ++attempt) {
      const int port = 10000 + int(rng() % uint32_t(lo - 10000));
      if (try_bind(port) == port) return port;
    }
  }
  const int port = try_bind(0);
  if (port < 0) throw std::runtime_error("bind failed");
  return port;
}

Child::Child(std::vector<std::string> argv, const std::string& log_path) : log_path_(log_path) {
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) { dup2(fd, 1); dup2(fd, 2); close(fd); }
    setpgid(0, 0);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
}

Child::~Child() { if (pid_ > 0 && status_ < 0) stop(SIGKILL, 5); }

bool Child::running() {
  if (status_ >= 0) return false;
  int st;
  const pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r == pid_) { status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st); return false; }
  return true;
}

int Child::stop(int sig, double timeout_s) {
  if (!running()) return status_;
  kill(pid_, sig);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (!running()) return status_;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(-pid_, SIGKILL);
  kill(pid_, SIGKILL);
  int st;
  waitpid(pid_, &st, 0);
  status_ = 128 + SIGKILL;
  return status_;
}

std::string Child::log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool wait_http_ok(const std::string& host, int port, const std::string& path, double timeout_s, Child* watch) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  httplib::Client cli(host, port);
  cli.set_connection_timeout(1, 0);
  cli.set_read_timeout(2, 0);
  while (std::chrono::steady_clock::now() < deadline) {
    auto r = cli.Get(path.c_str());
    if (r && r->status == 200) return true;
    if (watch && !watch->running()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

}  // namespace pdb::test
