#!/usr/bin/env bash
# The decode side built as its users build it, away from this Debian x86-64 box's defaults (README "Decode side"):
#   scripts/decode_side.sh libcxx   clang + libc++ (as Apple clang builds on a Mac): its dependencies that are
#                                   C++ libraries are built against libc++ first (prometheus-cpp and cpp-httplib from
#                                   Debian's own source packages, GoogleTest from /usr/src/googletest; spdlog and fmt
#                                   header-only), then the decode side, its unit tests run, and the binary is checked
#                                   to hold no libstdc++.
#   scripts/decode_side.sh arm64    an aarch64 cross-build (Debian's multiarch :arm64 packages, g++-aarch64-linux-gnu)
#                                   whose unit tests run under qemu-user; then the decode side's integration tests run
#                                   with the aarch64 pdbridge as front door, launcher and doctor, in front of the aarch64
#                                   llama-server of scripts/neon_decoder.sh (the prefill server stays this box's).
# Dependencies are cached under ~/.cache/pdbridge keyed by the Debian package versions; the build folders are
# build/decode-libcxx/ and build/decode-arm64/. Needs the full build first (`make build`) for the arm64 test run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${PDBRIDGE_CACHE:-$HOME/.cache/pdbridge}"
JOBS="${JOBS:-$(nproc)}"
log() { echo "[decode-side] $*" >&2; }
die() { echo "[decode-side] ERROR: $*" >&2; exit 1; }
SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo

