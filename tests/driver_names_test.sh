#!/bin/bash
# Issue 34's rule: the front door, the prefill server, the wire and the engines' drivers never ask which
# architecture runs. Fails when their code (comments aside) names an architecture or tests one: an
# architecture's name as a string, `arch ==` / `arch !=`, the config's architecture predicates (mla(),
# qk_norm(), moe()), or DeepSeek-V4's types. What differs per architecture belongs in src/definitions/ (the
# engines' blocks), src/arch/ (the architecture table), src/recipes/ (the cached rows) and src/cache/ (cache kinds).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
files=$(ls src/front/*.h src/front/*.cpp src/prefill/*.h src/prefill/*.cpp src/wire/*.h src/wire/*.cpp \
  src/model/cpu_engine.h src/model/cpu_engine.cpp src/model/cuda_engine.h src/model/cuda_engine.cpp | grep -v '_test\.cpp$')
pattern='\barch *[!=]=|"(llama|qwen3|qwen3moe|deepseek2|deepseek4)"|\.mla\(\)|qk_norm\(\)|\.moe\(\)|dsv4|Dsv4|[Dd]eepseek'
found=0 n=0
for f in $files; do
  n=$((n + 1))
  hits=$(sed 's://.*$::' "$f" | grep -nE "$pattern")
  [ -n "$hits" ] && { echo "$hits" | sed "s|^|$f:|"; found=1; }
done
echo "$n files checked"
[ "$n" -gt 20 ] || { echo "too few files: did the folders move?"; exit 1; }
[ "$found" = 0 ]
