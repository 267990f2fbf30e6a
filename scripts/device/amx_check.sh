#!/bin/bash
# Issue 33 on the lent H200 box's Xeon (Sapphire Rapids class: AMX): llama-server from the pinned bundle built on
# that CPU twice, as llama.cpp builds by default (-march=native: AMX kernels in) and as scripts/setup.sh builds it
# (-mno-amx-*); each loads the shipped needle model's Q4_0 and the tiny models' Q8_0 / deepseek2 F16 GGUFs. Then the
# decoder-dependent integration tests with the setup's build, and `pdbridge decoder` on the default build (its
# diagnosis of the crash). Usage: amx_check.sh <carried .dev> ; results in $R/amx/.
DEV=${1:?.dev}; REPO=$(cd $DEV/.. && pwd)
source $DEV/env.sh || exit 1
mkdir -p $R/amx; A=$R/amx
T0=$(date +%s); ts() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
grep -o 'amx[a-z_0-9]*\|avx512_fp16\|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ' > $A/cpu_flags.txt; lscpu | grep 'Model name' >> $A/cpu_flags.txt
ts "CPU: $(cat $A/cpu_flags.txt)"
LS=/tmp/llama-src; mkdir -p $LS; [ -d $LS/ggml ] || tar -xJf $DEV/llama-src.tar.xz -C $LS
build() {  # build <dir> <flags>
  ( cmake -S $LS -B $1 -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=ON -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2" > $1.cmake.log 2>&1 \
    && cmake --build $1 -j 16 --target llama-server llama-quantize > $1.build.log 2>&1 ) || { tail -20 $1.build.log; return 1; }
}
ts "building llama-server: default (-march=native) and setup's (-mno-amx-*)"
build /tmp/ll-native "" & build /tmp/ll-noamx "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" & wait
for b in native noamx; do echo "$b: $(nm /tmp/ll-$b/bin/llama-server | grep -c ggml_backend_amx_buffer_type) AMX buffer symbols" >> $A/builds.txt; done
cat $A/builds.txt
# this CPU's llama.cpp tools replace the build machine's (built -march=native for another CPU)
[ -e $REPO/build ] || ln -sfn $P/build $REPO/build
# the tests find their build folder at the path they were built in
[ -e /work/main/build ] || { mkdir -p /work/main && ln -sfn $P/build /work/main/build; }
cp /tmp/ll-noamx/bin/llama-server /tmp/ll-noamx/bin/llama-quantize $P/build/llama/bin/
TM=$P/build/test-models; NG=$P/build/models/needle
[ -f $TM/deepseek2-tiny/decoder-f16.gguf ] || { $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0,q4_0 \
  && $PDB make-model --arch qwen3moe --preset tiny --seed 3 --out $TM/qwen3moe-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0 \
  && $PDB make-model --arch deepseek2 --preset tiny --seed 4 --out $TM/deepseek2-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0; } > $A/models.log 2>&1 || tail $A/models.log
port=18500
for b in native noamx; do for g in $NG/decoder-q4_0.gguf $TM/llama-tiny/decoder-q8_0.gguf $TM/deepseek2-tiny/decoder-f16.gguf; do
  port=$((port+1)); log=$A/load-$b-$(basename $(dirname $g))-$(basename $g .gguf).log
  /tmp/ll-$b/bin/llama-server -m $g --port $port -c 2048 -np 1 > $log 2>&1 & pid=$!
  st=loading; for i in $(seq 1 300); do
    if ! kill -0 $pid 2>/dev/null; then wait $pid; st="died rc=$?"; break; fi
    if curl -sf localhost:$port/health >/dev/null; then
      r=$(curl -s localhost:$port/completion -d '{"prompt":"Hello there, tell me a story about a river","n_predict":8}' | head -c 200)
      st="healthy; completion: $(echo "$r" | grep -o '"content":"[^"]*"' | head -1)"; break; fi
    sleep 0.2; done
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  echo "$b $(basename $(dirname $g))/$(basename $g): $st" | tee -a $A/loads.txt
done; done
ts "pdbridge decoder on the default build (the AMX crash, if it crashes):"
timeout 120 $PDB decoder --gguf $NG/decoder-q4_0.gguf --port 18600 --slot-dir /tmp/amx-slots --server-bin /tmp/ll-native/bin/llama-server > $A/pdbridge_decoder_native.log 2>&1
echo "rc=$?" >> $A/pdbridge_decoder_native.log; grep "pdbridge decoder" $A/pdbridge_decoder_native.log
# the decoder-dependent tests with the setup's build as every decoder (the pinned one's path included)
ts "integration tests on the Xeon (setup's llama-server)"
cd $P/build/tests && timeout ${TEST_TIMEOUT:-400} ./integration_tests --gtest_brief=1 \
  --gtest_filter="${AMX_TESTS:-NeedleModel.*:Fidelity.PinnedCpuDecoderIsMirroredAtTheIsaItRunsOn:MoeMlaVerdicts*:MlaFront*:Verdicts.*:DecoderLaunch.*:UserStartedDecoder.*}" \
  > $A/tests.log 2>&1; echo "tests rc=$?" | tee -a $A/tests.log
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|FIDELITY|USER-STARTED|tests rc" $A/tests.log | head -40
ts done
