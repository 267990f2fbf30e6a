#include "common/process.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__APPLE__)
#include <mach-o/dyld.h>
#endif

#include <array>
#include <fstream>
#include <cstring>
#include <filesystem>
#include <stdexcept>

extern char** environ;

namespace pdb {

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,+@%") == std::string::npos)
    return s;
  std::string r = "'";
  for (char c : s) r += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return r + "'";
}

std::string join_command(const std::vector<std::string>& argv) {
  std::string r;
  for (const auto& a : argv) { if (!r.empty()) r += ' '; r += shell_quote(a); }
  return r;
}

RunResult run_capture(const std::vector<std::string>& argv) {
  int pipefd[2];
  if (pipe(pipefd) != 0) throw std::runtime_error("pipe failed");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
  posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
  posix_spawn_file_actions_addclose(&fa, pipefd[0]);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(pipefd[1]);
  if (rc != 0) { close(pipefd[0]); throw std::runtime_error("cannot start " + argv[0] + ": " + std::strerror(rc)); }
  RunResult r;
  std::array<char, 65536> buf;
  ssize_t n;
  while ((n = read(pipefd[0], buf.data(), buf.size())) > 0) r.output.append(buf.data(), size_t(n));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

std::string self_dir() {
#if defined(__APPLE__)
  char buf[4096];
  uint32_t size = sizeof(buf);
  if (_NSGetExecutablePath(buf, &size) != 0) return ".";
  std::error_code ec;
  auto p = std::filesystem::canonical(buf, ec);
  return ec ? std::filesystem::path(buf).parent_path().string() : p.parent_path().string();
#else
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
#endif
}

std::string describe_exit_status(int code) {
  if (code > 128) {
    const int sig = code - 128;
    const char* name = strsignal(sig);
    return "killed by signal " + std::to_string(sig) + " (" + (name ? name : "?") + ")";
  }
  return "exited with status " + std::to_string(code);
}

bool cpu_has_amx() {
#if defined(__linux__) && (defined(__x86_64__) || defined(__i386__))
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("flags", 0) == 0) return line.find(" amx_tile") != std::string::npos || line.find(" amx_int8") != std::string::npos;
#endif
  return false;
}

}  // namespace pdb
