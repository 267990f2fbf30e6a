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
cp build/llama/bin/* "$b/build/llama/bin/"
cp build/llama/COMMIT "$b/build/llama/"
cp build/models/needle/*.gguf build/models/needle/KEY "$b/build/models/needle/"
cp build/llama/src/models/ggml-vocab-llama-bpe.gguf build/llama/src/models/ggml-vocab-qwen2.gguf "$b/build/llama/src/models/"
for f in build/pdbridge $([ "${NO_TESTS:-0}" = 1 ] || echo build/tests/integration_tests); do
  ldd "$f" | awk '$3 ~ /^\// {print $3}' | grep -v -E 'cuda|cublas|libc\.so|libm\.so|libstdc|libgcc|libdl|libpthread|librt|libresolv' | xargs -r -I{} cp -L {} "$b/lib/"
done
tar -C "$b" -cJf .dev/bundle.tar.xz .
tar -C build/llama/src --exclude=./.git --exclude='./models/*' --exclude=docs --exclude=media --exclude='*.png' --exclude='*.jpg' -cJf .dev/llama-src.tar.xz .
# LLAMA_CUDA=1: llama.cpp's CUDA llama-server and llama-bench built on this machine (the pinned source, sm_90, static
# ggml) instead of the source the device would build them from (~10 minutes of its time)
if [ "${LLAMA_CUDA:-0}" = 1 ]; then
  lc=$HOME/.cache/pdbridge/llama-cuda-$(cut -c1-12 build/llama/COMMIT)-sm90/build/bin
  [ -x $lc/llama-server ] && [ -x $lc/llama-bench ] || { echo "no llama.cpp CUDA build at $lc"; exit 1; }
  cp $lc/llama-server $lc/llama-bench "$b/" && strip "$b/llama-server" "$b/llama-bench"
  tar -C "$b" -cJf .dev/llama-cuda.tar.xz llama-server llama-bench
  rm -f .dev/llama-src.tar.xz  # not needed beside it (and the carry limit is 64 MiB)
fi
[ -f ../shared/peers/torch_prefill_peer.py ] && cp ../shared/peers/torch_prefill_peer.py .dev/ || true
cp scripts/device/env.sh scripts/device/amx_check.sh scripts/device/pipeline.sh scripts/device/drive.sh scripts/device/scale.sh scripts/device/pace.sh scripts/device/million8b.sh scripts/device/gpu_decoder.sh scripts/device/torch_qwen3_peer.py scripts/device/torch_moe_peer.py scripts/device/torch_peer_timing.py scripts/device/moe_stack.sh scripts/device/convert_compare.py scripts/device/dsv4_real.sh scripts/device/dsv4_gpu.sh scripts/device/conversation.sh scripts/device/conversation.py scripts/device/conv_job.sh scripts/device/conv_drive.sh scripts/device/bg.sh scripts/device/dsv4_profile.sh scripts/device/ncu_summary.py scripts/train/train_needle.py .dev/
du -sh .dev
