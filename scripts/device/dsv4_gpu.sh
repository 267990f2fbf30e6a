#!/bin/bash
# Issue 19 on the GPU: the DSV4 kernels against their CPU twins, the GPU engine against the CPU engine section by
# section on the tiny models, the bridge with `prefill --device cuda` into llama-server (on the device's CPU), and
# the real V4-Flash layer shapes timed per layer kind (tests/deepseek4_cuda_test.cpp).
# Usage (device): bash .dev/dsv4_gpu.sh [stages: kernels engine bridge bench cpu (the CPU DSV4 tests on this CPU)]; bash .dev/bg.sh LIMIT dsv4_gpu.sh ... runs
# it in the background past one command's limit.
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1
T0=$(date +%s)
mkdir -p /work/main && ln -sfn $P/build /work/main/build
ts() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a $R/dsv4_gpu.log; }
STAGES=${*:-kernels engine bridge bench}
TM=$P/build/test-models
mkdir -p $TM
for spec in "deepseek4-tiny:--preset tiny --seed 5" "deepseek4-tiny-fp8:--preset tiny --seed 5 --hf-dtype fp8" "deepseek4-tiny-hca:--preset tiny-hca --seed 6"; do
  name=${spec%%:*}; args=${spec#*:}
  [ -d $TM/$name/hf ] || { ts "make-model $name"; $PDB make-model --arch deepseek4 $args --out $TM/$name > $R/make_$name.log 2>&1 || ts "make-model $name failed"; }
done
for st in $STAGES; do
  case $st in
    kernels) ts kernels; timeout 120 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Dsv4*' > $R/dsv4_kernels.log 2>&1; ts "rc=$?"; grep -E "OK|FAILED|Failure|Expected|Which|differs" $R/dsv4_kernels.log | head -30 | tee -a $R/dsv4_gpu.log ;;
    # engine: the default products, then the routed experts as FP8 products (PDBRIDGE_DSV4_EXPERTS_FP8=1)
    engine) for fp8 in 0 1; do ts "engine experts_fp8=$fp8"
        PDBRIDGE_DSV4_EXPERTS_FP8=$fp8 timeout 240 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*' > $R/dsv4_engine_fp8_$fp8.log 2>&1
        ts "rc=$?"; grep -E "DSV4|OK|FAILED|Failure|what|deepseek4 on" $R/dsv4_engine_fp8_$fp8.log | head -40 | tee -a $R/dsv4_gpu.log
      done ;;
    bridge) ts bridge; timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4CudaBridge.*' > $R/dsv4_bridge.log 2>&1; ts "rc=$?"; grep -E "DSV4|OK|FAILED|Failure" $R/dsv4_bridge.log | head -30 | tee -a $R/dsv4_gpu.log ;;
    # bench: BENCH_RUNS picks, each EXPERTS:CHUNK[:NAME=VALUE+NAME=VALUE] (the third part: the A/B switches, e.g.
    # PDBRIDGE_DSV4_ATTN=gather+PDBRIDGE_DSV4_INDEXER=gemm for the paths before the fused kernels)
    bench) for run in ${BENCH_RUNS:-fp4:32768 fp4:32768:PDBRIDGE_DSV4_ATTN=gather+PDBRIDGE_DSV4_INDEXER=gemm}; do
        IFS=: read ex ch envs <<< "$run"
        tag=${ex}_${ch}$( [ -n "$envs" ] && echo "_$(echo "$envs" | md5sum | cut -c1-6)" )
        ts "bench experts=$ex chunk=$ch ${envs:-(defaults)} -> $tag"
        env $(echo "$envs" | tr '+' ' ') PDBRIDGE_BENCH=1 PDBRIDGE_BENCH_OUT=$R/dsv4_bench_$tag.jsonl PDBRIDGE_DSV4_BENCH_TOKENS=${BENCH_TOKENS:-8192,32768,131072} \
          PDBRIDGE_DSV4_BENCH_CHUNK=$ch PDBRIDGE_DSV4_EXPERTS=$ex timeout ${BENCH_LIMIT:-300} $P/build/tests/integration_tests --gtest_filter='Deepseek4CudaBench.*' \
          > $R/dsv4_bench_$tag.log 2>&1
        ts "rc=$?"; grep -E "DSV4|OK|FAILED|Failure|what" $R/dsv4_bench_$tag.log | head -30 | tee -a $R/dsv4_gpu.log
      done ;;
    cpu) ts "cpu dsv4 tests"; timeout 400 $P/build/tests/integration_tests --gtest_filter='Deepseek4State.*:Deepseek4Engine.*:Deepseek4Recipe.*:Deepseek4Wire.*:Deepseek4Bridge.*' \
        > $R/dsv4_cpu_tests.log 2>&1; ts "rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED|Failure" $R/dsv4_cpu_tests.log | head -20 | tee -a $R/dsv4_gpu.log
      lscpu | grep -E "Model name" >> $R/dsv4_gpu.log ;;
  esac
  cp $R/dsv4_* $R/make_* $OUT/ 2>/dev/null
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> $R/dsv4_gpu.log 2>&1
cp $R/dsv4_* $R/make_* $OUT/ 2>/dev/null
ts done
