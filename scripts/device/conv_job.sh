#!/bin/bash
# Issue 20 on the H200, one background job (conv_drive.sh starts and waits for it): the GPU tail-capture tests on
# the tiny models, then the 8B conversation benchmark (conversation.sh). Logs and results in $R; DONE at the end.
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || { touch /tmp/res/DONE; exit 1; }
T0=$(date +%s)
ts() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a $R/conv_job.log; }
mkdir -p /work/main && ln -sfn $P/build /work/main/build
TM=$P/build/test-models; mkdir -p $TM
# the 8B model in the background while the tests run
( [ -f $M/llama8b/decoder-f16.gguf ] || $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16 \
    > $R/make_llama8b.log 2>&1; echo $? > $R/make_llama8b.rc ) &
{ [ "${GPU_TESTS:-1}" = 1 ] || [ "${CPU_TESTS:-0}" = 1 ]; } && for spec in "llama-tiny:llama:1:f32,f16,q8_0" "qwen3-tiny:qwen3:2:f32,f16,q8_0" "qwen3moe-tiny:qwen3moe:3:f32,f16"; do
  IFS=: read name arch seed types <<< "$spec"
  [ -d $TM/$name/hf ] || $PDB make-model --arch $arch --preset tiny --seed $seed --out $TM/$name --hf-dtype f32 --gguf-types $types > $R/make_$name.log 2>&1
done
# CPU_TESTS=1: the conversation tests on this box's CPU (a second ISA beside the development machine's)
if [ "${CPU_TESTS:-0}" = 1 ]; then
  ts "cpu tests"
  timeout 400 $P/build/tests/integration_tests --gtest_filter='Models/TailCapture.*:ConversationBridge.*' > $R/conv_cpu_tests.log 2>&1
  ts "rc=$?"; grep -E "^\[  |OK|FAILED|Failure" $R/conv_cpu_tests.log | head -20 | tee -a $R/conv_job.log
  $P/build/tests/unit_tests --gtest_filter='KeptStates*:PrefixCache*' 2>&1 | tail -3 | tee -a $R/conv_job.log
fi
if [ "${GPU_TESTS:-1}" = 1 ]; then
  ts "gpu tests"
  timeout 400 $P/build/tests/integration_tests --gtest_filter="${GPU_FILTER:-CudaTailCapture.*}" > $R/conv_gpu_tests.log 2>&1
  ts "rc=$?"; grep -E "CUDA TAIL|TP2|NCCL|OK \]|FAILED|Failure|SKIPPED" $R/conv_gpu_tests.log | head -60 | tee -a $R/conv_job.log
fi
while [ ! -e $R/make_llama8b.rc ]; do sleep 2; done
ts "8b model rc=$(cat $R/make_llama8b.rc)"
rm -rf $M/llama8b/hf/*.f32 2>/dev/null
ts "conversation"
bash $DEV/conversation.sh ${TURNS:-10} ${TAIL:-8192} > $R/conv_bench.log 2>&1
ts "rc=$?"; tail -25 $R/conv_bench.log | tee -a $R/conv_job.log
# TP_BENCH=1: the 8B forward as two ranks sharing the H200 against one rank (the sharding's cost on one GPU)
if [ "${TP_BENCH:-0}" = 1 ]; then
  ts "tp bench"
  for tp in 1 2; do
    extra=""; [ $tp -gt 1 ] && extra="--tp-one-gpu"
    timeout 300 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --device cuda --tokens 8192,32768 --chunk 8192 --reps 2 \
      --tp $tp $extra --label tp$tp --out $R/tp_bench.jsonl > $R/tp_bench_$tp.log 2>&1
    ts "tp $tp rc=$?"; tail -4 $R/tp_bench_$tp.log | tee -a $R/conv_job.log
  done
fi
touch $R/DONE
