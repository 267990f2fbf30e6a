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
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

APT_PACKAGES=(build-essential cmake git pkg-config ca-certificates
  libcpp-httplib-dev libcurl4-openssl-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev
  libxxhash-dev libzstd-dev libopenblas-dev libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev zlib1g-dev libbrotli-dev prometheus-cpp-dev clang libclang-rt-14-dev gnuplot-nox python3 curl nodejs npm iproute2)

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

build_llama() {
  local bundle="$1"
  local commit; commit="$(git bundle list-heads "$bundle" | awk '$2=="HEAD"{print $1}')"
  [[ -n $commit ]] || die "cannot read HEAD from $bundle"
  local src="$CACHE/llama-src-${commit:0:12}" out="$CACHE/llama-${commit:0:12}"
  if [[ ! -x $out/bin/llama-server || ! -f $out/.complete ]]; then
    if [[ ! -d $src/.git ]]; then
      log "cloning llama.cpp $commit from the bundle"
      rm -rf "$src"; git -c advice.detachedHead=false clone -q "$bundle" "$src" || die "git clone of bundle failed"
      git -C "$src" -c advice.detachedHead=false checkout -q "$commit"
    fi
    log "building llama.cpp ${commit:0:12} (first time: ~10 min on 2 cores) into $out"
    cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
      -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF >"$out.cmake.log" 2>&1 || { tail -30 "$out.cmake.log"; die "llama.cpp cmake failed"; }
    cmake --build "$out/build" -j "$JOBS" --target "${LLAMA_TOOLS[@]}" >"$out.build.log" 2>&1 \
      || { tail -40 "$out.build.log"; die "llama.cpp build failed (log: $out.build.log)"; }
    mkdir -p "$out/bin"
    for t in "${LLAMA_TOOLS[@]}"; do cp "$out/build/bin/$t" "$out/bin/$t"; done
    echo "$commit" >"$out/.complete"
  fi
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
  local src="$CACHE/llama-src-${commit:0:12}" out="$CACHE/llama-blas-${commit:0:12}"
  if [[ ! -x $out/bin/llama-server || ! -f $out/.complete ]]; then
    log "building llama-server ${commit:0:12} with GGML_BLAS=ON (OpenBLAS; first time: ~8 min on 2 cores) into $out"
    cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
      -DGGML_CUDA=OFF -DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS -DBUILD_SHARED_LIBS=OFF >"$out.cmake.log" 2>&1 \
      || { tail -30 "$out.cmake.log"; die "llama.cpp (BLAS) cmake failed"; }
    cmake --build "$out/build" -j "$JOBS" --target llama-server >"$out.build.log" 2>&1 \
      || { tail -40 "$out.build.log"; die "llama.cpp (BLAS) build failed (log: $out.build.log)"; }
    mkdir -p "$out/bin"
    cp "$out/build/bin/llama-server" "$out/bin/llama-server"
    echo "$commit" >"$out/.complete"
  fi
  ln -sfn "$out/bin" "$ROOT/build/llama/bin-blas"
  "$ROOT/build/llama/bin-blas/llama-server" --version >/dev/null 2>&1 || die "built OpenBLAS llama-server does not run"
  log "OpenBLAS llama-server ready in build/llama/bin-blas"
}

install_apt_packages
build_llama "$(fetch_bundle)"
build_llama_blas
