// Subcommand registration: each seam of the system contributes its commands here.
#pragma once
#include <CLI/CLI.hpp>

namespace pdb {

void register_commands(CLI::App& app);              // every command (the full build)
void register_decode_side_commands(CLI::App& app);  // the decode side's alone (cli/commands_decode.cpp)
int command_exit_code();  // set by the subcommand that ran
void set_command_exit_code(int rc);


}  // namespace pdb
