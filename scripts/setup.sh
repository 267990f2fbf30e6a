#!/usr/bin/env bash
# Idempotent set-up: Debian build dependencies, then the decoder (unmodified llama.cpp) from the
# source bundle shipped in the npm package node-llama-cpp. The llama.cpp build is cached outside
# the repository, keyed by the bundle's commit, and only rebuilt when that cache is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NODE_LLAMA_CPP_VERSION="3.21.1"
CACHE="${PDBRIDGE_CACHE:-$HOME/.cache/pdbridge}"
JOBS="${JOBS:-$(nproc)}"
LLAMA_TOOLS=(llama-server llama-quantize llama-cli llama-bench llama-tokenize)

log() { echo "[setup] $*" >&2; }

# llama.cpp's AMX matmul (compiled in by -march=native on Sapphire Rapids and later Xeons) crashes in
# `ldtilecfg` loading any Q4_0/Q8_0 GGUF (llama.cpp issue 20824: the XTILEDATA permission is asked for on
# the main thread only) and its extra buffer type aborts deepseek2's graphs (`*cur_backend_id != -1`). The
# decoder is built without it. Nor with AVX512-FP16: there ggml's f16 dot products (simd-mappings.h,
# GGML_F16x32) accumulate in half precision, so the decoder's own decode of a prompt's last token differs from
# its batched prefill of it (the MoE experts' F16 products, the decode's attention over an f16 cache) and a
# restored cache answers differently from a computed one on random-weight models (docs/RESULTS.md, session 39).
# Everything else stays native (AVX-512, VNNI). The flags are part of the cache key, so a cache built before
# this rebuilds.
LLAMA_ARCH_FLAGS=""
case "$(uname -m)" in x86_64|amd64) LLAMA_ARCH_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-avx512fp16" ;; esac
LLAMA_FLAGS_KEY="$(printf '%s' "v2 $LLAMA_ARCH_FLAGS" | sha256sum | cut -c1-8)"

# Fails the set-up when a llama.cpp binary still carries the AMX kernels (a compiler that ignored the flags).
check_no_amx() {
  # nm's output taken whole: under pipefail, `nm | grep -q` reads as "absent" when grep's early exit cuts nm off
  if command -v nm >/dev/null 2>&1 && grep -q ggml_backend_amx_buffer_type <<<"$(nm "$1" 2>/dev/null)"; then
    die "$1 was built with llama.cpp's AMX kernels, which crash on AMX hosts; remove it and rebuild"
  fi
}
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

APT_PACKAGES=(build-essential cmake git pkg-config ca-certificates
  libcpp-httplib-dev libcurl4-openssl-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev
  libxxhash-dev libzstd-dev libopenblas-dev libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev zlib1g-dev libbrotli-dev prometheus-cpp-dev clang libclang-rt-14-dev gnuplot-nox python3 curl nodejs npm iproute2
  libc++-14-dev libc++abi-14-dev googletest dpkg-dev)

install_apt_packages() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # node/npm may come from outside Debian (e.g. nodesource); accept any working npm.
  if command -v npm >/dev/null 2>&1; then
    local kept=(); for p in "${missing[@]}"; do [[ $p == nodejs || $p == npm ]] || kept+=("$p"); done
    missing=("${kept[@]+"${kept[@]}"}")
  fi
  if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    local SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
    $SUDO apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" \
      || die "apt-get install failed for: ${missing[*]}"
  fi
}

fetch_bundle() {
  local dir="$CACHE/npm/node-llama-cpp-$NODE_LLAMA_CPP_VERSION"
  local bundle="$dir/package/llama/gitRelease.bundle"
  if [[ ! -s $bundle ]]; then
    command -v npm >/dev/null 2>&1 || die "npm is required to fetch node-llama-cpp@$NODE_LLAMA_CPP_VERSION (apt-get install npm)"
    mkdir -p "$dir"
    log "fetching node-llama-cpp@$NODE_LLAMA_CPP_VERSION from the npm registry"
    (cd "$dir" && npm pack --silent "node-llama-cpp@$NODE_LLAMA_CPP_VERSION" >/dev/null) \
      || die "npm pack node-llama-cpp@$NODE_LLAMA_CPP_VERSION failed"
    tar -xzf "$dir/node-llama-cpp-$NODE_LLAMA_CPP_VERSION.tgz" -C "$dir" package/llama/gitRelease.bundle \
      || die "the npm package has no package/llama/gitRelease.bundle"
  fi
  [[ -s $bundle ]] || die "llama.cpp bundle missing: $bundle"
  echo "$bundle"
}

bundle_commit() {
  local commit; commit="$(git bundle list-heads "$1" | awk '$2=="HEAD"{print $1}')"
  [[ -n $commit ]] || die "cannot read HEAD from $1"
  echo "$commit"
}

# The llama.cpp tree of a bundle's commit, cloned once into $CACHE/llama-src-<commit12>.
clone_bundle() {
  local bundle="$1" commit="$2" src="$CACHE/llama-src-${2:0:12}"
  if [[ ! -d $src/.git ]]; then
    log "cloning llama.cpp $commit from the bundle"
    rm -rf "$src"; git -c advice.detachedHead=false clone -q "$bundle" "$src" || die "git clone of $bundle failed"
    git -C "$src" -c advice.detachedHead=false checkout -q "$commit"
  fi
}

