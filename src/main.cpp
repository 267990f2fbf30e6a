// pdbridge: one program whose subcommands are the product's processes and tools.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"pdbridge — prefill long prompts on a fast GPU box for a model decoded by llama.cpp elsewhere"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Expand all help");
  pdb::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return pdb::command_exit_code();
}
