# Sourced by the device scripts (pipeline.sh, scale.sh, pace.sh, million8b.sh) with DEV set to the carried .dev
# folder: unpacks the bundle once, puts its libraries on LD_LIBRARY_PATH and defines PDB and `up`.
R=/tmp/res; M=/tmp/m; P=/tmp/pdb
mkdir -p $R $M $P
[ -x $P/build/pdbridge ] || tar -xJf $DEV/bundle.tar.xz -C $P || { echo "env.sh: bundle extract failed"; return 1; }
export LD_LIBRARY_PATH=$P/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# NCCL (loaded by `--tp` at run time): the CUDA toolkit's where it is installed, else the one PyTorch ships.
if [ ! -e /usr/local/cuda/lib64/libnccl.so.2 ] && ! ldconfig -p 2>/dev/null | grep -q libnccl.so.2; then
  NCCL_DIR=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
  [ -n "$NCCL_DIR" ] && [ -e "$NCCL_DIR/libnccl.so.2" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$NCCL_DIR
fi
export NCCL_NVLS_ENABLE=0
# cuDNN (loaded by PDBRIDGE_ATTN=cudnn at run time): the toolkit's where installed, else the one PyTorch ships.
if [ ! -e /usr/local/cuda/lib64/libcudnn.so.9 ] && ! ldconfig -p 2>/dev/null | grep -q libcudnn.so.9; then
  CUDNN_DIR=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
  [ -n "$CUDNN_DIR" ] && [ -e "$CUDNN_DIR/libcudnn.so.9" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$CUDNN_DIR
fi
# The bundle carries the build machine's libcurl (pdbridge reads the prefill stream with it). The device's own
# curl binary is newer and cannot load against it ("undefined symbol: curl_global_trace"), which on
# 2026-11-30 left every health check failing for 450 s: curl runs without the bundle's libraries.
if [ ! -x $P/shim/curl ]; then
  mkdir -p $P/shim
  printf '#!/bin/sh\nexec env -u LD_LIBRARY_PATH %s "$@"\n' "$(command -v curl)" > $P/shim/curl
  chmod +x $P/shim/curl
fi
case ":$PATH:" in *":$P/shim:"*) ;; *) export PATH=$P/shim:$PATH ;; esac
PDB=$P/build/pdbridge
# up URL [PID]: waits for a health URL; gives up at once when curl itself cannot run (exit 127: not found or
# not loadable) or when the server's process PID has exited (its log says why).
up() {
  local rc
  for _ in $(seq 1 900); do
    curl -sf "$1" > /dev/null; rc=$?
    [ $rc = 0 ] && return 0
    [ $rc = 127 ] && { echo "up: curl cannot run" >&2; return 1; }
    [ -n "${2:-}" ] && ! kill -0 "$2" 2>/dev/null && { echo "up: the process behind $1 has exited" >&2; return 1; }
    sleep 0.5
  done
  return 1
}
