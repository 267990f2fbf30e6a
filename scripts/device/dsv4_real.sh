#!/bin/bash
# Issue 19 on the device's CPU (no GPU needed): DeepSeek-V4-Flash's real layer shapes in a 2-layer checkpoint of the
# official layout (ratios 4 and 128: every section kind), converted as llama.cpp's converter does, run by the
# pinned llama-server; the DSV4 real-shape test then measures the decoder's sections (bytes per token per layer
# kind) and the recipe's layer 0 against them (tests/deepseek4_state_test.cpp, Deepseek4RealShapes).
# Usage (device): bash .dev/dsv4_real.sh
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1
T0=$(date +%s)
# the tests find the build where it was configured
mkdir -p /work/main && ln -sfn $P/build /work/main/build
ts() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a $R/dsv4_real.log; }
dir=$M/v4-flash-2l
[ -f $dir/decoder-mxfp4_moe.gguf ] || { ts "make-model v4-flash --compress-ratios 4,128 --hf-dtype fp8"; /usr/bin/time -v $PDB make-model --arch deepseek4 --preset v4-flash --compress-ratios 4,128 --hf-dtype fp8 --seed 21 --out $dir \
  > $R/dsv4_make.log 2>&1 || { ts "make-model failed"; tail -5 $R/dsv4_make.log; }; }
grep -E "Elapsed|Maximum resident" $R/dsv4_make.log | tee -a $R/dsv4_real.log
du -sh $dir/hf $dir/*.gguf 2>&1 | tee -a $R/dsv4_real.log
ts "real-shape test"
PDBRIDGE_DSV4_MODEL=$dir timeout ${TEST_LIMIT:-420} $P/build/tests/integration_tests --gtest_filter='Deepseek4RealShapes*' > $R/dsv4_real_test.log 2>&1
echo "test rc=$?" | tee -a $R/dsv4_real.log
grep -E "REAL|OK|FAILED|Failure" $R/dsv4_real_test.log | tee -a $R/dsv4_real.log
cp $R/dsv4_*.log $OUT/ 2>/dev/null
ts done
