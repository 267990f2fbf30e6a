#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang (address + undefined sanitizers), seeds them with valid
# inputs, and runs each for RUNS executions. Exit status is non-zero on any crash or sanitizer report.
#   scripts/fuzz.sh [RUNS]   (default 20000 executions each: the CI smoke run)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUNS="${1:-20000}"
B="${FUZZ_BUILD:-$ROOT/build/fuzz}"
command -v clang++ >/dev/null || { echo "fuzz: clang++ is required (apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }
CC=clang CXX=clang++ cmake -S "$ROOT" -B "$B" -DPDBRIDGE_FUZZ=ON -DPDBRIDGE_NO_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$B" -j "$(nproc)" >/dev/null
"$B/fuzz/fuzz_seeds" "$B"
status=0
for f in fuzz_frames fuzz_gguf fuzz_requests fuzz_dsv4_state fuzz_dsv4_frames; do
  log="$B/$f.log"
  if "$B/fuzz/$f" -runs="$RUNS" -max_len=65536 -seed=1 -print_final_stats=1 -artifact_prefix="$B/$f-" "$B/corpus-$f" >"$log" 2>&1; then
    execs=$(grep -o "stat::number_of_executed_units: [0-9]*" "$log" | awk '{print $2}')
    echo "fuzz: $f: $execs executions, no crashes"
  else
    echo "fuzz: $f FAILED (log $log):" >&2
    grep -E "ERROR|SUMMARY|Test unit written" "$log" >&2 || tail -20 "$log" >&2
    status=1
  fi
done
exit $status
