// Helpers the command registrations share.
#pragma once
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace pdb {

// Runs a subcommand's body; its return value (or 1 and the error on stderr) is the process's exit code.
template <class Fn>
void guarded(const char* name, Fn&& fn) {
  try {
    set_command_exit_code(fn());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pdbridge %s: error: %s\n", name, e.what());
    set_command_exit_code(1);
  }
}

inline std::vector<std::string> split_csv(const std::string& s) {
  std::vector<std::string> out;
  size_t b = 0;
  while (b <= s.size()) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    if (e > b) out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

}  // namespace pdb