apt_install() {
  local missing=()
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
  ((${#missing[@]})) || return 0
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" || die "apt-get install failed: ${missing[*]}"
}

# Debian's source package of $1 unpacked into $2 (deb-src lists kept apart from the system's).
debian_source() {
  local pkg="$1" dest="$2" lists="$CACHE/apt-src"
  [[ -d $dest ]] && return 0
  mkdir -p "$lists/lists/partial" "$dest.dl"
  cat >"$lists/src.sources" <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  local O=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$lists" -o "Dir::State::Lists=$lists/lists")
  apt-get "${O[@]}" update -qq || die "apt-get update (deb-src) failed"
  (cd "$dest.dl" && apt-get "${O[@]}" source --download-only "$pkg" >/dev/null 2>&1) || die "apt-get source $pkg failed"
  mkdir -p "$dest"
  tar -xf "$dest.dl"/*.orig.tar.* -C "$dest" --strip-components=1 || die "cannot unpack $pkg"
  rm -rf "$dest.dl"
}

libcxx() {
  apt_install clang libc++-14-dev libc++abi-14-dev googletest dpkg-dev cmake pkg-config
  local key; key=$(dpkg-query -W -f='${Version}' clang-14 libc++-14-dev prometheus-cpp-dev libcpp-httplib-dev googletest | sha256sum | cut -c1-10)
  local deps="$CACHE/decode-libcxx-$key" cc=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS=-stdlib=libc++
    "-DCMAKE_EXE_LINKER_FLAGS=-stdlib=libc++ -Wl,--as-needed" -DCMAKE_SHARED_LINKER_FLAGS=-stdlib=libc++ -DCMAKE_BUILD_TYPE=Release)
  if [[ ! -f $deps/.complete ]]; then
    rm -rf "$deps"; mkdir -p "$deps/src"
    debian_source prometheus-cpp "$deps/src/prometheus-cpp"
    debian_source cpp-httplib "$deps/src/cpp-httplib"
    log "building prometheus-cpp (core) and GoogleTest against libc++ into $deps"
    cmake -S "$deps/src/prometheus-cpp" -B "$deps/build/prom" "${cc[@]}" -DCMAKE_INSTALL_PREFIX="$deps" -DENABLE_PULL=OFF -DENABLE_PUSH=OFF \
      -DENABLE_COMPRESSION=OFF -DENABLE_TESTING=OFF -DUSE_THIRDPARTY_LIBRARIES=OFF -DBUILD_SHARED_LIBS=OFF >"$deps/prom.log" 2>&1 \
      && cmake --build "$deps/build/prom" -j "$JOBS" --target install >>"$deps/prom.log" 2>&1 || { tail -30 "$deps/prom.log"; die "prometheus-cpp failed"; }
    cmake -S /usr/src/googletest -B "$deps/build/gtest" "${cc[@]}" -DCMAKE_INSTALL_PREFIX="$deps" >"$deps/gtest.log" 2>&1 \
      && cmake --build "$deps/build/gtest" -j "$JOBS" --target install >>"$deps/gtest.log" 2>&1 || { tail -30 "$deps/gtest.log"; die "GoogleTest failed"; }
    touch "$deps/.complete"
  fi
  local b="$ROOT/build/decode-libcxx"
  log "building the decode side with clang + libc++ into $b"
  cmake -S "$ROOT" -B "$b" "${cc[@]}" -DPDBRIDGE_DECODE_SIDE=ON -DPDBRIDGE_HEADER_ONLY_LOGGING=ON \
    -DPDBRIDGE_HTTPLIB_INCLUDE="$deps/src/cpp-httplib" -DCMAKE_PREFIX_PATH="$deps" -DPDBRIDGE_TEST_BUILD_DIR="$ROOT/build" >"$b.cmake.log" 2>&1 || { tail -30 "$b.cmake.log"; die "cmake failed"; }
  cmake --build "$b" -j "$JOBS" || die "the decode side does not build with clang + libc++"
  # ldd's output taken whole first: `ldd | grep -q` under pipefail fails when grep exits before ldd has written all
  local libs
  libs=$(ldd "$b/pdbridge") || die "ldd $b/pdbridge failed"
  if grep -q 'libstdc++' <<<"$libs"; then die "$b/pdbridge links libstdc++: a dependency was not built against libc++"; fi
  grep -q 'libc++' <<<"$libs" || die "$b/pdbridge does not link libc++"
  "$b/pdbridge" --help >/dev/null || die "$b/pdbridge --help failed"
  "$b/tests/decode_side/decode_side_tests" --gtest_brief=1
  log "clang + libc++: the decode side builds, links libc++ only, and its unit tests pass"
}

arm64() {
  [[ -x $ROOT/build/pdbridge ]] || die "build the full pdbridge first (make build): its prefill server and test models serve the test run"
  dpkg --print-foreign-architectures | grep -qx arm64 || { $SUDO dpkg --add-architecture arm64; $SUDO apt-get update -qq; }
  # prometheus-cpp-dev:arm64 cannot sit beside the amd64 one the full build needs (installing it removes the
  # other): its core is cross-built from Debian's source package instead
  apt_install g++-aarch64-linux-gnu qemu-user libcurl4-openssl-dev:arm64 libspdlog-dev:arm64 libfmt-dev:arm64 \
    libcpp-httplib-dev:arm64 libxxhash-dev:arm64 libzstd-dev:arm64 libgtest-dev:arm64 libssl-dev:arm64 \
    zlib1g-dev:arm64 libbrotli-dev:arm64 nlohmann-json3-dev libcli11-dev dpkg-dev
  local cross=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc
    -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -DCMAKE_LIBRARY_ARCHITECTURE=aarch64-linux-gnu)
  local key; key=$(dpkg-query -W -f='${Version}' g++-aarch64-linux-gnu prometheus-cpp-dev | sha256sum | cut -c1-10)
  local deps="$CACHE/decode-arm64-$key"
  if [[ ! -f $deps/.complete ]]; then
    rm -rf "$deps"; mkdir -p "$deps/src"
    debian_source prometheus-cpp "$deps/src/prometheus-cpp"
    log "cross-building prometheus-cpp (core) for aarch64 into $deps"
    cmake -S "$deps/src/prometheus-cpp" -B "$deps/build/prom" "${cross[@]}" -DCMAKE_INSTALL_PREFIX="$deps" -DENABLE_PULL=OFF -DENABLE_PUSH=OFF \
      -DENABLE_COMPRESSION=OFF -DENABLE_TESTING=OFF -DUSE_THIRDPARTY_LIBRARIES=OFF -DBUILD_SHARED_LIBS=OFF >"$deps/prom.log" 2>&1 \
      && cmake --build "$deps/build/prom" -j "$JOBS" --target install >>"$deps/prom.log" 2>&1 || { tail -30 "$deps/prom.log"; die "prometheus-cpp failed"; }
    touch "$deps/.complete"
  fi
  local b="$ROOT/build/decode-arm64"
  log "cross-building the decode side for aarch64 into $b"
  PKG_CONFIG_LIBDIR=/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig \
    cmake -S "$ROOT" -B "$b" "${cross[@]}" -DCMAKE_PREFIX_PATH="$deps" \
      -DPDBRIDGE_DECODE_SIDE=ON -DPDBRIDGE_TEST_BUILD_DIR="$ROOT/build" >"$b.cmake.log" 2>&1 || { tail -30 "$b.cmake.log"; die "cmake failed"; }
  cmake --build "$b" -j "$JOBS" || die "the aarch64 decode side does not build"
  file "$b/pdbridge" | grep -q aarch64 || die "$b/pdbridge is not an aarch64 binary"
  # run under qemu-user: a wrapper is what the test stacks start as the decode side's pdbridge
  printf '#!/bin/sh\nexec qemu-aarch64 -L / "%s" "$@"\n' "$b/pdbridge" >"$b/pdbridge-qemu"
  chmod +x "$b/pdbridge-qemu"
  qemu-aarch64 -L / "$b/tests/decode_side/decode_side_tests" --gtest_brief=1
  local server; server="$("$ROOT/scripts/neon_decoder.sh")"
  log "integration tests: aarch64 front door / launcher / doctor ($b/pdbridge-qemu) with the aarch64 llama-server ($server)"
  PDBRIDGE_DECODE_BIN="$b/pdbridge-qemu" PDBRIDGE_LLAMA_SERVER="$server" "$ROOT/build/tests/integration_tests" --gtest_brief=1 \
    --gtest_filter="${ARM64_TESTS:-BridgeVerdicts.ShortWarmAndQuantizedCache:BridgeVerdicts.PrefillDownIsDeclinedAndServedNatively:Verdicts.*:DecoderLaunch.*:Doctor.HealthyDeploymentPasses}"
  log "aarch64: the decode side cross-builds, its unit tests pass under qemu-user, and so do the integration tests above"
}

case "${1:-}" in
  libcxx) libcxx ;;
  arm64) arm64 ;;
  *) die "usage: scripts/decode_side.sh libcxx|arm64" ;;
esac
