#!/bin/bash
# An ARM NEON decoder on an x86 machine: llama-server cross-compiled for aarch64 from the same llama.cpp
# source (static, `-march=$ARM_ARCH`, default armv8.2-a+dotprod+fp16 as on Apple M1 and Graviton 2/3) and
# run under qemu-user, whose NEON and FP16 arithmetic is IEEE-exact in software. It is a slow decoder
# (tiny models only), but its arithmetic is what the same binary computes on an ARM CPU, so it measures the
# fidelity class of a NEON decoder where no ARM machine is at hand.
#   scripts/neon_decoder.sh            builds (cached in ~/.cache/pdbridge/llama-neon-<commit>-<arch>) and
#                                      prints the path of a wrapper that runs it (a --server-bin for
#                                      `pdbridge decoder`, or PDBRIDGE_LLAMA_SERVER for the tests)
# Needs: apt-get install g++-aarch64-linux-gnu qemu-user
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
ARM_ARCH=${ARM_ARCH:-armv8.2-a+dotprod+fp16}
JOBS=${JOBS:-$(nproc)}
CACHE=${PDBRIDGE_CACHE:-$HOME/.cache/pdbridge}
command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null \
  || { echo "neon_decoder.sh: needs g++-aarch64-linux-gnu and qemu-user (apt-get install g++-aarch64-linux-gnu qemu-user)" >&2; exit 1; }
commit=$(cat "$root/build/llama/COMMIT")
src="$CACHE/llama-src-${commit:0:12}"
[ -d "$src/ggml" ] || { echo "neon_decoder.sh: no llama.cpp source at $src (run scripts/setup.sh first)" >&2; exit 1; }
out="$CACHE/llama-neon-${commit:0:12}-${ARM_ARCH//+/_}"
if [[ ! -x $out/bin/llama-server.aarch64 || ! -f $out/.complete ]]; then
  echo "neon_decoder.sh: cross-building llama-server for aarch64 ($ARM_ARCH) into $out (~10 min on 2 cores)" >&2
  cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 \
    -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ \
    -DCMAKE_EXE_LINKER_FLAGS=-static -DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH="$ARM_ARCH" -DGGML_OPENMP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF > "$out.cmake.log" 2>&1 || { tail -30 "$out.cmake.log" >&2; exit 1; }
  cmake --build "$out/build" -j "$JOBS" --target llama-server > "$out.build.log" 2>&1 || { tail -40 "$out.build.log" >&2; exit 1; }
  mkdir -p "$out/bin"
  cp "$out/build/bin/llama-server" "$out/bin/llama-server.aarch64"
  printf '#!/bin/sh\n# llama-server for aarch64 (%s) under qemu-user\nexec qemu-aarch64 -cpu max "%s" "$@"\n' \
    "$ARM_ARCH" "$out/bin/llama-server.aarch64" > "$out/bin/llama-server"
  chmod +x "$out/bin/llama-server"
  echo "$commit" > "$out/.complete"
fi
"$out/bin/llama-server" --version > /dev/null 2>&1 || { echo "neon_decoder.sh: $out/bin/llama-server does not run" >&2; exit 1; }
echo "$out/bin/llama-server"
