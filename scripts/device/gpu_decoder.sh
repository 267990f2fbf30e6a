#!/bin/bash
# Issue 17 on the lent H200 box: the fidelity guard and the bridge end to end on decoders of every class
# available here. llama-server is built on the device from the carried llama.cpp source with CUDA (GGML_NATIVE:
# its CPU backend is compiled for the device's CPU as well), then run as
#   - a GPU decoder (-ngl 99: every layer and the attention on the H200; the stand-in for Metal on a Mac), and
#   - a CPU decoder on the device's CPU (the same binary with CUDA_VISIBLE_DEVICES= : no CUDA device),
# with the CUDA prefill engine and the front door, on the shipped needle model (Q4_0 and F16 GGUFs, f16 / q8_0 /
# q4_0 caches) and the Llama-3.1-8B shape (F16, random weights), plus the mismatches the guard must still catch.
# Then the CPU parity and fidelity tests with that CPU decoder (the device's CPU is a second ISA).
# Usage (from pipeline.sh's gpudec stage, or alone after env.sh): gpu_decoder.sh <carried .dev> ; results in $R/fid/.
DEV=${1:?.dev}; REPO=$(cd $DEV/.. && pwd)
source $DEV/env.sh || exit 1
LC=${LC:-/tmp/llama-cuda}; mkdir -p $LC $R/fid
T0=${T0:-$(date +%s)}
ts() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
[ -e $REPO/build ] || ln -sfn $P/build $REPO/build
S=$LC/build/bin/llama-server
# The 8B model is made beside the build (the GPU stacks below do not need it until the end).
[ -f $M/llama8b/decoder-f16.gguf ] && echo 0 > $R/fid/make8b.rc
if [ "${FID_8B:-1}" = 1 ] && [ ! -e $R/fid/make8b.rc ]; then
  ( nice -n 5 $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16 > $R/fid/make8b.log 2>&1; echo $? > $R/fid/make8b.rc ) &
fi
if [ ! -x $S ] && [ -f $DEV/llama-cuda.tar.xz ]; then  # carried prebuilt (make_bundle.sh with LLAMA_CUDA=1)
  mkdir -p $LC/build/bin && tar -xJf $DEV/llama-cuda.tar.xz -C $LC/build/bin
fi
if [ ! -x $S ] && [ -x /tmp/lc/llama-server ]; then  # unpacked by an earlier call on this warm machine
  mkdir -p $(dirname $S) && cp /tmp/lc/llama-server $S
fi
if [ ! -x $S ]; then
  [ -d $LC/ggml ] || tar -xJf $DEV/llama-src.tar.xz -C $LC
  ts "building llama-server with CUDA"
  ( cd $LC && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DGGML_CUDA_NCCL=OFF > $R/fid/llama_cmake.log 2>&1 \
    && cmake --build build -j 16 --target llama-server > $R/fid/llama_build.log 2>&1 ) || { ts "llama-server CUDA build failed"; tail -30 $R/fid/llama_build.log; exit 1; }
fi
ts "llama-server CUDA: $($S --version 2>&1 | tail -2 | tr '\n' ' ')"
lscpu > $R/fid/cpu.txt
NEEDLE_HF=$REPO/models/needle-llama; NG=$P/build/models/needle
TM=$P/build/test-models
[ -f $TM/llama-tiny-other/decoder-f32.gguf ] || timeout 300 bash -c "set -e; $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0,q4_0; \
  $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny-h16 --hf-dtype f16 --gguf-types f16; \
  $PDB make-model --arch llama --preset tiny --seed 9 --out $TM/llama-tiny-other --hf-dtype f32 --gguf-types f32; \
  $PDB make-model --arch qwen3 --preset tiny --seed 2 --out $TM/qwen3-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0; \
  $PDB make-model --arch qwen3moe --preset tiny --seed 3 --out $TM/qwen3moe-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0; \
  $PDB make-model --arch qwen3moe --preset tiny --seed 3 --out $TM/qwen3moe-tiny-h16 --hf-dtype f16 --gguf-types f16; \
  $PDB make-model --arch deepseek2 --preset tiny --seed 4 --out $TM/deepseek2-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0" > $R/fid/test_models.log 2>&1