# build_tools SRC OUT WHAT "EXTRA CMAKE FLAGS" TARGET...: a CPU build of llama.cpp's TARGETs into OUT/bin, once
# (OUT/.complete holds the commit), with the set-up's flags (no AMX).
build_tools() {
  local src="$1" out="$2" what="$3" extra="$4"; shift 4
  [[ -x $out/bin/llama-server && -f $out/.complete ]] && return 0
  log "building $what into $out (first time: ~8-10 min on 2 cores)"
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$LLAMA_ARCH_FLAGS" -DCMAKE_CXX_FLAGS="$LLAMA_ARCH_FLAGS" $extra \
    >"$out.cmake.log" 2>&1 || { tail -30 "$out.cmake.log"; die "$what: cmake failed"; }
  cmake --build "$out/build" -j "$JOBS" --target "$@" >"$out.build.log" 2>&1 \
    || { tail -40 "$out.build.log"; die "$what: build failed (log: $out.build.log)"; }
  mkdir -p "$out/bin"
  for t in "$@"; do cp "$out/build/bin/$t" "$out/bin/$t"; done
  check_no_amx "$out/bin/llama-server"
  git -C "$src" rev-parse HEAD >"$out/.complete"
}

build_llama() {
  local bundle="$1" commit; commit="$(bundle_commit "$bundle")"
  local src="$CACHE/llama-src-${commit:0:12}" out="$CACHE/llama-${commit:0:12}-$LLAMA_FLAGS_KEY"
  clone_bundle "$bundle" "$commit"
  build_tools "$src" "$out" "llama.cpp ${commit:0:12}" "" "${LLAMA_TOOLS[@]}"
  mkdir -p "$ROOT/build/llama"
  ln -sfn "$out/bin" "$ROOT/build/llama/bin"
  ln -sfn "$src" "$ROOT/build/llama/src"
  echo "$commit" >"$ROOT/build/llama/COMMIT"
  "$ROOT/build/llama/bin/llama-server" --version >/dev/null 2>&1 || die "built llama-server does not run"
  log "llama.cpp ${commit:0:12} ready in build/llama/bin"
}

# A second llama-server from the same source with ggml's OpenBLAS backend: its prompt matmuls sum in
# OpenBLAS's order, which the recipe does not mirror, so the tests cover a CPU decoder of the
# fidelity guard's tolerance class (as a Metal or CUDA decoder is). Cached like the first; only the
# server is built. PDBRIDGE_BLAS_DECODER=0 skips it (the tolerance tests then fail, saying why).
build_llama_blas() {
  [[ ${PDBRIDGE_BLAS_DECODER:-1} == 0 ]] && { log "skipping the OpenBLAS llama-server (PDBRIDGE_BLAS_DECODER=0)"; return; }
  local commit; commit="$(cat "$ROOT/build/llama/COMMIT")"
  local src="$CACHE/llama-src-${commit:0:12}" out="$CACHE/llama-blas-${commit:0:12}-$LLAMA_FLAGS_KEY"
  build_tools "$src" "$out" "llama-server ${commit:0:12} with GGML_BLAS=ON (OpenBLAS)" "-DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS" llama-server
  ln -sfn "$out/bin" "$ROOT/build/llama/bin-blas"
  "$ROOT/build/llama/bin-blas/llama-server" --version >/dev/null 2>&1 || die "built OpenBLAS llama-server does not run"
  log "OpenBLAS llama-server ready in build/llama/bin-blas"
}

# Other llama.cpp releases, as users run them: the llama-server of node-llama-cpp VERSION's own bundle, for the
# release tests (tests/decode_side_test.cpp) and the release matrix (docs/RESULTS.md). Cached like the pinned
# build, keyed by the bundle's commit and the flags; linked at build/llama/releases/VERSION/llama-server.
# PDBRIDGE_RELEASES lists them (default: 3.19.1, the last release with state version 2; "" builds none).
build_llama_release() {
  local version="$1" bundle commit
  bundle="$(NODE_LLAMA_CPP_VERSION="$version" fetch_bundle)"
  commit="$(bundle_commit "$bundle")"
  local src="$CACHE/llama-src-${commit:0:12}" out="$CACHE/llama-release-$version-${commit:0:12}-$LLAMA_FLAGS_KEY"
  clone_bundle "$bundle" "$commit"
  build_tools "$src" "$out" "llama-server of node-llama-cpp $version (llama.cpp ${commit:0:12})" "" llama-server
  mkdir -p "$ROOT/build/llama/releases"
  ln -sfn "$out/bin" "$ROOT/build/llama/releases/$version"
  "$ROOT/build/llama/releases/$version/llama-server" --version >/dev/null 2>&1 || die "llama-server of node-llama-cpp $version does not run"
  log "llama-server of node-llama-cpp $version ready in build/llama/releases/$version"
}

install_apt_packages
build_llama "$(fetch_bundle)"
build_llama_blas
for v in ${PDBRIDGE_RELEASES-3.19.1}; do build_llama_release "$v"; done
