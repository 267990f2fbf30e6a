// pdbridge: one program whose subcommands are the product's processes and tools.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"

int main(int argc, char** argv) {
#if defined(__GLIBC__)
  // A capture frame holds a layer-chunk's K and V rows: 33.5 MB for 8,192 rows of an 8B model's f16 cache,
  // made on the backend's delivery thread and freed on the sender's. glibc serves blocks above its mmap
  // threshold (dynamic, at most 32 MB) with a fresh mmap, and a thread's arena holds heaps of at most 64 MB,
  // so every such frame was faulted in page by page and unmapped again: on the H200, `bench prefill` with
  // frames fell from 22,656 to 12,809 tok/s at 32K with 8K-token chunks (4K chunks: 16.7 MB frames, no
  // loss). Here: one-thread-makes, another-frees 34 MB blocks at 1.0 GB/s by default, 6.9 GB/s with the
  // settings below (scripts/bench/malloc_frames.cpp). One arena and a high threshold keep such blocks on
  // the heap for reuse; freed memory above 512 MB at the heap's top still goes back to the system.
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
#endif
  CLI::App app{"pdbridge — prefill long prompts on a fast GPU box for a model decoded by llama.cpp elsewhere"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Expand all help");
#if defined(PDBRIDGE_DECODE_SIDE_ONLY)
  pdb::register_decode_side_commands(app);
#else
  pdb::register_commands(app);
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return pdb::command_exit_code();
}
