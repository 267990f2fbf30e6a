#!/bin/bash
# Issue 19: where a real-shape DSV4 layer's device time goes, kernel by kernel (Nsight Compute's duration of every
# launch, kernels serialized), for one prompt length and chunk; then the CPU DSV4 parity tests on this machine's CPU
# (a second ISA for the recipe's host arithmetic). Usage (device): bash .dev/bg.sh 570 dsv4_profile.sh [T] [CHUNK]
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1
mkdir -p /work/main && ln -sfn $P/build /work/main/build
T=${1:-32768}; CH=${2:-32768}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
if [ -n "$NCU" ]; then
  PDBRIDGE_BENCH=1 PDBRIDGE_DSV4_BENCH_TOKENS=$T PDBRIDGE_DSV4_BENCH_CHUNK=$CH PDBRIDGE_DSV4_EXPERTS=fp4 PDBRIDGE_BENCH_OUT=$R/dsv4_profile_bench.jsonl \
    timeout 480 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base --log-file $R/dsv4_ncu.csv \
    $P/build/tests/integration_tests --gtest_filter='Deepseek4CudaBench.*' > $R/dsv4_profile_bench.log 2>&1
  echo "ncu rc=$?"
  python3 $DEV/ncu_summary.py $R/dsv4_ncu.csv > $R/dsv4_ncu_summary.log 2>&1; head -70 $R/dsv4_ncu_summary.log
fi
timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4State.*:Deepseek4Engine.*:Deepseek4Recipe.*:Deepseek4Wire.*:Deepseek4Bridge.*' \
  > $R/dsv4_cpu_tests.log 2>&1
echo "cpu tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED|Failure" $R/dsv4_cpu_tests.log | head -20
lscpu | grep -E "Model name|Flags" | cut -c1-200 > $R/cpu.log
