#!/bin/bash
# Packs what the lent GPU machine needs to run pdbridge (it has CUDA and PyTorch but no apt): the
# stripped binaries built here, their non-system shared libraries, the llama.cpp CPU tools and vocab
# files, and the llama.cpp source (for its CUDA build there, the peer). Output: .dev/ (git-ignored),
# named in the device tool's `carry`. Usage: scripts/device/make_bundle.sh  (after `make`)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
b=$(mktemp -d)
trap 'rm -rf "$b"' EXIT
mkdir -p .dev "$b/build/models/needle" "$b/build/llama/bin" "$b/build/llama/src/models" "$b/build/tests" "$b/lib"
cp build/pdbridge "$b/build/"
# NO_TESTS=1: without the test binaries (room beside llama-cuda.tar.xz under the 64 MiB carry limit)
[ "${NO_TESTS:-0}" = 1 ] || cp build/tests/unit_tests build/tests/integration_tests "$b/build/tests/"
strip "$b/build/pdbridge" "$b/build/tests/"* 2>/dev/null || strip "$b/build/pdbridge"
# SLIM=1 (with NO_TESTS=1 ~18 MB): only the CPU llama-server and llama-quantize of the llama.cpp tools, the needle model's
# KEY, one vocab: enough for prefill/front/decoder runs on GGUFs carried beside it (parity_types.sh GGUF_DIR)
if [ "${SLIM:-0}" = 1 ]; then
  cp build/llama/bin/llama-server build/llama/bin/llama-quantize "$b/build/llama/bin/"
  cp build/models/needle/KEY "$b/build/models/needle/"
  cp build/llama/src/models/ggml-vocab-llama-bpe.gguf "$b/build/llama/src/models/"
else
  # LLAMA_BINS: which llama.cpp CPU tools (default all; e.g. "llama-server llama-quantize llama-tokenize" to fit the source
  # beside the bundle under the carry limit)
  for t in ${LLAMA_BINS:-$(ls build/llama/bin)}; do cp build/llama/bin/$t "$b/build/llama/bin/"; done
  cp build/models/needle/*.gguf build/models/needle/KEY "$b/build/models/needle/"
  cp build/llama/src/models/ggml-vocab-llama-bpe.gguf build/llama/src/models/ggml-vocab-qwen2.gguf "$b/build/llama/src/models/"
fi
cp build/llama/COMMIT "$b/build/llama/"
for f in build/pdbridge $([ "${NO_TESTS:-0}" = 1 ] || echo build/tests/integration_tests); do
  ldd "$f" | awk '$3 ~ /^\// {print $3}' | grep -v -E 'cuda|cublas|libc\.so|libm\.so|libstdc|libgcc|libdl|libpthread|librt|libresolv' | xargs -r -I{} cp -L {} "$b/lib/"
done
tar -C "$b" -cJf .dev/bundle.tar.xz .
tar -C build/llama/src --exclude=./.git --exclude='./models/*' --exclude=docs --exclude=media --exclude='*.png' --exclude='*.jpg' -cJf .dev/llama-src.tar.xz .
# LLAMA_CUDA=1: llama.cpp's CUDA llama-server built on this machine (the pinned source, sm_90, static ggml) instead of
# the source the device would build it from (~10 minutes of its time); LLAMA_BENCH=1 adds llama-bench. Each is ~40 MB
# compressed (CUDA kernels barely compress), and a call carries at most 64 MiB with the tracked files (~12 MiB): carry
# one in a call of its own that unpacks it under /tmp (it stays while the machine is warm: the next call within the
# 30 s idle window), then the bundle (SLIM=1 NO_TESTS=1) in the next.
if [ "${LLAMA_CUDA:-0}" = 1 ]; then
  lc=$HOME/.cache/pdbridge/llama-cuda-$(cut -c1-12 build/llama/COMMIT)-sm90/build/bin
  [ -x $lc/llama-server ] || { echo "no llama.cpp CUDA build at $lc"; exit 1; }
  cp $lc/llama-server "$b/" && strip "$b/llama-server" && tar -C "$b" -cJf .dev/llama-cuda.tar.xz llama-server
  if [ "${LLAMA_BENCH:-0}" = 1 ]; then cp $lc/llama-bench "$b/" && strip "$b/llama-bench" && tar -C "$b" -cJf .dev/llama-bench-cuda.tar.xz llama-bench; fi
  rm -f .dev/llama-src.tar.xz  # not needed beside it
fi
# IMATRIX_FILE: the importance matrix the device's parity stage quantizes the needle model with (parity_types.sh's, made here)
if [ -n "${IMATRIX_FILE:-}" ]; then cp "$IMATRIX_FILE" .dev/imatrix.gguf; else rm -f .dev/imatrix.gguf; fi
[ -f ../shared/peers/torch_prefill_peer.py ] && cp ../shared/peers/torch_prefill_peer.py .dev/ || true
cp scripts/device/env.sh scripts/device/amx_check.sh scripts/device/pipeline.sh scripts/device/drive.sh scripts/device/scale.sh scripts/device/pace.sh scripts/device/million8b.sh scripts/device/gpu_decoder.sh scripts/device/torch_qwen3_peer.py scripts/device/torch_moe_peer.py scripts/device/torch_grouped_mm_peer.py scripts/device/torch_peer_timing.py scripts/device/moe_stack.sh scripts/device/convert_compare.py scripts/device/dsv4_real.sh scripts/device/dsv4_gpu.sh scripts/device/conversation.sh scripts/device/conversation.py scripts/device/conv_job.sh scripts/device/conv_drive.sh scripts/device/bg.sh scripts/device/dsv4_profile.sh scripts/device/ncu_summary.py scripts/train/train_needle.py .dev/
du -sh .dev
