// Shared test support: where the build, the llama.cpp binaries and the test models are, and a
// child-process handle for the real servers the end-to-end tests run against.
#pragma once
#include <sys/types.h>

#include <string>
#include <vector>

#include "cuda/device.h"

// GPU tests skip, saying why, where there is no GPU (CI) or no CUDA in the build.
#define PDB_SKIP_WITHOUT_GPU() \
  if (::pdb::cuda::device_count() == 0) GTEST_SKIP() << ::pdb::cuda::device_summary()

namespace pdb::test {

std::string build_dir();    // the CMake build directory (contains pdbridge, llama/)
std::string llama_bin();    // build/llama/bin
std::string llama_src();    // build/llama/src (llama.cpp tree: models/ggml-vocab-*.gguf)
std::string models_dir();   // build/test-models (made by the make_test_models fixture)
std::string pdbridge_bin();
// The pdbridge that runs the decode side's processes (front, decoder, doctor): PDBRIDGE_DECODE_BIN where set (the
// aarch64 decode-side build under qemu-user, scripts/decode_side.sh), else pdbridge_bin().
std::string decode_side_bin();
std::string temp_dir(const std::string& tag);  // fresh, unique; removed when the test process exits

int free_port();
size_t files_in(const std::string& dir);  // entries in a directory, once it empties or after 10 s (slot dirs must end empty)

// A child process (argv[0] is a path), stdout+stderr to a log file; killed on destruction.
class Child {
 public:
  Child(std::vector<std::string> argv, const std::string& log_path);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  pid_t pid() const { return pid_; }
  bool running();
  int stop(int sig = 15, double timeout_s = 20);  // returns exit status (128+sig if killed)
  std::string log() const;

 private:
  pid_t pid_ = -1;
  std::string log_path_;
  int status_ = -1;
};

// Polls GET url+path until HTTP 200 or timeout; false on timeout, or at once when `watch` (the server's process)
// has exited: a server that died while loading fails its test in seconds, not after the whole wait.
bool wait_http_ok(const std::string& host, int port, const std::string& path, double timeout_s, Child* watch = nullptr);

}  // namespace pdb::test
