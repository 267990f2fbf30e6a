// Child processes: run-to-completion helpers and a long-lived child whose signals we forward.
#pragma once
#include <string>
#include <vector>

namespace pdb {

std::string shell_quote(const std::string& s);
std::string join_command(const std::vector<std::string>& argv);

struct RunResult { int exit_code = -1; std::string output; };
// Runs argv (no shell), capturing stdout+stderr. exit_code is 128+signal when killed.
RunResult run_capture(const std::vector<std::string>& argv);

// Directory of the running executable (for locating build/llama/bin next to build/pdbridge).
std::string self_dir();

// "exited with status N" or "killed by signal N (name)" for an exit code of run_capture's convention.
std::string describe_exit_status(int code);
// Whether this x86 CPU has AMX tiles (Sapphire Rapids and later Xeons): llama.cpp's AMX matmul crashes there.
bool cpu_has_amx();

}  // namespace pdb