FS="bash $REPO/scripts/fidelity_stack.sh"
# FID_CASES (a regex over the case names) reruns a subset, e.g. FID_CASES='needle_f16_gpu|mm_othermodel_gpu'.
want() { [[ -z ${FID_CASES:-} || $1 =~ ^(${FID_CASES})$ ]]; }
gpu() { want $1 || return 0; ts "gpu $1"; SERVER_BIN=$S timeout ${FID_LIMIT:-420} $FS "$@"; }
cpu() { want $1 || return 0; ts "cpu $1"; SERVER_BIN=$S DECODER_CPU=1 timeout ${FID_LIMIT:-420} $FS "$@"; }
# The shipped model on the GPU decoder: bridges, needle answers (fresh seeds), output parity, and the guard's numbers.
gpu needle_q4_0_gpu $R/fid $NG/decoder-q4_0.gguf $NEEDLE_HF cuda f16 --cold 8000,16000 4 --parity 16 8000 -- -ngl 99
gpu needle_f16_gpu $R/fid $NG/decoder-f16.gguf $NEEDLE_HF cuda f16 --cold 8000,16000 2 --parity 8 8000 -- -ngl 99
gpu needle_q4_0_gpu_q8cache $R/fid $NG/decoder-q4_0.gguf $NEEDLE_HF cuda q8_0 --cold 16000 2 --parity 0 0 -- -ngl 99
gpu needle_q4_0_gpu_q4cache $R/fid $NG/decoder-q4_0.gguf $NEEDLE_HF cuda q4_0 --cold 16000 2 --parity 0 0 -- -ngl 99
# ... and the mismatches it must still decline on that decoder
gpu mm_ropebase_gpu $R/fid $NG/decoder-q4_0.gguf $NEEDLE_HF cuda f16 -- -ngl 99 --rope-freq-base 250000
gpu mm_yarn2_gpu $R/fid $NG/decoder-f16.gguf $NEEDLE_HF cuda f16 -- -ngl 99 --rope-scaling yarn --rope-scale 2 --yarn-orig-ctx 4096
gpu mm_linear2_gpu_q4cache $R/fid $NG/decoder-q4_0.gguf $NEEDLE_HF cuda q4_0 -- -ngl 99 --rope-scaling linear --rope-scale 2
gpu mm_othermodel_gpu $R/fid $TM/llama-tiny/decoder-f32.gguf $TM/llama-tiny/hf cuda f16 -- -ngl 99 -m $TM/llama-tiny-other/decoder-f32.gguf
# The shipped model on the device's CPU.
cpu needle_q4_0_cpu $R/fid $NG/decoder-q4_0.gguf $NEEDLE_HF cuda f16 --cold 8000,16000 2 --parity 8 8000
cpu needle_f16_cpu $R/fid $NG/decoder-f16.gguf $NEEDLE_HF cuda f16 --cold 16000 2 --parity 0 0
cpu mm_ropebase_cpu $R/fid $NG/decoder-f16.gguf $NEEDLE_HF cuda f16 -- --rope-freq-base 250000
# The bundle's llama-server (built on the development machine, whose AVX-512 has no AVX512-FP16) on this CPU: with F16
# weights the device-built binary (-march=native here: AVX512-FP16) is not mirrored, this one is.
want needle_f16_cpu_bundlebuild && ts "cpu (bundle build) needle_f16_cpu_bundlebuild" && timeout 120 $FS needle_f16_cpu_bundlebuild $R/fid $NG/decoder-f16.gguf $NEEDLE_HF cuda f16 --cold 0 0 --parity 0 0
# CPU parity and fidelity tests against the device-built CPU decoder (its ISA, not the build machine's).
if [ "${FID_TESTS:-1}" = 1 ]; then
  cp -f $P/build/llama/bin/llama-server $P/llama-server.bundle 2>/dev/null
  ln -sf $S $P/build/llama/bin/llama-server
  ts "CPU parity/fidelity tests on the device's CPU"
  CUDA_VISIBLE_DEVICES= timeout 600 $P/build/tests/integration_tests --gtest_filter="${FID_TEST_FILTER:-Caches/Parity*:NeedleModel.BridgedState*:Fidelity.Pinned*:Fidelity.Geometry*:Caches/Mla*:Models/BridgeEndToEnd*moe*:Models/BridgeEndToEnd*deepseek2*:-*openblas*}" > $R/fid/cpu_tests.log 2>&1
  ts "tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|PARITY|FIDELITY" $R/fid/cpu_tests.log | head -60
  [ -f $P/llama-server.bundle ] && mv -f $P/llama-server.bundle $P/build/llama/bin/llama-server
fi
# The 8B shape: the GPU decoder (bridged vs its own prefill) and the device's CPU decoder (bridged only: its native
# prefill of 8K tokens takes minutes). The model is made here unless an earlier stage left it.
if [ "${FID_8B:-1}" = 1 ]; then
  ts "waiting for the 8B model"; while [ ! -e $R/fid/make8b.rc ]; do sleep 5; done; ts "8B model: rc=$(cat $R/fid/make8b.rc 2>/dev/null)"
  gpu llama8b_f16_gpu $R/fid $M/llama8b/decoder-f16.gguf $M/llama8b/hf cuda f16 --cold 30000 2 --parity 4 16000 --ctx 32768 -- -ngl 99
  gpu mm_ropebase_8b_gpu $R/fid $M/llama8b/decoder-f16.gguf $M/llama8b/hf cuda f16 -- -ngl 99 --rope-freq-base 250000
  ts "cpu (bundle build) llama8b_f16_cpu"; timeout 400 $FS llama8b_f16_cpu $R/fid $M/llama8b/decoder-f16.gguf $M/llama8b/hf cuda f16 --cold 30000 1 --skip-native --parity 0 0 --ctx 32768
fi
ts "gpu_decoder.sh done"
cat $R/fid/*.summary.txt
