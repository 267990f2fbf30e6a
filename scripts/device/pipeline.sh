#!/bin/bash
# The GPU run behind docs/RESULTS.md (issue #4): kernel and engine tests, the CUDA bridge end to end
# against llama-server (on the device's CPU), pdbridge bench prefill on the 8b presets, and the peers
# in the same run: PyTorch (the device's torch/transformers, sdpa, bf16) and llama.cpp CUDA built
# here from the same npm source bundle. Every stage logs to /tmp/res and the pipeline continues
# past a failed stage. Usage: pipeline.sh <carried .dev folder> [all | comma-separated stages, listed below]
DEV=$1; STAGES=${2:-all}; REPO=$(cd $DEV/.. && pwd)
# STAGES: all (tests, bench, train), or a comma-separated list of tests,bench,train,models,waitmodels,attn,cudnn,cudnnmoe,moecudnn,llamapeer,ab,qwen,moe,fp8,scale,pace,m1,demo,link,gpudec,golden,dsv4ab,framesab,recheck,gguf,ggufmoe,ggufab,kvrows,recheck35,rowpath,moe48,dsv4gguf,cudaparity,enginecheck,gapcheck,moegap,moegap2,moegap3,session41,session41c,session42,session43,session44,session45,session45b,session46,
# run in the order named. FUSED=0 leaves out the attn stage's fused fp8 K/V row. MMA=1 and NCU=1 add the attn stage's mma.sync bench and its ncu profile; PEERS=0 and
# LONG=0 leave out its PyTorch/llama.cpp peers and its 128K runs; AB=1 adds the A/B rows measured on 2026-11-30
# (lockstep wgmma, the recipe on its own stream).
has() { [ "$STAGES" = all ] && [ "$1" != fp8 ] && [ "$1" != moe ] && [ "$1" != attn ] && [ "$1" != scale ] && [ "$1" != pace ] && [ "$1" != m1 ] && [ "$1" != link ] && [ "$1" != demo ] && [ "$1" != gpudec ] && [ "$1" != dsv4gguf ] && [ "$1" != cudaparity ] && return 0; [[ ",$STAGES," == *",$1,"* ]]; }
LC=/tmp/llama-cuda; mkdir -p $LC
T0=$(date +%s)
ts() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
run() { local name=$1; shift; ts "start $name"; timeout ${STEP_LIMIT:-1500} "$@" > $R/$name.log 2>&1; local rc=$?; ts "end $name rc=$rc"; tail -n 25 $R/$name.log | sed "s/^/  $name| /"; return $rc; }
DONE_MARK=${DONE_MARK:-DONE}  # drive.sh's second pipeline (second GPU) marks its end as DONE2
source $DEV/env.sh || { touch /tmp/res/$DONE_MARK; exit 1; }
[ -e $R/sysinfo.txt ] || { nvidia-smi; lscpu | head -20; free -g; df -h /tmp /dev/shm; } > $R/sysinfo.txt 2>&1
# the tests find the build where it was configured
mkdir -p /work/main && ln -sfn $P/build /work/main/build
[ -e $REPO/build ] || ln -sfn $P/build $REPO/build
run device_info_$DONE_MARK $PDB device-info || { ts "pdbridge does not run here"; touch $R/$DONE_MARK; exit 1; }
# llama.cpp CUDA (peer): carried prebuilt (make_bundle.sh with LLAMA_CUDA=1), else built here in the background
# (its tars, or their binaries unpacked under /tmp/lc by an earlier call on this warm machine: make_bundle.sh says why)
mkdir -p $LC/build/bin
for t in llama-cuda llama-bench-cuda; do [ -f $DEV/$t.tar.xz ] && tar -xJf $DEV/$t.tar.xz -C $LC/build/bin; done
for f in llama-server llama-bench; do [ -x /tmp/lc/$f ] && [ ! -x $LC/build/bin/$f ] && cp /tmp/lc/$f $LC/build/bin/; done
[ -x $LC/build/bin/llama-bench ] && echo 0 > $R/llama_build.rc
# (the cudaparity stage needs its llama-server too: both are built then; without AMX, as setup.sh builds the decoder:
# the Xeon hosts' AMX matmul crashes, and static so the binaries run from where they are built)
LLAMA_TARGETS="llama-bench"; LLAMA_SERVER=OFF
has cudaparity && LLAMA_TARGETS="llama-bench llama-server" && LLAMA_SERVER=ON
[ ! -e $R/llama_build.rc ] && { has bench || has attn || has qwen || has moe || has gguf || has llamapeer || has dsv4gguf || has cudaparity; } && [ "${PEERS:-1}" = 1 ] && [ -f $DEV/llama-src.tar.xz ] && ( tar -xJf $DEV/llama-src.tar.xz -C $LC && cd $LC && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
   -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DBUILD_SHARED_LIBS=OFF \
   -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
   -DLLAMA_BUILD_SERVER=$LLAMA_SERVER -DGGML_CUDA_NCCL=OFF > $R/llama_cmake.log 2>&1 && nice -n 10 cmake --build build -j ${LLAMA_JOBS:-8} --target $LLAMA_TARGETS > $R/llama_build.log 2>&1
  echo $? > $R/llama_build.rc ) &
# wait_llama: the stages that run llama.cpp CUDA wait for that build (or go on without it where it failed)
wait_llama() {
  [ -e $R/llama_build.rc ] || [ -f $DEV/llama-src.tar.xz ] || { ts "no llama.cpp source carried: no CUDA build to wait for"; return 0; }
  [ -e $R/llama_build.rc ] || { ts "waiting for the llama.cpp CUDA build"; while [ ! -e $R/llama_build.rc ]; do sleep 5; done; }
  ts "llama.cpp CUDA build rc=$(cat $R/llama_build.rc)"
}
# the embedded default model (issue #6): trains while the tests and model generation use the CPU
if [ -f $DEV/train_needle.py ] && has train; then
  ( PYTHONUNBUFFERED=1 python3 $DEV/train_needle.py /tmp/needle --minutes ${TRAIN_MINUTES:-5} > $R/train.log 2>&1; echo $? > $R/train.rc ) &
fi
# The GPU suites' test models (what `make` builds here under build/test-models).
make_test_models() {
  TM=$P/build/test-models
  run test_models bash -c "set -e; $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0,q4_0; \
    $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny-h16 --hf-dtype f16 --gguf-types f16; \
    $PDB make-model --arch qwen3 --preset tiny --seed 2 --out $TM/qwen3-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0; \
    $PDB make-model --arch qwen3moe --preset tiny --seed 3 --out $TM/qwen3moe-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0; \
    $PDB make-model --arch deepseek2 --preset tiny --seed 4 --out $TM/deepseek2-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0"
}
# DeepSeek-V4's two tiny test models (the GPU engine's and bridge's tests read them)
make_dsv4_test_models() {
  TM=$P/build/test-models
  run test_models_dsv4 bash -c "set -e; $PDB make-model --arch deepseek4 --preset tiny --seed 5 --out $TM/deepseek4-tiny; \
    $PDB make-model --arch deepseek4 --preset tiny --seed 5 --hf-dtype fp8 --out $TM/deepseek4-tiny-fp8"
}
stage_tests() {
  # Time limits: a kernel that hangs must not take the session's device time with it (these ran in 7-25 s).
  run unit_cuda timeout 180 $P/build/tests/unit_tests --gtest_filter='Cuda*'
  TM=$P/build/test-models
  make_test_models
  run integration_cuda timeout 480 $P/build/tests/integration_tests --gtest_filter='GpuRecipe*:CudaEngine*:CudaBridge*:CudaParity*'
  [ "${AB:-0}" = 1 ] && PDBRIDGE_RECIPE_STREAM=1 run integration_cuda_recipe_stream timeout 300 $P/build/tests/integration_tests --gtest_filter='CudaBridge*:CudaParity*'
}
stage_bench() {
  run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16
  if [ -f $DEV/train_needle.py ]; then ts "waiting for training"; while [ ! -e $R/train.rc ]; do sleep 5; done; ts "training rc=$(cat $R/train.rc)"; tail -n 12 $R/train.log; fi
  [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_peer python3 $DEV/torch_prefill_peer.py
  run bench_llama8b $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b --out $R/bench.jsonl
  PDBRIDGE_ATTN_WGMMA=0 run bench_llama8b_mma $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-mma --out $R/bench.jsonl
  PDBRIDGE_ATTN_KTILE=128 run bench_llama8b_kt128 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-kt128 --out $R/bench.jsonl
  PDBRIDGE_ATTN_WARPS=4 run bench_llama8b_attn4 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 32768 --reps 2 --chunk 4096 --label llama8b-attn4 --out $R/bench.jsonl
  run bench_llama8b_128k $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 131072 --reps 1 --chunk 8192 --label llama8b --out $R/bench.jsonl
  if [ "${PEERS:-1}" = 1 ]; then
    ts "waiting for the llama.cpp CUDA build"; while [ ! -e $R/llama_build.rc ]; do sleep 5; done; ts "llama build rc=$(cat $R/llama_build.rc)"
    run llama_bench $LC/build/bin/llama-bench -m $M/llama8b/decoder-f16.gguf -ngl 99 -fa 1 -b 4096 -ub 2048 -p 8192,32768 -n 0 -r 2 -o md
  fi
  rm -rf $M/llama8b/hf
  run make_qwen8b $PDB make-model --arch qwen3 --preset 8b --seed 8 --out $M/qwen8b --hf-dtype bf16 --gguf-types f16
  run bench_qwen8b $PDB bench prefill --model $M/qwen8b/hf --recipe $M/qwen8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label qwen3-8b --out $R/bench.jsonl
}
# Issue 4's FP8 row: the same Llama-3.1-8B-shape master weights as bf16 and as block-FP8 (128x128 e4m3 +
# scales), bench prefill on both in the same run (the FP8 engine runs block-scaled FP8 products when its
# probe finds the scale order; the bench's "weights" field says which path ran). Also the GPU-encoded
# q8_0 cache rows against f16 ones, the 128-key attention tiles, and the recipe's overhead with a Q4_0 decoder
# (its int8 tensor-core products).
# The attention kernels side by side (Hopper wgmma ping-pong default, its lockstep form, mma.sync), fp8 K/V (expanded, fused), chunk sizes, and the recipe's
# overhead (on the engine's stream and on its own; with a Q4_0 decoder), without the FP8 checkpoint (which takes
# minutes to make); the PyTorch and llama.cpp CUDA peers in the same run; one attention launch under ncu.
# The 8B model the attn, m1 and scale stages share (made once; its own stage so m1 can run before the benches).
stage_models() {
  # A declared context of 1.1M (the llama3 RoPE reads its original 8,192, so the engine is unchanged) lets
  # scale.sh and million8b.sh use this model past 131,072 tokens: llama-server caps a slot at the declared context.
  [ -f $M/llama8b/decoder-f16.gguf ] || { run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 \
    --gguf-types f16 --context-length 1100000 && touch $M/llama8b/CTX1100000; }
  # Q4_0 from the F16 GGUF (quantizing from the f32 source does not fit the device's disk beside the rest)
  [ -f $M/llama8b/decoder-q4_0.gguf ] || run quantize_q4 $P/build/llama/bin/llama-quantize $M/llama8b/decoder-f16.gguf $M/llama8b/decoder-q4_0.gguf Q4_0
  [ -f $M/llama8b/decoder-q4_0.gguf ] && touch $M/llama8b/READY
}
# A second pipeline (drive.sh's STAGES2, on the second GPU) waits here for the first one's models stage.
stage_waitmodels() {
  ts "waiting for the models stage"
  for _ in $(seq 1 600); do [ -e $M/llama8b/READY ] && break; sleep 1; done
  ts "models ready: $([ -e $M/llama8b/READY ] && echo yes || echo no)"
}
# Free disk in GB where the models live: a 64 GB machine holds one 8B model at a time, a 128 GB one holds two.
free_gb() { df -BG --output=avail $M | tail -1 | tr -dc 0-9; }
stage_attn() {
  stage_models
  run attn_wgmma $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-bf16-pingpong --out $R/bench.jsonl
  [ "${AB:-0}" = 1 ] && PDBRIDGE_ATTN_WGMMA=1 run attn_lockstep $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-bf16-wgmma-lockstep --out $R/bench.jsonl
  run attn_fp8kv $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --kv-dtype fp8 --label llama8b-bf16-fp8kv --out $R/bench.jsonl
  [ "${FUSED:-1}" = 1 ] && PDBRIDGE_FP8KV_FUSED=1 run attn_fp8kv_fused $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --kv-dtype fp8 --label llama8b-bf16-fp8kv-fused --out $R/bench.jsonl
  [ "${AB:-0}" = 1 ] && PDBRIDGE_RECIPE_STREAM=1 run attn_recipe_stream $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-bf16-recipe-stream --out $R/bench.jsonl
  [ "${MMA:-0}" = 1 ] && PDBRIDGE_ATTN_WGMMA=0 run attn_mma $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-bf16-mma --out $R/bench.jsonl
  # Larger chunks at 32K: fewer, fuller products and attention launches (the default chunk is 4096).
  run attn_chunk8k $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 32768 --reps 3 --chunk 8192 --label llama8b-bf16-chunk8k --out $R/bench.jsonl
  run attn_chunk16k $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 32768 --reps 3 --chunk 16384 --label llama8b-bf16-chunk16k --out $R/bench.jsonl
  run attn_q4recipe $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-q4_0.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-bf16-q4_0-recipe --out $R/bench.jsonl
  [ "${PEERS:-1}" = 1 ] && [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_peer python3 $DEV/torch_prefill_peer.py
  # One attention launch of the last 4K-query chunk of a 32K prompt (the warm-up forward's 248th) under ncu.
  [ "${NCU:-0}" = 1 ] && run ncu_attn ncu --clock-control none -k regex:flash_attention --launch-skip 247 --launch-count 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
    $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 32768 --reps 1 --chunk 4096 --label ncu --out /dev/null
  [ "${LONG:-1}" = 1 ] && run attn_128k $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 131072 --reps 1 --chunk 8192 --label llama8b-bf16-pingpong --out $R/bench.jsonl
  if [ "${PEERS:-1}" = 1 ] && { [ -e $R/llama_build.rc ] || [ -e $LC/build/CMakeCache.txt ]; }; then
    ts "waiting for the llama.cpp CUDA build"; while [ ! -e $R/llama_build.rc ]; do sleep 5; done
    run llama_bench $LC/build/bin/llama-bench -m $M/llama8b/decoder-f16.gguf -ngl 99 -fa 1 -b 4096 -ub 2048 -p 8192,32768 -n 0 -r 2 -o md
  fi
}
# A kernel change against the build before it, in one run: a previous build's default when
# .dev/old/pdbridge.xz is carried (its binary runs with this bundle's libraries), this build's default at 4K
# and 16K chunks, then the PyTorch peer (PEERS=1) for same-run ratios. AB_ENV="NAME=value" adds this build
# with that setting (an A/B switch such as PDBRIDGE_ATTN_WGMMA=1).
stage_ab() {
  stage_models
  local args="prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --out $R/bench.jsonl"
  if [ -f $DEV/old/pdbridge.xz ]; then
    xz -dc $DEV/old/pdbridge.xz > $P/pdbridge-old && chmod +x $P/pdbridge-old && run ab_old $P/pdbridge-old bench $args --label llama8b-old-build
  fi
  run ab_default $PDB bench $args --label llama8b-default
  if [ "${AB_TWICE:-0}" = 1 ] && [ -x $P/pdbridge-old ]; then  # the same pair again: the spread between runs of one binary
    run ab_old_2 $P/pdbridge-old bench $args --label llama8b-old-build-2
    run ab_default_2 $PDB bench $args --label llama8b-default-2
  fi
  [ -n "${AB_ENV:-}" ] && run ab_variant env "$AB_ENV" $PDB bench $args --label "llama8b-$AB_ENV"
  run ab_default_16k $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 32768 --reps 3 --chunk 16384 --out $R/bench.jsonl --label llama8b-default-chunk16k
  [ "${PEERS:-1}" = 1 ] && [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_peer python3 $DEV/torch_prefill_peer.py
}
# Issue 36's attention A/B: the attention alone (our kernel and cuDNN's, the unit bench), then Llama-8B engine + recipe
# + frames with PDBRIDGE_ATTN=ours against the default (cuDNN) at 8K, 32K and 128K, the PyTorch peer (PEERS=1), then
# the GPU suites under the default. CUDNN_TESTS=0 leaves the suites out.
stage_cudnn() {
  run attn_alone env PDBRIDGE_BENCH_ATTN=1 PDBRIDGE_BENCH_OUT=$R/attn.jsonl timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaAttention*'
  stage_models
  local args="prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --reps 3 --chunk 4096 --out $R/bench.jsonl"
  PDBRIDGE_ATTN=ours run bench_ours $PDB bench $args --tokens 8192,32768 --label llama8b-attn-ours
  run bench_cudnn $PDB bench $args --tokens 8192,32768 --label llama8b-attn-cudnn
  [ "${LONG:-1}" = 1 ] && PDBRIDGE_ATTN=ours run bench_ours_128k $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 131072 --reps 1 --chunk 8192 --out $R/bench.jsonl --label llama8b-attn-ours
  [ "${LONG:-1}" = 1 ] && run bench_cudnn_128k $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 131072 --reps 1 --chunk 8192 --out $R/bench.jsonl --label llama8b-attn-cudnn
  [ "${PEERS:-1}" = 1 ] && [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_peer python3 $DEV/torch_prefill_peer.py
  if [ "${CUDNN_TESTS:-1}" = 1 ]; then
    run unit_cuda timeout 300 $P/build/tests/unit_tests --gtest_filter='Cuda*'
    make_test_models
    run integration_cuda timeout 480 $P/build/tests/integration_tests --gtest_filter='GpuRecipe*:CudaEngine*:CudaBridge*:CudaParity*'
  fi
}
# Issue 36's attention A/B on the MoE shapes (Qwen3-30B-A3B: GQA head 128; DeepSeek-V2-Lite: MLA's 192/128), 8
# layers each, after the GPU tests that the cudnn stage's suites left to re-check (TESTS35=0 leaves them out).
stage_cudnnmoe() {
  if [ "${TESTS35:-1}" = 1 ]; then
    make_test_models
    run recheck_fp8kv timeout 200 $P/build/tests/integration_tests --gtest_filter='CudaEngine.Fp8Kv*:GpuRecipe*'
    run recheck_kernels timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaKernels.FlashAttention*:CudaKernels.Mla*:CudaAttention.*'
  fi
  for spec in "qwen3moe qwen3-30b-a3b 8 q3moe" "deepseek2 deepseek-v2-lite 8 dsv2"; do
    set -- $spec
    local arch=$1 preset=$2 layers=$3 dir=$M/$4
    [ $(free_gb) -lt 45 ] && rm -rf $M/llama8b $M/llama8b_fp8 $M/qwen8b
    [ -f $dir/decoder-f16.gguf ] || run make_$4 $PDB make-model --arch $arch --preset $preset --layers $layers --seed 11 --out $dir --hf-dtype bf16 --gguf-types f16
    local args="prefill --model $dir/hf --recipe $dir/decoder-f16.gguf --tokens 8192,32768 --reps 2 --chunk 4096 --out $R/bench.jsonl"
    PDBRIDGE_ATTN=ours run bench_$4_ours $PDB bench $args --label $preset-L$layers-attn-ours
    run bench_$4_cudnn $PDB bench $args --label $preset-L$layers-attn-cudnn
    [ "${PEERS:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_$4 python3 $DEV/torch_moe_peer.py $arch $layers
    rm -rf $dir
  done
}
# Issue 36's expert products: the MoE kernels' and engines' GPU tests, the products alone every way (the unit bench:
# cuBLAS grouped, per expert, strided batched, padded chunks, cuDNN; then PyTorch's grouped_mm at the same shapes),
# then Qwen3-30B-A3B and DeepSeek-V2-Lite shapes (8 layers) with PDBRIDGE_MOE_GEMM=grouped against the default
# (padded chunks), same run. MOE_ONLY=q3moe (or dsv2) runs one of the two shapes; MOE_TORCH=0 leaves PyTorch out.
stage_moecudnn() {
  make_test_models
  run unit_moecudnn timeout 240 $P/build/tests/unit_tests --gtest_filter='CudaGroupedGemm*:CudaKernels.Moe*:MoePadding*'
  run moe_alone env PDBRIDGE_BENCH_MOE=1 PDBRIDGE_BENCH_OUT=$R/moe.jsonl timeout 240 $P/build/tests/unit_tests --gtest_filter='CudaGroupedGemmBench*'
  [ "${PEERS:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_grouped_mm python3 $DEV/torch_grouped_mm_peer.py
  run integration_moecudnn timeout 420 $P/build/tests/integration_tests --gtest_filter='CudaEngine.ForwardTracks*:CudaEngine.FromTheGguf*'
  for spec in "qwen3moe qwen3-30b-a3b 8 q3moe" "deepseek2 deepseek-v2-lite 8 dsv2"; do
    set -- $spec
    local arch=$1 preset=$2 layers=$3 dir=$M/$4
    [ -n "${MOE_ONLY:-}" ] && [ "$4" != "$MOE_ONLY" ] && continue
    [ $(free_gb) -lt 45 ] && rm -rf $M/llama8b $M/llama8b_fp8 $M/qwen8b
    [ -f $dir/decoder-f16.gguf ] || run make_$4 $PDB make-model --arch $arch --preset $preset --layers $layers --seed 11 --out $dir --hf-dtype bf16 --gguf-types f16
    local args="prefill --model $dir/hf --recipe $dir/decoder-f16.gguf --tokens 8192,32768 --reps 2 --chunk 4096 --out $R/bench.jsonl"
    for way in grouped default; do
      PDBRIDGE_MOE_GEMM=${way/default/} run bench_$4_$way $PDB bench $args --label $preset-L$layers-moe-$way
    done
    [ "${PEERS:-1}" = 1 ] && [ "${MOE_TORCH:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_$4 python3 $DEV/torch_moe_peer.py $arch $layers
    rm -rf $dir
  done
}
# Issue 35's llama.cpp CUDA peer in the same run, on the same files: the Llama-8B shape as Q4_K_M, Q8_0 and F16 GGUFs
# and Qwen3-30B-A3B's shapes (8 layers) as Q4_K_M; bench prefill from each GGUF (the engine's cache rows, and the
# recipe's for Q4_K_M), then llama-bench -fa 1 (its binary carried: make_bundle.sh LLAMA_BENCH=1, unpacked under /tmp/lc).
stage_llamapeer() {
  local G=$M/llama8b-peer B="--tokens ${GGUF_TOKENS:-8192,32768} --reps 2 --chunk 4096 --modes engine,engine+recipe+frames --out $R/bench_peer.jsonl"
  local LB="-ngl 99 -fa 1 -b 4096 -ub 2048 -p 8192,32768 -n 0 -r 2 -o md" types=${PEER_TYPES:-q4_K_M q8_0 f16}
  [ -x $LC/build/bin/llama-bench ] || wait_llama
  [ -x $LC/build/bin/llama-bench ] || ts "no llama-bench here: the peer rows are left out"
  [ $(free_gb) -lt 50 ] && rm -rf $M/qwen8b $M/llama8b_fp8 $M/q3moe $M/dsv2
  if [[ " $types " == *" f16 "* ]]; then  # an F16 file, as converting a bf16 checkpoint writes it (no checkpoint kept)
    [ -f $G/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $G --no-hf --hf-dtype bf16 --gguf-types f16
    for q in $types; do
      [ $q = f16 ] || [ -f $G/decoder-$q.gguf ] || run quantize_$q $P/build/llama/bin/llama-quantize $G/decoder-f16.gguf $G/decoder-$q.gguf $(echo $q | tr a-z A-Z) 16
    done
  else  # quantized files only: written without a checkpoint, K-quants from a Q8_0 written here
    run make_llama8b_peer $PDB make-model --arch llama --preset 8b --seed 7 --out $G --no-hf --quantize-from q8_0 --gguf-types ${types// /,}
  fi
  for q in $types; do
    run peer_gguf_$q $PDB bench prefill --model $G/decoder-$q.gguf --kv-rows engine --label llama8b-gguf-$q-rows-engine $B
    [ -x $LC/build/bin/llama-bench ] && run llama_bench_$q $LC/build/bin/llama-bench -m $G/decoder-$q.gguf $LB
  done
  # PLANS_AB=1: prompts of lengths the warm-up did not see (a server's), cuDNN's plans per exact shape vs bucketed queries
  if [ "${PLANS_AB:-0}" = 1 ]; then
    for b in 0 1; do
      PDBRIDGE_ATTN_BUCKET=$b run plans_bucket_$b $PDB bench prefill --model $G/decoder-${types%% *}.gguf --kv-rows engine --tokens 8192,32768 \
        --vary-lengths 4096 --reps ${PLANS_REPS:-12} --chunk 4096 --modes engine+recipe+frames --label llama8b-vary-bucket-$b --out $R/bench_plans.jsonl
    done
  fi
  rm -rf $G
  [ "${PEER_MOE:-1}" = 1 ] || return 0
  local Q=$M/qwen30b8
  [ -f $Q/decoder-q4_K_M.gguf ] || run make_qwen30b8 $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 9 --out $Q --no-hf \
    --quantize-from q8_0 --gguf-types q4_K_M
  run peer_moe_q4_K_M $PDB bench prefill --model $Q/decoder-q4_K_M.gguf --kv-rows engine --label qwen3-30b-a3b-8l-gguf-q4_K_M-rows-engine $B
  [ -x $LC/build/bin/llama-bench ] && run llama_bench_moe_q4_K_M $LC/build/bin/llama-bench -m $Q/decoder-q4_K_M.gguf $LB
  rm -rf $Q
}
# Issue 35's H200 rows for DeepSeek-V4-Flash: its real layer shapes, one layer of each kind (ratios 0, 4, 128; the first
# hash-routed, the others on the learned router as in the 43-layer model), as the official FP8/FP4 checkpoint and the
# converter's GGUF (MXFP4 experts, Q8_0 block-FP8 matrices); bench prefill from each (the GGUF: no checkpoint), then
# llama.cpp CUDA on the same GGUF. make-model runs in the background from the pipeline's start (make_dsv4_flash3).
DSV4_DIR=$M/v4flash3
make_dsv4_flash3() {
  ( [ -f $DSV4_DIR/decoder-mxfp4_moe.gguf ] || $PDB make-model --arch deepseek4 --preset v4-flash --compress-ratios ${DSV4_RATIOS:-0,4,128} \
      --hash-layers 1 --hf-dtype fp8 --seed 21 --out $DSV4_DIR > $R/make_v4flash3.log 2>&1; echo $? > $R/make_v4flash3.rc ) &
}
stage_dsv4gguf() {
  ts "waiting for make_v4flash3"; while [ ! -e $R/make_v4flash3.rc ]; do sleep 5; done; ts "make_v4flash3 rc=$(cat $R/make_v4flash3.rc)"
  local g=$DSV4_DIR/decoder-mxfp4_moe.gguf B="--tokens ${GGUF_TOKENS:-8192,32768} --reps 2 --chunk ${DSV4_CHUNK:-32768} --modes engine,engine+recipe+frames --out $R/bench_dsv4gguf.jsonl"
  du -sh $DSV4_DIR/hf $g > $R/v4flash3_sizes.txt 2>&1
  run dsv4_ckpt $PDB bench prefill --model $DSV4_DIR/hf --recipe $g --label v4flash3-ckpt $B
  run dsv4_gguf $PDB bench prefill --model $g --label v4flash3-gguf $B
  [ -x $LC/build/bin/llama-bench ] || wait_llama
  [ -x $LC/build/bin/llama-bench ] && run llama_bench_dsv4 $LC/build/bin/llama-bench -m $g -ngl 99 -fa 1 -b 4096 -ub 2048 -p ${DSV4_LB_P:-8192,32768} -n 0 -r 2 -o md
  rm -rf $DSV4_DIR
}
# Issue 35's parity table on the CUDA decoder (the carried llama.cpp CUDA llama-server, -ngl 99): the needle model
# quantized here into each type with the carried importance matrix, bridged from its GGUF on the GPU, the pinned CPU
# llama-server beside it in every cell as the reference (the CPU decoder against the CUDA one).
stage_cudaparity() {
  [ -x $LC/build/bin/llama-server ] || wait_llama
  [ -x $LC/build/bin/llama-server ] || { ts "no CUDA llama-server here: cudaparity left out"; return 0; }
  run parity_cuda env SERVER_BIN=$LC/build/bin/llama-server DECODER_FLAGS="-ngl 99" REF_SERVER_BIN=$P/build/llama/bin/llama-server DEVICE=cuda \
    LEGS="${CP_LEGS:-gguf}" IMATRIX_FILE=$DEV/imatrix.gguf GGUF_DIR=/tmp/ptab PARITY_SEED=${PARITY_SEED:-2026120401} PROMPTS=${CP_PROMPTS:-6} \
    bash $REPO/scripts/parity_types.sh $R/cparity ${CP_TYPES:-Q6_K Q5_K_M Q5_0 Q5_1 Q4_1 IQ4_NL IQ4_XS Q3_K_M Q2_K IQ3_S IQ3_XXS IQ2_S IQ2_XS IQ2_XXS IQ1_M IQ1_S}
}
# Issue 4's Qwen3-8B rows with the current kernels (the disk holds one 8B model: the Llama one goes first, so run
# this stage after the stages that use it).
stage_qwen() {
  [ $(free_gb) -lt 40 ] && rm -rf $M/llama8b $M/llama8b_fp8
  [ -f $M/qwen8b/decoder-f16.gguf ] || run make_qwen8b $PDB make-model --arch qwen3 --preset 8b --seed 8 --out $M/qwen8b --hf-dtype bf16 --gguf-types f16
  run qwen_8k_32k $PDB bench prefill --model $M/qwen8b/hf --recipe $M/qwen8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label qwen3-8b --out $R/bench.jsonl
  [ "${LONG:-1}" = 1 ] && run qwen_128k $PDB bench prefill --model $M/qwen8b/hf --recipe $M/qwen8b/decoder-f16.gguf --tokens 131072 --reps 1 --chunk 8192 --label qwen3-8b --out $R/bench.jsonl
  # The same-run peers at the Qwen3-8B shape: PyTorch (Qwen3ForCausalLM, sdpa, bf16) and llama.cpp CUDA on the same F16 GGUF.
  if [ "${PEERS:-1}" = 1 ]; then
    PYTHONUNBUFFERED=1 run torch_qwen3_peer python3 $DEV/torch_qwen3_peer.py
    if [ -e $R/llama_build.rc ] || [ -e $LC/build/CMakeCache.txt ]; then
      ts "waiting for the llama.cpp CUDA build"; while [ ! -e $R/llama_build.rc ]; do sleep 5; done
      run llama_bench_qwen $LC/build/bin/llama-bench -m $M/qwen8b/decoder-f16.gguf -ngl 99 -fa 1 -b 4096 -ub 2048 -p 8192,32768 -n 0 -r 2 -o md
    fi
  fi
}
# Issue 18's H200 rows: the real Qwen3-30B-A3B and DeepSeek-V2-Lite layer shapes (random bf16 weights; fewer
# layers than the models have, MOE_LAYERS / MLA_LAYERS, because the disk holds one model's checkpoint and GGUF
# at a time only at that size), pdbridge's engine and engine + recipe + frames, the grouped expert products
# against one product per expert (PDBRIDGE_MOE_GEMM=loop), PyTorch (Qwen3MoeForCausalLM / DeepseekV2ForCausalLM,
# sdpa, bf16) and llama.cpp CUDA (llama-bench -fa 1) on the same F16 GGUF, all in this run.
stage_moe() {
  local L1=${MOE_LAYERS:-8} L2=${MLA_LAYERS:-8}
  for spec in "qwen3moe qwen3-30b-a3b $L1 q3moe" "deepseek2 deepseek-v2-lite $L2 dsv2"; do
    set -- $spec
    local arch=$1 preset=$2 layers=$3 dir=$M/$4
    [ $(free_gb) -lt 45 ] && rm -rf $M/llama8b $M/llama8b_fp8 $M/qwen8b
    [ -f $dir/decoder-f16.gguf ] || run make_$4 $PDB make-model --arch $arch --preset $preset --layers $layers --seed 11 --out $dir --hf-dtype bf16 --gguf-types f16
    run bench_$4 $PDB bench prefill --model $dir/hf --recipe $dir/decoder-f16.gguf --tokens 8192,32768 --reps 2 --chunk 4096 --label $preset-L$layers --out $R/bench.jsonl
    PDBRIDGE_MOE_GEMM=loop run bench_$4_loop $PDB bench prefill --model $dir/hf --recipe $dir/decoder-f16.gguf --tokens 8192 --reps 2 --chunk 4096 --label $preset-L$layers-expert-loop --out $R/bench.jsonl
    [ "${PEERS:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_$4 python3 $DEV/torch_moe_peer.py $arch $layers
    if [ "${PEERS:-1}" = 1 ] && [ -e $LC/build/CMakeCache.txt ]; then
      ts "waiting for the llama.cpp CUDA build"; while [ ! -e $R/llama_build.rc ]; do sleep 5; done
      run llama_bench_$4 $LC/build/bin/llama-bench -m $dir/decoder-f16.gguf -ngl 99 -fa 1 -b 4096 -ub 2048 -p 8192,32768 -n 0 -r 2 -o md
    fi
    rm -rf $dir
  done
}
# Issue 17: the fidelity guard and the bridge on a CUDA-built llama-server, on the GPU and on the device's CPU
# (gpu_decoder.sh; results in $R/fid). It builds its own llama-server (CUDA, with the server target).
stage_gpudec() { LC=/tmp/llama-cuda-server T0=$T0 bash $DEV/gpu_decoder.sh $DEV; }
stage_fp8() {
  [ -f $M/llama8b/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16
  [ -f $M/llama8b/decoder-q4_0.gguf ] || run quantize_q4 $P/build/llama/bin/llama-quantize $M/llama8b/decoder-f16.gguf $M/llama8b/decoder-q4_0.gguf Q4_0
  run make_llama8b_fp8 $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b_fp8 --hf-dtype fp8 --gguf-types ""
  run bench_fp8 $PDB bench prefill --model $M/llama8b_fp8/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-fp8 --out $R/bench.jsonl
  run bench_bf16 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-bf16 --out $R/bench.jsonl
  run bench_bf16_q8 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192 --reps 3 --chunk 4096 --cache-type q8_0 --label llama8b-bf16-q8cache --out $R/bench.jsonl
}
# Issue 5's 8B scale windows and the wire under pacing, chained here so that one drive.sh call runs them after
# the stages above (their scripts also run alone; see each script's header).
stage_scale() { run scale env SKIP_1M=1 bash $DEV/scale.sh ${SCALE_DEADLINE:-430}; }
stage_pace() { run pace env CACHE=f32 RATES="10 0" bash $DEV/pace.sh 200000; }
stage_m1() { stage_models; run m1 bash $DEV/million8b.sh; }
# Issue 6 on the GPU: the demo with CUDA prefill (the bundle's prebuilt binaries stand in for `make`,
# which needs apt and cannot run there), on a 24K-character haystack.
stage_demo() { run demo env PDBRIDGE_DEMO_CHARS=24000 bash $REPO/scripts/demo.sh; }
# Issue 34's structure checks on the device: the golden hashes on this host's CPU (another ISA than the build
# machine's: the mirrored arithmetic is compiled with fixed instructions), and the GPU suites the tests stage leaves out.
stage_golden() {
  TM=$P/build/test-models
  [ -d /work/main/tests ] || ln -sfn $REPO/tests /work/main/tests
  run test_models_more bash -c "set -e; $PDB make-model --arch deepseek4 --preset tiny --seed 5 --out $TM/deepseek4-tiny; \
    $PDB make-model --arch deepseek4 --preset tiny-hca --seed 6 --out $TM/deepseek4-tiny-hca; \
    $PDB make-model --arch deepseek4 --preset tiny --seed 5 --hf-dtype fp8 --out $TM/deepseek4-tiny-fp8"
  run golden timeout 400 $P/build/tests/integration_tests --gtest_filter='Golden.*'
  run integration_cuda_more timeout 400 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*:CudaTensorParallel.RanksOnOneGpu*:CudaTpComm.RanksSharing*:CudaEngine.Fp8Kv*'
}
# Issue 34's same-run A/B of DeepSeek-V4's GPU forward before and after its split into phases: the real-shape layer
# bench of a test binary linked with the earlier cuda_engine_dsv4.cpp (.dev/old/integration_tests_presplit.xz)
# against this build's, alternating, twice each.
stage_dsv4ab() {
  [ -f $DEV/old/integration_tests_presplit.xz ] || { ts "no presplit binary"; return; }
  xz -dc $DEV/old/integration_tests_presplit.xz > $P/it-presplit && chmod +x $P/it-presplit
  for i in 1 2; do
    for which in presplit current; do
      local bin=$P/build/tests/integration_tests
      [ $which = presplit ] && bin=$P/it-presplit
      PDBRIDGE_BENCH=1 PDBRIDGE_DSV4_BENCH_TOKENS=${DSV4_AB_TOKENS:-32768} PDBRIDGE_BENCH_OUT=$R/dsv4_ab_${which}_$i.jsonl \
        run dsv4_ab_${which}_$i timeout 300 $bin --gtest_filter='Deepseek4CudaBench.*'
    done
  done
}
# Issue 34's byte-for-byte check of the CUDA engine's refactor: every K/V frame of the same requests from the earlier
# binary (.dev/old/pdbridge.xz) and this build's, per architecture and cache type (scripts/device/frames_ab.py).
stage_framesab() {
  [ -f $DEV/old/pdbridge.xz ] || { ts "no earlier binary"; return; }
  [ -x $P/pdbridge-old ] || { xz -dc $DEV/old/pdbridge.xz > $P/pdbridge-old && chmod +x $P/pdbridge-old; }
  TM=$P/build/test-models
  local port=18800
  # deepseek2 on the GPU takes DeepSeek-V2's head widths: the `small` preset (the GPU tests' MLA model)
  [ -f $TM/deepseek2-small/decoder-q8_0.gguf ] || run make_deepseek2_small $PDB make-model --arch deepseek2 --preset small --seed 7 \
    --out $TM/deepseek2-small --hf-dtype f32 --gguf-types f32,q8_0
  for spec in ${FRAMES_SPECS:-llama-tiny:f16:f16 llama-tiny:q8_0:q8_0 llama-tiny-h16:f16:f16 qwen3-tiny:f16:f16 qwen3moe-tiny:f16:f16 deepseek2-small:f32:f16 deepseek2-small:q8_0:q8_0}; do
    IFS=: read -r m g k <<< "$spec"
    run framesab_${m}_$k python3 $REPO/scripts/device/frames_ab.py $P/pdbridge-old $PDB $TM/$m/hf $TM/$m/decoder-$g.gguf 1500 512 $k $port
    port=$((port + 2))
  done
  [ -f $M/llama8b/decoder-f16.gguf ] && run framesab_llama8b python3 $REPO/scripts/device/frames_ab.py $P/pdbridge-old $PDB $M/llama8b/hf $M/llama8b/decoder-f16.gguf 9000 4096 f16 $port
  grep -h identical $R/framesab_*.log > $R/framesab.jsonl
}
# Issue 35 on the GPU: the CUDA engine from the decoder's GGUF. The expansion kernels against their CPU twin; the engine
# from GGUFs against the CPU engine from the same files; the bridge served from a GGUF alone; bench prefill on the
# Llama-8B shape as Q4_K_M / Q8_0 / F16 GGUFs (quantized by llama-quantize from the F16 file, as users do) beside the
# bf16 checkpoint path, and llama.cpp CUDA's llama-bench on the same Q4_K_M file.
stage_gguf() {
  run unit_dequant timeout 180 $P/build/tests/unit_tests --gtest_filter='CudaDequant*:CudaKernels*'
  TM=$P/build/test-models
  [ -f $TM/llama-tiny/decoder-q4_0.gguf ] || run test_models bash -c "set -e; $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0,q4_0; \
    $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny-h16 --hf-dtype f16 --gguf-types f16; \
    $PDB make-model --arch qwen3 --preset tiny --seed 2 --out $TM/qwen3-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0; \
    $PDB make-model --arch qwen3moe --preset tiny --seed 3 --out $TM/qwen3moe-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0; \
    $PDB make-model --arch deepseek2 --preset tiny --seed 4 --out $TM/deepseek2-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0"
  run integration_gguf timeout 420 $P/build/tests/integration_tests --gtest_filter='CudaEngine.*:CudaBridge.*:GgufModel.*'
  [ -f $M/llama8b/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16
  for q in ${GGUF_TYPES:-q4_K_M q8_0}; do
    local up=$(echo $q | tr a-z A-Z)
    [ -f $M/llama8b/decoder-$q.gguf ] || run quantize_$q $P/build/llama/bin/llama-quantize $M/llama8b/decoder-f16.gguf $M/llama8b/decoder-$q.gguf $up 16
  done
  local B="--tokens ${GGUF_TOKENS:-8192,32768} --reps 2 --chunk 4096 --modes engine,engine+recipe+frames --out $R/bench_gguf.jsonl"
  run bench_ckpt $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --label llama8b-checkpoint $B
  for g in ${GGUF_TYPES:-q4_K_M q8_0} f16; do
    run bench_gguf_$g $PDB bench prefill --model $M/llama8b/decoder-$g.gguf --label llama8b-gguf-$g $B
  done
  if [ "${PEERS:-1}" = 1 ] && [ -f $DEV/llama-src.tar.xz ]; then
    ts "waiting for the llama.cpp CUDA build"; while [ ! -e $R/llama_build.rc ]; do sleep 5; done; ts "llama build rc=$(cat $R/llama_build.rc)"
    run llama_bench_q4km $LC/build/bin/llama-bench -m $M/llama8b/decoder-q4_K_M.gguf -ngl 99 -fa 1 -b 4096 -ub 2048 -p 8192,32768 -n 0 -r 2 -o md
  fi
}
# Issue 35's MoE row: Qwen3-30B-A3B's shapes (8 of its 48 layers) as a Q4_K_M GGUF (its experts kept quantized and
# expanded per layer) beside the bf16 checkpoint path; the 8B model's files are removed first (the disk holds 64 GB).
stage_ggufmoe() {
  rm -rf $M/llama8b
  local Q=$M/qwen30b8
  [ -f $Q/decoder-f16.gguf ] || run make_qwen30b8 $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 9 --out $Q --hf-dtype bf16 --gguf-types f16
  [ -f $Q/decoder-q4_K_M.gguf ] || run quantize_moe_q4_K_M $P/build/llama/bin/llama-quantize $Q/decoder-f16.gguf $Q/decoder-q4_K_M.gguf Q4_K_M 16
  local B="--tokens ${GGUF_TOKENS:-8192,32768} --reps 2 --chunk 4096 --modes engine,engine+recipe+frames --out $R/bench_gguf.jsonl"
  run bench_moe_ckpt $PDB bench prefill --model $Q/hf --recipe $Q/decoder-f16.gguf --label qwen3-30b-a3b-8l-checkpoint $B
  run bench_moe_gguf $PDB bench prefill --model $Q/decoder-q4_K_M.gguf --label qwen3-30b-a3b-8l-gguf-q4_K_M $B
}
# Issue 35's same-run comparison at equal recipes: the checkpoint path with the Q4_K_M decoder's recipe beside the
# engine from that GGUF (and Q8_0's), for the MoE shapes (when their files are still there) and the Llama-8B shape.
stage_ggufab() {
  local B="--tokens ${GGUF_TOKENS:-8192,32768} --reps 2 --chunk 4096 --modes engine,engine+recipe+frames --out $R/bench_gguf.jsonl"
  local Q=$M/qwen30b8
  if [ -f $Q/decoder-q4_K_M.gguf ]; then
    run bench_moe_ckpt_q4km $PDB bench prefill --model $Q/hf --recipe $Q/decoder-q4_K_M.gguf --label qwen3-30b-a3b-8l-checkpoint-recipe-q4_K_M $B
    run bench_moe_gguf_ab $PDB bench prefill --model $Q/decoder-q4_K_M.gguf --label qwen3-30b-a3b-8l-gguf-q4_K_M $B
    rm -rf $Q
  fi
  [ -f $M/llama8b/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16
  for q in q4_K_M q8_0; do
    [ -f $M/llama8b/decoder-$q.gguf ] || run quantize_$q $P/build/llama/bin/llama-quantize $M/llama8b/decoder-f16.gguf $M/llama8b/decoder-$q.gguf $(echo $q | tr a-z A-Z) 16
  done
  run bench_ckpt_q4km $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-q4_K_M.gguf --label llama8b-checkpoint-recipe-q4_K_M $B
  run bench_gguf_q4km_ab $PDB bench prefill --model $M/llama8b/decoder-q4_K_M.gguf --label llama8b-gguf-q4_K_M $B
  run bench_ckpt_q8 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-q8_0.gguf --label llama8b-checkpoint-recipe-q8_0 $B
  run bench_gguf_q8 $PDB bench prefill --model $M/llama8b/decoder-q8_0.gguf --label llama8b-gguf-q8_0 $B
}
# Issue 35's cache rows from the engine's own K/V products (--kv-rows engine) against the recipe's (decoder): the GPU
# tests, output parity on this host's CPU decoder (GPU prefill, both ways on the same prompts), then bench prefill on
# the Llama-8B shape as Q4_K_M / Q8_0 / F16 GGUFs both ways beside the checkpoint path at the Q4_K_M recipe.
stage_kvrows() {
  TM=$P/build/test-models
  [ -f $TM/llama-tiny/decoder-q4_0.gguf ] || run test_models bash -c "set -e; $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0,q4_0; \
    $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny-h16 --hf-dtype f16 --gguf-types f16; \
    $PDB make-model --arch qwen3 --preset tiny --seed 2 --out $TM/qwen3-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0; \
    $PDB make-model --arch qwen3moe --preset tiny --seed 3 --out $TM/qwen3moe-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0"
  run unit_kvrows timeout 180 $P/build/tests/unit_tests --gtest_filter='CudaKernels.QkRows*:CudaKernels.QkvRope*'
  run integration_kvrows timeout 420 $P/build/tests/integration_tests --gtest_filter='CudaParity.EngineKv*:CudaBridge.*:CudaEngine.FromTheGguf*'
  run parity_kvrows env IMATRIX=0 DEVICE=cuda LEGS="gguf engine" PARITY_SEED=${PARITY_SEED:-2026120402} bash $REPO/scripts/parity_types.sh $R/parity ${PARITY_TYPES:-Q4_K_M Q8_0 Q6_K}
  [ -f $M/llama8b/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16
  for q in q4_K_M q8_0; do
    [ -f $M/llama8b/decoder-$q.gguf ] || run quantize_$q $P/build/llama/bin/llama-quantize $M/llama8b/decoder-f16.gguf $M/llama8b/decoder-$q.gguf $(echo $q | tr a-z A-Z) 16
  done
  local B="--tokens ${GGUF_TOKENS:-8192,32768} --reps 2 --chunk 4096 --modes engine,engine+recipe+frames --out $R/bench_kvrows.jsonl"
  run bench_ckpt_q4km $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-q4_K_M.gguf --label llama8b-checkpoint-recipe-q4_K_M $B
  for g in ${KVROWS_TYPES:-q4_K_M q8_0 f16}; do
    for rows in ${KVROWS_LEGS:-decoder engine}; do
      run bench_${g}_$rows $PDB bench prefill --model $M/llama8b/decoder-$g.gguf --kv-rows $rows --label llama8b-gguf-$g-rows-$rows $B
    done
  done
}
# Issue 35's re-check after a change the kvrows and gguf stages measured: every GGUF-related GPU test, DeepSeek-V4 from
# its GGUF on the GPU, and the golden hashes on this host's CPU (another ISA than the build machine's).
stage_recheck35() {
  make_test_models
  run more_models bash -c "set -e; $PDB make-model --arch llama --preset tiny --seed 9 --out $TM/llama-tiny-other --hf-dtype f32 --gguf-types f32; \
    $PDB make-model --arch deepseek4 --preset tiny --seed 5 --out $TM/deepseek4-tiny; \
    $PDB make-model --arch deepseek4 --preset tiny --seed 5 --hf-dtype fp8 --out $TM/deepseek4-tiny-fp8"
  run unit_dequant timeout 180 $P/build/tests/unit_tests --gtest_filter='CudaDequant*:CudaKernels*'
  run integration_35 timeout 540 $P/build/tests/integration_tests --gtest_filter='CudaEngine.*:CudaBridge.*:CudaParity.*:GgufModel.*:Deepseek4CudaBridge.FromItsGgufAlone'
  [ "${GOLDEN:-1}" = 1 ] && stage_golden
}
# Issue 35's 24 GB row: all 48 layers of Qwen3-30B-A3B's shapes as a Q4_K_M GGUF (made without a checkpoint, from a
# Q8_0 GGUF written by make-model: 32 + 18.6 GB on the 64 GB disk) under --max-gpu-mem 24, the engine's rows.
stage_moe48() {
  local Q=$M/qwen30b48
  [ -f $Q/decoder-q4_K_M.gguf ] || run make_qwen30b48 $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --seed 9 --out $Q --no-hf \
    --quantize-from q8_0 --gguf-types q4_K_M
  run bench_moe48 $PDB bench prefill --model $Q/decoder-q4_K_M.gguf --kv-rows engine --max-gpu-mem 24 --tokens ${GGUF_TOKENS:-8192,32768} \
    --reps 2 --chunk 4096 --modes engine,engine+recipe+frames --label qwen3-30b-a3b-48l-gguf-q4_K_M-24g --out $R/bench_moe48.jsonl
}
# Issue 35's numerics that follow the decoder (--numerics): the kernels against their CPU twins, the bridged state
# against the CPU decoder's with bf16 and the decoder's numerics, then output parity on this host's CPU decoder for
# the needle model's types (GPU prefill from the GGUF; legs NUM_LEGS, the quantized files kept out of the results).
stage_numerics() {
  make_test_models
  run unit_numerics timeout 180 $P/build/tests/unit_tests --gtest_filter='CudaDequant*:CudaKernels.ProductInputs*:CudaKernels.Swiglu*:ProductNumerics*'
  run integration_numerics timeout 480 $P/build/tests/integration_tests --gtest_filter='CudaParity.DecoderNumerics*:CudaParity.EngineKv*:CudaEngine.*:CudaBridge.ServesTheBridgeFromTheDecodersGgufAlone:CudaBridge.DecoderNumerics*'
  run parity_numerics env IMATRIX=0 DEVICE=cuda LEGS="${NUM_LEGS:-gguf cpu}" GGUF_DIR=/tmp/ptab PARITY_SEED=${PARITY_SEED:-2026120402} \
    bash $REPO/scripts/parity_types.sh $R/parity ${PARITY_TYPES:-F16 Q8_0 Q4_K_M Q6_K Q4_0}
  [ "${NUM_BENCH:-0}" = 1 ] || return 0
  # what the decoder's numerics cost: the Llama-8B shape as Q4_K_M (made without a checkpoint), each mode
  local G=$M/llama8b-gguf
  [ -f $G/decoder-q4_K_M.gguf ] || run make_llama8b_q4km $PDB make-model --arch llama --preset 8b --seed 7 --out $G --no-hf --quantize-from q8_0 --gguf-types q4_K_M
  for n in ${NUM_MODES:-bf16 half cpu}; do
    run bench_numerics_$n $PDB bench prefill --model $G/decoder-q4_K_M.gguf --numerics $n --tokens ${GGUF_TOKENS:-8192,32768} --reps 2 --chunk 4096 \
      --modes engine,engine+recipe+frames --label llama8b-gguf-q4_K_M-numerics-$n --out $R/bench_numerics.jsonl
  done
}
# After a change to the engine's MoE block, its GGUF weights' expansion or cuDNN's attention plans: the MoE kernels
# and products against the CPU's (every way), the expansion against the host decoders (whole layers and prefixes),
# cuDNN's attention against the f64 twin (bucketed queries too), and the engine and parity suites (qwen3moe and
# deepseek2 on the default MoE path; the engine's own K/V rows of every layer).
stage_enginecheck() {
  make_test_models
  run unit_engine timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Moe*:CudaGroupedGemm*:MoePadding*:CudaDequant*:CudaAttention.*'
  run integration_engine timeout 400 $P/build/tests/integration_tests --gtest_filter='CudaParity.*:CudaEngine.*'
}
# What engine + recipe + frames costs beside the engine alone (issue 36's <= 3%), each part apart: the Llama-8B F16 and
# (GAP_MOE=1) Qwen3-30B-A3B 8-layer Q4_K_M files (made here without a checkpoint), the engine's own rows; first the
# tests of that path (the fused q|k|v rows assembled from the rows' products, the engine and parity suites, the tail
# captures that keep the engine's state for the prefix cache).
stage_gapcheck() {
  make_test_models
  run unit_gap timeout 120 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Assembled*'
  run integration_gap timeout 300 $P/build/tests/integration_tests --gtest_filter='CudaEngine.*:CudaParity.*:CudaTailCapture.*:TailCapture.*'
  local Q=$M/qwen30b8 G=$M/llama8b-peer B="--tokens ${GGUF_TOKENS:-8192,32768} --reps 3 --chunk 4096 --kv-rows engine --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_gap.jsonl"
  [ -f $G/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $G --no-hf --hf-dtype bf16 --gguf-types f16
  run gap_f16 $PDB bench prefill --model $G/decoder-f16.gguf --label llama8b-f16-gap $B
  [ "${GAP_MOE:-1}" = 1 ] || return 0
  [ -f $Q/decoder-q4_K_M.gguf ] || run make_qwen30b8 $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 9 --out $Q --no-hf \
    --quantize-from q8_0 --gguf-types q4_K_M
  run gap_moe $PDB bench prefill --model $Q/decoder-q4_K_M.gguf --label qwen3-30b-a3b-8l-q4_K_M-gap $B
}
# Issue 36, session 29: the expert rows in a large and a small chunk size, the counts read back through mapped memory
# (PDBRIDGE_READBACK=copy: the copy, as the A/B), the q product on kv_rows' half input. The tests of those paths, the
# products alone (one chunk size against two, 4096- and 8192-token chunks), then the 8-layer MoE and MLA shapes part by
# part (the checkpoint with the F16 recipe; Qwen3's F16 GGUF with the engine's rows) beside PyTorch, and the Llama-8B
# F16 gap again.
stage_moegap() {
  make_test_models
  run unit_moegap timeout 240 $P/build/tests/unit_tests --gtest_filter='MoePadding*:CudaGroupedGemm.*:CudaKernels.Moe*:CudaKernels.Readback*:CudaKernels.Assembled*'
  run moe_products env PDBRIDGE_BENCH_MOE=1 PDBRIDGE_BENCH_MOE_T=4096,8192 PDBRIDGE_BENCH_MOE_WAYS=grouped,padded,chunks-one,chunks \
    PDBRIDGE_BENCH_OUT=$R/moe.jsonl timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaGroupedGemmBench*'
  run integration_moegap timeout 480 $P/build/tests/integration_tests --gtest_filter='CudaEngine.*:CudaParity.*:CudaTailCapture.*:TailCapture.*:Deepseek4Cuda.*'
  local B="--tokens 8192,32768 --reps 3 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_moegap.jsonl"
  for spec in "qwen3moe qwen3-30b-a3b q3moe" "deepseek2 deepseek-v2-lite dsv2"; do
    set -- $spec
    local arch=$1 preset=$2 dir=$M/$3 name=$3
    [ -f $dir/decoder-f16.gguf ] || run make_$name $PDB make-model --arch $arch --preset $preset --layers 8 --seed 11 --out $dir --hf-dtype bf16 --gguf-types f16
    for rb in mapped copy; do
      PDBRIDGE_READBACK=${rb/mapped/} run bench_${name}_recipe_$rb $PDB bench prefill --model $dir/hf --recipe $dir/decoder-f16.gguf $B --label $preset-L8-recipe-readback-$rb
      [ $arch = qwen3moe ] && PDBRIDGE_READBACK=${rb/mapped/} run bench_${name}_rows_$rb $PDB bench prefill --model $dir/decoder-f16.gguf --kv-rows engine $B \
        --label $preset-L8-gguf-f16-rows-readback-$rb
    done
    [ "${PEERS:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_$name python3 $DEV/torch_moe_peer.py $arch 8
    rm -rf $dir
  done
  local G=$M/llama8b-peer
  [ -f $G/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $G --no-hf --hf-dtype bf16 --gguf-types f16
  run gap_f16 $PDB bench prefill --model $G/decoder-f16.gguf --kv-rows engine --label llama8b-f16-gap $B
}
# The same after the q|k|v product of half weights was made once for the rows and the attention (session 29's second
# call): every GPU suite the change touches (DeepSeek-V4's test models made here too), the products alone, the
# Qwen3-30B-A3B 8-layer F16 GGUF with the engine's rows and the Llama-8B F16 gap at 5 repetitions, PyTorch beside.
stage_moegap2() {
  make_test_models
  make_dsv4_test_models
  run unit_moegap2 timeout 240 $P/build/tests/unit_tests --gtest_filter='MoePadding*:CudaGroupedGemm.*:CudaKernels.*:CudaAttention.*'
  run integration_moegap2 timeout 540 $P/build/tests/integration_tests \
    --gtest_filter='CudaEngine.*:CudaParity.*:CudaTailCapture.*:TailCapture.*:Deepseek4Cuda.*:CudaBridge.*:GpuRecipe*'
  run moe_products2 env PDBRIDGE_BENCH_MOE=1 PDBRIDGE_BENCH_MOE_T=4096,8192 PDBRIDGE_BENCH_MOE_WAYS=padded,chunks-one,chunks \
    PDBRIDGE_BENCH_OUT=$R/moe2.jsonl timeout 400 $P/build/tests/unit_tests --gtest_filter='CudaGroupedGemmBench*'
  local B="--tokens 8192,32768 --reps 5 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_moegap2.jsonl"
  local Q=$M/q3moe
  [ -f $Q/decoder-f16.gguf ] || run make_q3moe $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf --hf-dtype bf16 --gguf-types f16
  run bench_q3moe_rows $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows
  [ "${PEERS:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_q3moe python3 $DEV/torch_moe_peer.py qwen3moe 8
  rm -rf $Q
  local G=$M/llama8b-peer
  [ -f $G/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $G --no-hf --hf-dtype bf16 --gguf-types f16
  run gap_f16 $PDB bench prefill --model $G/decoder-f16.gguf --kv-rows engine --label llama8b-f16-gap $B
}
# Session 29's third call: the decoder's RoPE table kept on the host for every position (no per-chunk host work where
# the MoE engines wait on the host), the two-size layout's test counts; the suites that change touches, the Qwen3
# 8-layer F16 rows gap and the Llama-8B F16 gap, then the products alone (8192-token chunks) for what time is left.
stage_moegap3() {
  make_test_models
  run unit_moegap3 timeout 120 $P/build/tests/unit_tests --gtest_filter='CudaGroupedGemm.*:CudaKernels.Dsv4Indexer*:CudaKernels.Readback*'
  run integration_moegap3 timeout 300 $P/build/tests/integration_tests --gtest_filter='GpuRecipe*:CudaParity.*:CudaEngine.*:CudaBridge.*:CudaTailCapture.*'
  local B="--tokens 8192,32768 --reps 5 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_moegap3.jsonl"
  local Q=$M/q3moe G=$M/llama8b-peer
  [ -f $Q/decoder-f16.gguf ] || run make_q3moe $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf --hf-dtype bf16 --gguf-types f16
  run bench_q3moe_rows $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows
  [ -f $G/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $G --no-hf --hf-dtype bf16 --gguf-types f16
  run gap_f16 $PDB bench prefill --model $G/decoder-f16.gguf --kv-rows engine --label llama8b-f16-gap $B
  run moe_products3 env PDBRIDGE_BENCH_MOE=1 PDBRIDGE_BENCH_MOE_T=8192,4096 PDBRIDGE_BENCH_MOE_WAYS=padded,chunks-one,chunks \
    PDBRIDGE_BENCH_OUT=$R/moe3.jsonl timeout 400 $P/build/tests/unit_tests --gtest_filter='CudaGroupedGemmBench*'
}
# Session 30's work, written without a device: the sparse attention on wgmma and the expert products that read FP4
# codes, each against its CPU twin, then against the path it would replace (kernel benches, the V4-Flash layer bench
# with each switch), the engine and bridge with the FP4 products, session 29's padded_products refactor re-checked, and
# the pinned RoPE tables now shared by the GPU recipe, the MLA attention and the DeepSeek-V4 engine.
stage_session30() {
  make_dsv4_test_models
  run unit_session30 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaMoeFp4.*:CudaKernels.*:CudaGroupedGemm.*:MoePadding*'
  run fp4_products env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaBench.MoeFp4ProductsAtV4FlashShapes'
  run attn_kernels env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaBench.Dsv4SparseAttentionKernels'
  make_test_models
  run integration_session30 timeout 500 $P/build/tests/integration_tests \
    --gtest_filter='GpuRecipe*:CudaEngine.*:CudaParity.*:CudaBridge.*:Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run integration_fp4 env PDBRIDGE_DSV4_EXPERTS_FP4=1 timeout 400 $P/build/tests/integration_tests \
    --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run dsv4_bench_session30 env BENCH_TOKENS=${BENCH_TOKENS:-32768,131072} \
    BENCH_RUNS="${BENCH_RUNS:-fp4:32768 fp4:32768:PDBRIDGE_DSV4_ATTN=wgmma fp4:32768:PDBRIDGE_DSV4_EXPERTS_FP4=1 fp4:32768:PDBRIDGE_DSV4_ATTN=wgmma+PDBRIDGE_DSV4_EXPERTS_FP4=1}" \
    bash $DEV/dsv4_gpu.sh bench
}
# The engine + rows gap of Qwen3-30B-A3B (8 layers) and Llama-8B from their F16 GGUFs with the engine's rows, timed
# part by part (PDBRIDGE_CAPTURE_STATS=1)
rowsgap_q3moe_llama8b() {
  local B="--tokens 8192,32768 --reps 5 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_rowsgap.jsonl"
  local Q=$M/q3moe G=$M/llama8b-peer
  [ -f $Q/decoder-f16.gguf ] || run make_q3moe $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf --hf-dtype bf16 --gguf-types f16
  run rowsgap_q3moe env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows
  [ -f $G/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $G --no-hf --hf-dtype bf16 --gguf-types f16
  run rowsgap_llama8b env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $G/decoder-f16.gguf --kv-rows engine --label llama8b-f16-rows $B
}
# The engine + rows gap part by part (PDBRIDGE_CAPTURE_STATS=1: the rows' GPU work, the host's waits for slots, the
# delivery's waits for copies), Qwen3-30B-A3B 8 layers and Llama-8B from their F16 GGUFs with the engine's rows, and
# DeepSeek-V2-Lite 8 layers with the recipe's latent rows and the engine's.
stage_rowsgap() {
  rowsgap_q3moe_llama8b
  local B="--tokens 8192,32768 --reps 5 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_rowsgap.jsonl"
  # DeepSeek-V2-Lite from its F16 GGUF: the recipe's latent rows against the engine's (new in session 30), PyTorch after
  local V=$M/dsv2
  [ -f $V/decoder-f16.gguf ] || run make_dsv2 $PDB make-model --arch deepseek2 --preset deepseek-v2-lite --layers 8 --seed 13 --out $V --no-hf --hf-dtype bf16 --gguf-types f16
  run rowsgap_dsv2_recipe env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $V/decoder-f16.gguf $B --label dsv2-L8-gguf-f16-recipe
  run rowsgap_dsv2_rows env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $V/decoder-f16.gguf --kv-rows engine $B --label dsv2-L8-gguf-f16-rows
  [ "${PEERS:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_dsv2 python3 $DEV/torch_moe_peer.py deepseek2 8
}
# Session 32: the indexer's top-k from shared memory and the Q8_0 products in 128-row tiles (tests, the kernels'
# A/Bs, the V4-Flash layer bench A/B with the top-k's share of the indexer), then the rows gap of Qwen3-30B-A3B and
# Llama-8B with the MoE readbacks' GPU idle, the staging waits, the engine's K/V rows and the capture's tail timed.
stage_session32() {
  make_dsv4_test_models
  run unit_session32 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Dsv4*:CudaKernels.Readback*:CudaKernels.Q8*:CudaMoe*'
  run indexer_bench env PDBRIDGE_BENCH=1 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaBench.Dsv4IndexerAtV4FlashShapes:CudaBench.Q8BlockProducts*'
  rowsgap_q3moe_llama8b
  make_test_models
  run integration_dsv4 timeout 400 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*:GpuRecipe*:CudaEngine.*'
  run dsv4_bench_session32 env BENCH_TOKENS=${BENCH_TOKENS:-32768,131072} \
    BENCH_RUNS="${BENCH_RUNS:-fp4:32768 fp4:32768:PDBRIDGE_Q8_GEMM=64 fp4:32768:PDBRIDGE_DSV4_TOPK=smem}" bash $DEV/dsv4_gpu.sh bench
}
# Session 32's kernels not yet run: the FP8 indexer's queries as register fragments and the engine rows of an f16
# cache in one kernel (their tests, the kernels' A/Bs, the bridge with the fused rows, the V4-Flash layer bench A/B,
# Qwen3-30B-A3B's rows gap with the fused rows; the default's rows gap is stage session32's).
stage_session32b() {
  make_dsv4_test_models
  run unit_session32b timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Dsv4*:CudaKernels.Q8*:CudaKernels.KvRows*'
  run kernel_bench env PDBRIDGE_BENCH=1 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaBench.Dsv4IndexerAtV4FlashShapes:CudaBench.Q8BlockProducts*'
  make_test_models
  run integration_session32b timeout 400 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*:GpuRecipe*'
  run dsv4_bench_session32b env BENCH_TOKENS=${BENCH_TOKENS:-32768,131072} \
    BENCH_RUNS="${BENCH_RUNS:-fp4:32768 fp4:32768:PDBRIDGE_DSV4_INDEXER_A=registers fp4:32768:PDBRIDGE_Q8_GEMM=64 fp4:32768}" bash $DEV/dsv4_gpu.sh bench
}
# Session 33's row path: the default path's bridge and parity suites, DeepSeek-V4's attention kernels, Qwen3-30B-A3B's
# rows gap (8 layers) with the slot buffers handed over as frames (PDBRIDGE_FRAMES=handover) and with the fused rows
# (PDBRIDGE_ROWS_FUSED=1) against the default in the same call, the frames' benches on the host's cores, then both
# switches through the bridge and parity suites.
stage_session33() {
  # the default path first: its slot buffers' layout and the capture's steps changed unrun (session 33/34)
  make_test_models
  run integration_frames_default timeout 400 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*:CudaTailCapture.*'
  # DeepSeek-V4's sparse attention with the indexer's choices read all at once per tile (both kernels against the twin,
  # then the bench: ratio 0 and 128 read no choices and anchor the run against session 31's)
  run dsv4_attn_kernels env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests \
    --gtest_filter='CudaKernels.Dsv4SparseAttention*:CudaBench.Dsv4SparseAttentionKernels'
  local Q=$M/q3moe B="--tokens 8192,32768 --reps 5 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_rowsgap.jsonl"
  [ -f $Q/decoder-f16.gguf ] || run make_q3moe $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf --hf-dtype bf16 --gguf-types f16
  run rowsgap_q3moe env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows
  run rowsgap_q3moe_handover env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_FRAMES=handover $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows-handover
  run rowsgap_q3moe_fused env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_ROWS_FUSED=1 $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows-fused
  # the K/V blocks' frames (encode_frames and frame_in_place against session 32's framing; written whole or in
  # pieces through httplib to the front door's reader) on the device's host cores
  run wire_bench env PDBRIDGE_BENCH=1 timeout 180 $P/build/tests/unit_tests --gtest_filter='Wire*:HttpStream*'
  run integration_frames_handover env PDBRIDGE_FRAMES=handover timeout 400 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*:CudaTailCapture.*'
  run integration_rows_fused env PDBRIDGE_ROWS_FUSED=1 timeout 400 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*'
}
# Session 34's short call (its device budget mostly spent on machines that did not start): the two defaults changed
# unrun, DeepSeek-V4's sparse attention kernels (twin test, bench) and the CUDA backend's capture (bridge, parity).
stage_session34() {
  run dsv4_attn_kernels env PDBRIDGE_BENCH=1 timeout 120 $P/build/tests/unit_tests \
    --gtest_filter='CudaKernels.Dsv4SparseAttention*:CudaBench.Dsv4SparseAttentionKernels'
  make_test_models
  run integration_frames_default timeout 300 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*:CudaTailCapture.*'
}
# Session 35's call, most needed first: the default path's bridge and parity (session 33's slot buffers and session
# 34's capture steps, both unrun), DeepSeek-V4's attention twin and bench (session 34's load order), its GPU engine's
# suites (this session's weight loader), its layer bench for the 43-layer figure, the ncu profiles, then the rows gap
# A/B of session 33's two switches and their suites.
stage_session35() {
  make_test_models
  run integration_frames_default timeout 300 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*:CudaTailCapture.*'
  run dsv4_attn_kernels env PDBRIDGE_BENCH=1 timeout 120 $P/build/tests/unit_tests \
    --gtest_filter='CudaKernels.Dsv4SparseAttention*:CudaBench.Dsv4SparseAttentionKernels'
  make_dsv4_test_models
  run integration_dsv4 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run dsv4_bench_session35 env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768" bash $DEV/dsv4_gpu.sh bench
  stage_ncudsv4
  local Q=$M/q3moe B="--tokens 8192,32768 --reps 5 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_rowsgap.jsonl"
  [ -f $Q/decoder-f16.gguf ] || run make_q3moe $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf --hf-dtype bf16 --gguf-types f16
  run rowsgap_q3moe env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows
  run rowsgap_q3moe_handover env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_FRAMES=handover $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows-handover
  run rowsgap_q3moe_fused env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_ROWS_FUSED=1 $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows-fused
  run integration_frames_handover env PDBRIDGE_FRAMES=handover timeout 300 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*:CudaTailCapture.*'
  run integration_rows_fused env PDBRIDGE_ROWS_FUSED=1 timeout 300 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*'
  run wire_bench env PDBRIDGE_BENCH=1 timeout 180 $P/build/tests/unit_tests --gtest_filter='Wire*:HttpStream*'
}
# Session 35's second call: both sparse attention kernels with each row's source worked out once per warp (shuffled
# to the lanes that copy it) and the wgmma kernel's next-tile copies issued under its score products: the twin test
# and bench, DeepSeek-V4's GPU suites, its layer bench, and the ratio-4 profile.
stage_session35b() {
  run dsv4_attn_kernels env PDBRIDGE_BENCH=1 timeout 120 $P/build/tests/unit_tests \
    --gtest_filter='CudaKernels.Dsv4SparseAttention*:CudaBench.Dsv4SparseAttentionKernels'
  make_dsv4_test_models
  run integration_dsv4 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run dsv4_bench_session35b env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768" bash $DEV/dsv4_gpu.sh bench
  NCU_ONLY=r4 stage_ncudsv4
}
# Session 35's third call: where DeepSeek-V4's MoE phase spends the 16 ms beside its routed products (the new profile
# spans: routing and gather, the wait for the side stream's FP4 expansion, the shared expert and the combine), with the
# expansion on the side stream (default) and inline, in one call; then the engine's suites with the new marks.
stage_session35c() {
  make_dsv4_test_models
  run integration_dsv4 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run dsv4_bench_session35c env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:PDBRIDGE_DSV4_EXPAND=inline fp4:32768" bash $DEV/dsv4_gpu.sh bench
}
# Session 35's fourth call: the f32 products of DeepSeek-V4's hyper-connection mixes and router, and their passes.
stage_session35d() {
  run dsv4_f32_bench env PDBRIDGE_BENCH=1 timeout 120 $P/build/tests/unit_tests --gtest_filter='CudaBench.Dsv4F32MixAndRouterProducts'
}
# Session 35's fifth call: the sections' two mixes as two f32 products of 24 (then the default) against the one of 48
# (PDBRIDGE_DSV4_MIX=stacked), DeepSeek-V4's GPU suites on the default first. The split was slower in the engine and
# was taken out (docs/RESULTS.md session 35): PDBRIDGE_DSV4_MIX no longer exists, so both runs are now the one product.
stage_session35e() {
  make_dsv4_test_models
  run integration_dsv4 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run dsv4_bench_session35e env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:PDBRIDGE_DSV4_MIX=stacked fp4:32768" bash $DEV/dsv4_gpu.sh bench
}
# Session 36's call: the FP4 expert products by byte-permute tables with a step of products kept in flight (their
# twin tests, their bench against expansion + cuBLAS, DeepSeek-V4's suites and layer bench with them on, a profile)
# and the mixes' narrow f32 kernel (its twin test, its bench against cuBLAS, the suites through it, the layer bench's A/B),
# then session 35's figures on whichever card this is: the attention kernels, the f32 products, two default layer-bench
# runs (the spread), the default suites and the rows gap with the hand-over now the default.
stage_session36() {
  run fp4_kernels env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests \
    --gtest_filter='Fp4Expand*:MoeTiles*:CudaMoeFp4.*:CudaBench.MoeFp4ProductsAtV4FlashShapes'
  run f32_narrow env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaKernels.F32Narrow*:CudaBench.Dsv4F32MixAndRouterProducts'
  make_dsv4_test_models
  run integration_dsv4_fp4_narrow env PDBRIDGE_DSV4_EXPERTS_FP4=1 PDBRIDGE_DSV4_MIX=narrow timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run dsv4_bench_session36 env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:PDBRIDGE_DSV4_MIX=cublas fp4:32768:PDBRIDGE_DSV4_EXPERTS_FP4=1 fp4:32768" bash $DEV/dsv4_gpu.sh bench
  stage_ncufp4
  run dsv4_attn_kernels env PDBRIDGE_BENCH=1 timeout 120 $P/build/tests/unit_tests \
    --gtest_filter='CudaKernels.Dsv4SparseAttention*:CudaBench.Dsv4SparseAttentionKernels'
  run integration_dsv4 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  make_test_models
  run integration_default timeout 300 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*:CudaTailCapture.*'
  local Q=$M/q3moe B="--tokens 8192,32768 --reps 5 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_rowsgap.jsonl"
  [ -f $Q/decoder-f16.gguf ] || run make_q3moe $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf --hf-dtype bf16 --gguf-types f16
  run rowsgap_q3moe env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows
  run rowsgap_q3moe_copy env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_FRAMES=copy $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows engine $B --label qwen3-30b-a3b-L8-gguf-f16-rows-copy
}
# Session 36's later calls: the FP4 products' kernel (its second and third forms: warp-specialized, then the weights as
# register fragments): its twin tests, its bench against expansion + cuBLAS, DeepSeek-V4's suites and layer bench with
# the FP4 products against the default, the kernel's profile.
stage_session36b() {
  run fp4_kernels env PDBRIDGE_BENCH=1 timeout 150 $P/build/tests/unit_tests \
    --gtest_filter='Fp4Expand*:MoeTiles*:CudaMoeFp4.*:CudaBench.MoeFp4ProductsAtV4FlashShapes'
  make_dsv4_test_models
  run integration_dsv4_fp4 env PDBRIDGE_DSV4_EXPERTS_FP4=1 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run dsv4_bench_session36b env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:PDBRIDGE_DSV4_EXPERTS_FP4=1 fp4:32768" bash $DEV/dsv4_gpu.sh bench
  stage_ncufp4
}
# Session 36's last call: the FP4 products as DeepSeek-V4's default, against the expansion (PDBRIDGE_DSV4_EXPERTS_FP4=0)
# in alternating layer-bench runs (the spread), and both paths' suites.
stage_session36c() {
  make_dsv4_test_models
  run integration_dsv4 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run integration_dsv4_expand env PDBRIDGE_DSV4_EXPERTS_FP4=0 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run dsv4_bench_session36c env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:PDBRIDGE_DSV4_EXPERTS_FP4=0 fp4:32768 fp4:32768:PDBRIDGE_DSV4_EXPERTS_FP4=0" bash $DEV/dsv4_gpu.sh bench
}
# Session 38 (sessions 37 and 38 wrote these without a device): the FP8 indexer with the keys as the products' A and
# the heads summed by products (PDBRIDGE_DSV4_INDEXER_A=keys), the top-k by warps (PDBRIDGE_DSV4_TOPK=warps), the FP4
# gate|up products fused (PDBRIDGE_DSV4_FP4_FUSE=1: the gather in their loads, the SwiGLU in their epilogue), the FP4
# products' deeper pipeline (PDBRIDGE_DSV4_FP4_DEPTH=deep) and the mixes' split products (PDBRIDGE_DSV4_MIX=split):
# session38b's core, then the deeper pipeline's suites and bench, the layer bench at the prefill server's default chunk
# of 4,096 (the targets' runs use 32,768), and the keys kernel's profile.
stage_session38() {
  stage_session38b
  run fp4_deep env PDBRIDGE_BENCH=1 PDBRIDGE_DSV4_FP4_DEPTH=deep timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaMoeFp4.*:CudaBench.MoeFp4ProductsAtV4FlashShapes'
  local NEW=PDBRIDGE_DSV4_INDEXER_A=keys+PDBRIDGE_DSV4_TOPK=warps+PDBRIDGE_DSV4_FP4_FUSE=1
  run dsv4_bench_session38 env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768:PDBRIDGE_DSV4_FP4_DEPTH=deep fp4:4096 fp4:4096:$NEW+PDBRIDGE_DSV4_MIX=split" bash $DEV/dsv4_gpu.sh bench
  stage_ncuidx
}
# session38's core, for a short device budget: the suites of the defaults (the default paths' refactors: the indexer's
# loads, the top-k selection, the FP4 kernel's templates, the narrow kernel's grid) and of the new switches, the new
# kernels' twin tests and benches, the layer bench alternating the defaults with all the new switches, then each alone.
stage_session38b() {
  make_dsv4_test_models
  run integration_dsv4_defaults timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run idx_kernels env PDBRIDGE_BENCH=1 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Dsv4Indexer*:CudaBench.Dsv4IndexerAtV4FlashShapes'
  run fp4_default env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests --gtest_filter='Fp4Expand*:MoeTiles*:CudaMoeFp4.*:CudaBench.MoeFp4ProductsAtV4FlashShapes'
  run integration_dsv4_new env PDBRIDGE_DSV4_INDEXER_A=keys PDBRIDGE_DSV4_TOPK=warps PDBRIDGE_DSV4_FP4_FUSE=1 PDBRIDGE_DSV4_MIX=split timeout 300 \
    $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  local K=PDBRIDGE_DSV4_INDEXER_A=keys W=PDBRIDGE_DSV4_TOPK=warps U=PDBRIDGE_DSV4_FP4_FUSE=1
  local NEW=$K+$W+$U
  run dsv4_bench_session38b env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:$NEW fp4:32768 fp4:32768:$NEW fp4:32768:$K fp4:32768:$W fp4:32768:$U" bash $DEV/dsv4_gpu.sh bench
  run mix_split env PDBRIDGE_BENCH=1 timeout 150 $P/build/tests/unit_tests --gtest_filter='CudaKernels.F32Narrow*:CudaBench.Dsv4F32MixAndRouterProducts'
}
# session38b's least, for what is left of a session's device time: the new kernels' twin tests and benches, the
# default kernels' twin tests, DeepSeek-V4's suites with all the new switches, the layer bench alternating the defaults
# with all of them.
stage_session38c() {
  make_dsv4_test_models
  run idx_kernels env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Dsv4Indexer*:CudaKernels.F32Narrow*:CudaBench.Dsv4IndexerAtV4FlashShapes'
  run fp4_default env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaMoeFp4.*:CudaBench.MoeFp4ProductsAtV4FlashShapes'
  run integration_dsv4_new env PDBRIDGE_DSV4_INDEXER_A=keys PDBRIDGE_DSV4_TOPK=warps PDBRIDGE_DSV4_FP4_FUSE=1 PDBRIDGE_DSV4_MIX=split timeout 300 \
    $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  local NEW=PDBRIDGE_DSV4_INDEXER_A=keys+PDBRIDGE_DSV4_TOPK=warps+PDBRIDGE_DSV4_FP4_FUSE=1
  run dsv4_bench_session38c env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:$NEW fp4:32768 fp4:32768:$NEW" bash $DEV/dsv4_gpu.sh bench
}
# The new kernels' twin tests alone (and the FP4 products' bench: a second), for the last minutes of a session's device time.
stage_session38d() {
  run new_kernels env PDBRIDGE_BENCH=1 timeout 150 $P/build/tests/unit_tests \
    --gtest_filter='CudaKernels.Dsv4Indexer*:CudaKernels.F32Narrow*:CudaMoeFp4.*:CudaBench.MoeFp4ProductsAtV4FlashShapes'
}
# Session 39: the keys kernel, the warps' top-k and the fused FP4 gate|up as the defaults (session 38's call), checked
# again: DeepSeek-V4's suites on the new defaults and on the old paths, the kernels' twin tests (the FP8 kernels' own
# top-k held against the bf16 one), the layer bench alternating the new defaults with the old paths, and the chunk
# sizes between the server's 4,096 and the targets' 32,768.
stage_session39() {
  make_dsv4_test_models
  local OLD=PDBRIDGE_DSV4_INDEXER_A=smem+PDBRIDGE_DSV4_TOPK=global+PDBRIDGE_DSV4_FP4_FUSE=0
  run integration_dsv4_defaults timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run integration_dsv4_old env PDBRIDGE_DSV4_INDEXER_A=smem PDBRIDGE_DSV4_TOPK=global PDBRIDGE_DSV4_FP4_FUSE=0 timeout 300 \
    $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run idx_kernels env PDBRIDGE_BENCH=1 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Dsv4Indexer*:CudaBench.Dsv4IndexerAtV4FlashShapes'
  run fp4_default env PDBRIDGE_BENCH=1 timeout 200 $P/build/tests/unit_tests --gtest_filter='CudaMoeFp4.*:CudaBench.MoeFp4ProductsAtV4FlashShapes'
  run dsv4_bench_session39 env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:$OLD fp4:32768 fp4:32768:$OLD fp4:4096 fp4:8192 fp4:16384 fp4:32768" bash $DEV/dsv4_gpu.sh bench
}
# session39's bench alone (the new defaults against the old paths, alternating), for another card in a short call.
stage_session39b() {
  local OLD=PDBRIDGE_DSV4_INDEXER_A=smem+PDBRIDGE_DSV4_TOPK=global+PDBRIDGE_DSV4_FP4_FUSE=0
  run dsv4_bench_session39b env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:$OLD fp4:32768 fp4:32768:$OLD fp4:32768" bash $DEV/dsv4_gpu.sh bench
}
# The two kernels 14,000 tok/s at 32K asks for (docs/RESULTS.md, session 39) under Nsight Compute: the FP4 expert
# products and the sparse attention's ratio-4 launch.
stage_session39c() {
  stage_ncufp4
  NCU_ONLY=r4 stage_ncudsv4
}
# Session 40: the FP4 products' two shapes (256 outputs x 128 rows, the new default, against session 36's 128 x 256,
# PDBRIDGE_DSV4_FP4_TILE=rows256): both under their tests and the products' bench (alternating), the layer bench
# alternating, then DeepSeek-V4's GPU suites on the default.
stage_session40() { fp4_shapes_check session40; }
# fp4_shapes_check TAG [HOOK]: the FP4 products' tests and bench (both shapes), the layer bench with the default and
# rows256 alternating, HOOK (a function's name) if given, then DeepSeek-V4's GPU suites on the default.
fp4_shapes_check() {
  make_dsv4_test_models
  run fp4_shapes_$1 env PDBRIDGE_BENCH=1 timeout 240 $P/build/tests/unit_tests --gtest_filter='MoeTiles.*:Fp4Expand.*:CudaMoeFp4.*:CudaBench.MoeFp4ProductsAtV4FlashShapes'
  local OLD=PDBRIDGE_DSV4_FP4_TILE=rows256
  run dsv4_bench_$1 env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:$OLD fp4:32768 fp4:32768:$OLD" bash $DEV/dsv4_gpu.sh bench
  [ -n "${2:-}" ] && $2
  run integration_dsv4_defaults timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
}
# Both shapes' gate|up launches under Nsight Compute (the bench's third launch of each: L2's throughput is the
# question), and the suites with rows256.
stage_session40b() {
  NCU_BASE=demangled ncu_kernel fp4rows256 'moe_fp4_kernel<.bool.1, .int.1, .bool.0>' 2 CudaBench.MoeFp4ProductsAtV4FlashShapes
  NCU_BASE=demangled ncu_kernel fp4outputs256 'moe_fp4_kernel<.bool.1, .int.2, .bool.0>' 2 CudaBench.MoeFp4ProductsAtV4FlashShapes
  [ -n "${NCU_ONLY:-}" ] || run integration_dsv4_rows256 env PDBRIDGE_DSV4_FP4_TILE=rows256 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
}
# The FP4 products' codes loaded straight into their ring slots (no copy that waits for the load): both shapes'
# tests and bench, the layer bench alternating, both kernels' SASS under Nsight Compute, the suites on the default.
session40c_ncu() { NCU_SASS=1 NCU_ONLY=1 stage_session40b; }
stage_session40c() { fp4_shapes_check session40c session40c_ncu; }
# The FP4 products' codes three k-steps ahead. At 2d34c02 this stage also ran two ahead (PDBRIDGE_DSV4_FP4_AHEAD=2,
# retired since: the same for outputs256, slower for rows256) and the default's SASS; now the common check.
stage_session40d() { fp4_shapes_check session40d; }
# Session 40's defaults on whatever card comes (the targets are the H200's): the layer bench, default and rows256
# alternating, and at 8K chunks (outputs256's half-width tiles).
stage_session40e() {
  local OLD=PDBRIDGE_DSV4_FP4_TILE=rows256
  run dsv4_bench_session40e env BENCH_TOKENS=32768,131072 BENCH_RUNS="fp4:32768 fp4:32768:$OLD fp4:32768 fp4:32768:$OLD fp4:8192 fp4:8192:$OLD" bash $DEV/dsv4_gpu.sh bench
}
# The FP4 products' one-product scales by a byte permute: both shapes' tests and bench, the layer bench alternating,
# the suites on the default.
stage_session40f() { fp4_shapes_check session40f; }
# DeepSeek-V4's sparse attention with fewer instructions a tile: the kernels' tests against the CPU twin and their
# bench, the bench again from .dev/unit_tests_old.xz if there (the same test file built with the previous kernel),
# the layer bench alternating with PDBRIDGE_DSV4_ATTN=mma (S41_RUNS), the suites on the default, the wgmma kernel
# under Nsight Compute (ratio 4 at 32K; NCU_SKIP=1: not).
stage_session41() {
  make_dsv4_test_models
  run attn_session41 env PDBRIDGE_BENCH=1 timeout 240 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Dsv4SparseAttention*:CudaBench.Dsv4SparseAttentionKernels'
  if [ -f $DEV/unit_tests_old.xz ]; then
    xz -dc $DEV/unit_tests_old.xz > $R/unit_tests_old && chmod +x $R/unit_tests_old
    run attn_session41_old env PDBRIDGE_BENCH=1 timeout 240 $R/unit_tests_old --gtest_filter='CudaBench.Dsv4SparseAttentionKernels'
    run attn_session41_new env PDBRIDGE_BENCH=1 timeout 240 $P/build/tests/unit_tests --gtest_filter='CudaBench.Dsv4SparseAttentionKernels'
    rm -f $R/unit_tests_old
  fi
  local OLD=PDBRIDGE_DSV4_ATTN=mma
  run dsv4_bench_session41 env BENCH_TOKENS=32768,131072 BENCH_RUNS="${S41_RUNS:-fp4:32768 fp4:32768:$OLD fp4:32768 fp4:32768:$OLD}" bash $DEV/dsv4_gpu.sh bench
  run integration_dsv4_defaults timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  [ -n "${NCU_SKIP:-}" ] && return 0
  NCU_BASE=demangled NCU_SASS=1 ncu_kernel attnwgmma sparse_attention_wgmma_kernel 1 CudaBench.Dsv4SparseAttentionKernels
}
# The FP4 products' per-step addresses stepped along (stages, descriptors, the gathered rows' sources): both shapes'
# tests and bench, the bench from the previous kernel's binary (.dev/unit_tests_old.xz) before and after, the layer
# bench alternating with rows256, the suites.
session41c_old() {
  [ -f $DEV/unit_tests_old.xz ] || return 0
  xz -dc $DEV/unit_tests_old.xz > $R/unit_tests_old && chmod +x $R/unit_tests_old
  for n in 1 2; do
    run fp4_old_$n env PDBRIDGE_BENCH=1 timeout 240 $R/unit_tests_old --gtest_filter='CudaBench.MoeFp4ProductsAtV4FlashShapes'
    run fp4_new_$n env PDBRIDGE_BENCH=1 timeout 240 $P/build/tests/unit_tests --gtest_filter='CudaBench.MoeFp4ProductsAtV4FlashShapes'
  done
  rm -f $R/unit_tests_old
}
stage_session41c() { fp4_shapes_check session41c session41c_old; }
# DeepSeek-V4's f32 products (the mixes, the router) as 3xTF32 tensor-core products: their twin tests and bench,
# the suites with the defaults and with PDBRIDGE_DSV4_F32=tf32x3 (the tiny models' chunks take it only so), the layer
# bench alternating with PDBRIDGE_DSV4_F32=fp32 (the f32 paths as before).
# The f32 tensor kernel's variants alone: the twin test and bench, then its default's 48-output mix under Nsight Compute.
stage_session42a() {
  run f32_session42a env PDBRIDGE_BENCH=1 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaKernels.F32*:CudaKernels.Dsv4PreSumNorm*:CudaKernels.Dsv4MixRotation*:CudaBench.Dsv4F32MixAndRouterProducts'
  [ -n "${NCU_SKIP:-}" ] && return 0
  NCU_SASS=1 ncu_kernel f32tensor f32_tensor_kernel 2 CudaBench.Dsv4F32MixAndRouterProducts
}
# The FP4 products' codes and scales addresses stepped along, the q path's bf16 rows from the sections' norm: the
# FP4 tests, the products' bench from the previous binary (.dev/unit_tests_old.xz) and the new one alternating, the
# layer bench (default, PDBRIDGE_DSV4_F32=fp32, default), the suites.
stage_session42b() {
  make_dsv4_test_models
  run fp4_tests_42b timeout 300 $P/build/tests/unit_tests --gtest_filter='MoeTiles.*:Fp4Expand.*:CudaMoeFp4.*:CudaKernels.Dsv4PreSumNorm*:CudaKernels.Dsv4CombineInThePostMix*:CudaKernels.Dsv4MixRotation*'
  [ -n "${S42_SKIP_OLD:-}" ] || session41c_old
  run dsv4_bench_session42b env BENCH_TOKENS=32768,131072 BENCH_RUNS="${S42_RUNS:-fp4:32768 fp4:32768:PDBRIDGE_DSV4_F32=fp32 fp4:32768}" bash $DEV/dsv4_gpu.sh bench
  run integration_dsv4_defaults timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
}
# Session 43: the sections' Q8_0 blocks from the fused pre-sum + norm (bit-for-bit test), cuBLASLt's algorithms at the
# Llama-8B shapes (the heuristic's first choice against the others), the 43-layer bench alternating with
# PDBRIDGE_DSV4_F32=fp32 (S43_SKIP_DSV4=1 leaves it out), then the Llama-8B engine (its model made on the CPUs
# meanwhile): with S43_OLD=1 the previous build ($DEV/old/pdbridge.xz) and this one alternating, with S43_AB_ENV=X=Y
# this build under that switch and without it alternating, and PyTorch's forward after them (PEERS=1).
stage_session43() {
  [ -n "${S43_SKIP_DSV4:-}" ] || make_dsv4_test_models
  [ -f $M/llama8b/decoder-f16.gguf ] || ( $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16 \
    > $R/make_llama8b.log 2>&1; echo $? > $R/llama8b.rc ) &
  run fused_tests_43 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaKernels.Dsv4PreSumNorm*:CudaKernels.Dsv4CombineInThePostMix*:CudaMoeFp4.*:CudaKernels.Gemm*:CudaKernels.RmsNorm*:CudaKernels.QkRows*'
  [ -n "${S43_SKIP_GEMM:-}" ] || run gemm_algos_43 env PDBRIDGE_BENCH=1 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaBench.GemmAlgorithmsAtLlama8bShapes'
  if [ -n "${S43_RECIPE_TESTS:-}" ]; then
    make_test_models
    run integration_recipe_43 timeout 400 $P/build/tests/integration_tests --gtest_filter='GpuRecipe*:CudaBridge*:CudaParity.SharedKv*:CudaParity.BridgedState*'
  fi
  [ -n "${S43_SKIP_DSV4:-}" ] || run integration_dsv4_43 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  [ -n "${S43_SKIP_DSV4:-}" ] || run dsv4_bench_session43 env BENCH_TOKENS=32768,131072 \
    BENCH_RUNS="${S43_RUNS:-fp4:32768 fp4:32768:PDBRIDGE_DSV4_F32=fp32 fp4:32768 fp4:32768:PDBRIDGE_DSV4_F32=fp32}" bash $DEV/dsv4_gpu.sh bench
  [ -f $M/llama8b/decoder-f16.gguf ] || { ts "waiting for the Llama-8B model"; while [ ! -e $R/llama8b.rc ]; do sleep 5; done; }
  local args="prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --out $R/bench.jsonl"
  [ -n "${S43_OLD:-}" ] && [ -f $DEV/old/pdbridge.xz ] && xz -dc $DEV/old/pdbridge.xz > $P/pdbridge-old && chmod +x $P/pdbridge-old
  for i in $(seq 1 ${S43_PAIRS:-2}); do
    [ -x $P/pdbridge-old ] && run llama8b_old_$i $P/pdbridge-old bench $args --label llama8b-old-$i
    [ -n "${S43_AB_ENV:-}" ] && run llama8b_switch_$i env "$S43_AB_ENV" $PDB bench $args --label "llama8b-$S43_AB_ENV-$i"
    run llama8b_new_$i $PDB bench $args --label llama8b-new-$i
  done
  [ "${PEERS:-1}" = 1 ] && [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_peer python3 $DEV/torch_prefill_peer.py
}
# Session 44: the Llama-8B engine from its F16 GGUF (half products, the decoder's numerics; --kv-rows engine) beside the
# checkpoint + F16 recipe path, the same model file; PDBRIDGE_CAPTURE_STATS=1 on the checkpoint path's e+r+f; with
# S44_OLD=1 the previous build ($DEV/old/pdbridge.xz) alternating; the 43-layer DeepSeek-V4 bench unless S44_SKIP_DSV4=1.
stage_session44() {
  [ -n "${S44_SKIP_DSV4:-}" ] || make_dsv4_test_models
  local llama=1
  [ -n "${S44_SKIP_GGUF:-}" ] && [ -n "${S44_SKIP_CK:-}" ] && llama=
  [ -z "$llama" ] || [ -f $M/llama8b/decoder-f16.gguf ] || ( $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16 \
    > $R/make_llama8b.log 2>&1; echo $? > $R/llama8b.rc ) &
  [ -n "${S44_TESTS:-}" ] && run tests_44 timeout 300 $P/build/tests/unit_tests --gtest_filter="${S44_TESTS}"
  if [ -n "${S44_ITESTS:-}" ]; then make_test_models; run itests_44 timeout 400 $P/build/tests/integration_tests --gtest_filter="${S44_ITESTS}"; fi
  [ -n "${S44_SKIP_DSV4:-}" ] || run dsv4_bench_session44 env BENCH_TOKENS=32768,131072 \
    BENCH_RUNS="${S44_RUNS:-fp4:32768 fp4:32768:PDBRIDGE_DSV4_F32=fp32 fp4:32768}" bash $DEV/dsv4_gpu.sh bench
  [ -z "$llama" ] || [ -f $M/llama8b/decoder-f16.gguf ] || { ts "waiting for the Llama-8B model"; while [ ! -e $R/llama8b.rc ]; do sleep 5; done; }
  local T="--tokens ${S44_TOKENS:-8192,32768} --reps 3 --chunk 4096 --out $R/bench.jsonl"
  local ck="prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf $T --modes engine,engine+recipe+frames"
  # S44_KVROWS=" ": the GGUF runs with the default --kv-rows (auto)
  local gg="prefill --model $M/llama8b/decoder-f16.gguf ${S44_KVROWS:---kv-rows engine} $T --modes engine,engine+recipe,engine+recipe+frames"
  [ -n "${S44_OLD:-}" ] && [ -f $DEV/old/pdbridge.xz ] && xz -dc $DEV/old/pdbridge.xz > $P/pdbridge-old && chmod +x $P/pdbridge-old
  for i in $(seq 1 ${S44_PAIRS:-1}); do
    [ -n "${S44_SKIP_GGUF:-}" ] && break
    [ -x $P/pdbridge-old ] && run gguf_old_$i $P/pdbridge-old bench $gg --label llama8b-gguf-f16-old-$i
    run gguf_new_$i $PDB bench $gg --label llama8b-gguf-f16-new-$i
    [ -n "${S44_SKIP_CK:-}" ] || run ckpt_stats_$i env PDBRIDGE_CAPTURE_STATS=1 $PDB bench $ck --label llama8b-ckpt-stats-$i
    [ -n "${S44_CK_AB:-}" ] && run ckpt_ab_$i env PDBRIDGE_CAPTURE_STATS=1 "$S44_CK_AB" $PDB bench $ck --label "llama8b-ckpt-$S44_CK_AB-$i"
  done
  # S44_MOE=1: Qwen3-30B-A3B's shapes at 8 layers as an F16 GGUF (made on the device, no checkpoint), old and new builds
  # alternating, and PyTorch's forward (grouped_mm experts) on the same shapes
  if [ -n "${S44_MOE:-}" ]; then
    wait
    local Q=$M/qwen30b8f16
    [ -f $Q/decoder-f16.gguf ] || run make_qwen30b8_f16 $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf --hf-dtype bf16 --gguf-types f16
    local mq="prefill --model $Q/decoder-f16.gguf --kv-rows engine $T --modes ${S44_MOE_MODES:-engine,engine+recipe+frames}"
    for i in $(seq 1 ${S44_MOE_PAIRS:-2}); do
      [ -x $P/pdbridge-old ] && run moe_old_$i $P/pdbridge-old bench $mq --label qwen3moe-8l-f16-old-$i
      run moe_new_$i env ${S44_MOE_ENV:-PDBRIDGE_NONE=} $PDB bench $mq --label qwen3moe-8l-f16-new-$i
    done
    [ "${PEERS:-1}" = 1 ] && [ -f $DEV/torch_moe_peer.py ] && PYTHONUNBUFFERED=1 run torch_moe_peer python3 $DEV/torch_moe_peer.py qwen3moe 8
  fi
  [ "${PEERS:-1}" = 1 ] && [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_peer python3 $DEV/torch_prefill_peer.py
}
# Session 45: the GPU tests of session 44's last changes (--kv-rows auto, the shared K/V products), then the F16 GGUF
# benches with the default --kv-rows against auto, and the chunk's size for the MoE shapes (the full forward beside
# the bridge's modes: the 8-layer slice's last layer is 1/8 of its work, 1/48 of the whole model's). Switches:
# S45_SKIP_TESTS, S45_SKIP_LLAMA, S45_SKIP_MOE, S45_KV (the Llama runs' --kv-rows values), S45_CHUNKS (the MoE's),
# S45_DSV4=1 (DeepSeek-V4's 32K/128K layer bench first, for an H200), S45_STATS=1, PEERS.
stage_session45() {
  [ -n "${S45_DSV4:-}" ] && { make_dsv4_test_models; run dsv4_bench_session45 env BENCH_TOKENS=32768,131072 BENCH_RUNS="${S45_RUNS:-fp4:32768 fp4:32768}" bash $DEV/dsv4_gpu.sh bench; }
  local L8=$M/llama8b Q=$M/qwen30b8f16
  [ -n "${S45_SKIP_LLAMA:-}" ] || [ -f $L8/decoder-f16.gguf ] || ( $PDB make-model --arch llama --preset 8b --seed 7 --out $L8 --no-hf --hf-dtype bf16 --gguf-types f16 \
    > $R/make_llama8b.log 2>&1; echo $? > $R/llama8b.rc ) &
  [ -n "${S45_SKIP_MOE:-}" ] || [ -f $Q/decoder-f16.gguf ] || ( $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf \
    --hf-dtype bf16 --gguf-types f16 > $R/make_qwen.log 2>&1; echo $? > $R/qwen.rc ) &
  if [ -z "${S45_SKIP_TESTS:-}" ]; then
    run tests_45 timeout 200 $P/build/tests/unit_tests --gtest_filter="${S45_TESTS:-CudaKernels.KvRowsToF16*:CudaKernels.ProductInputs*:CudaKernels.QkvRope*:CudaKernels.Swiglu*:CudaKernels.RmsNorm*}"
    make_test_models
    run itests_45 timeout 400 $P/build/tests/integration_tests --gtest_filter="${S45_ITESTS:-CudaBridge.*:CudaParity.EngineKvRows*:CudaParity.BridgedState*:CudaParity.DecoderNumerics*:GpuRecipe*:CudaEngine.*}"
  fi
  local T="--tokens ${S45_TOKENS:-8192,32768} --reps 3 --out $R/bench.jsonl"
  if [ -z "${S45_SKIP_LLAMA:-}" ]; then
    [ -f $L8/decoder-f16.gguf ] || { ts "waiting for the Llama-8B model"; while [ ! -e $R/llama8b.rc ]; do sleep 5; done; }
    for kv in ${S45_KV:-decoder auto}; do
      run llama_$kv $PDB bench prefill --model $L8/decoder-f16.gguf --kv-rows $kv $T --chunk 4096 --modes engine,engine+recipe+frames --label llama8b-gguf-f16-$kv
    done
    # S45_STATS=1: the engine's rows once more with the capture's part-by-part times (PDBRIDGE_CAPTURE_STATS)
    [ -n "${S45_STATS:-}" ] && run llama_stats env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $L8/decoder-f16.gguf --kv-rows engine $T --chunk 4096 \
      --modes engine,engine+recipe,engine+recipe+frames --label llama8b-gguf-f16-engine-stats
  fi
  if [ -z "${S45_SKIP_MOE:-}" ]; then
    [ -f $Q/decoder-f16.gguf ] || { ts "waiting for the Qwen3 model"; while [ ! -e $R/qwen.rc ]; do sleep 5; done; }
    for c in ${S45_CHUNKS:-4096 8192 16384}; do
      run moe_chunk_$c $PDB bench prefill --model $Q/decoder-f16.gguf --kv-rows ${S45_MOE_KV:-auto} $T --chunk $c \
        --modes full-forward,engine,engine+recipe+frames --label qwen3moe-8l-f16-chunk$c
    done
    [ "${PEERS:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_moe_peer python3 $DEV/torch_moe_peer.py qwen3moe 8
  fi
  wait
}
# Session 45, second call: the new defaults (--kv-rows auto, the engine's chunk) end to end and in the benches, each
# against the old choice in the same call: Llama-8B F16 (default against --chunk 8192), Qwen3-30B-A3B and
# DeepSeek-V2-Lite 8-layer slices (default = 8,192-token chunks, against --chunk 4096), the PyTorch peers; then
# DeepSeek-V4's layer bench where S45_DSV4=1 (an H200). S45_SKIP_LLAMA=1: the MoE slices only.
stage_session45b() {
  local L8=$M/llama8b Q=$M/qwen30b8f16 V=$M/dsv2f16
  [ -n "${S45_SKIP_LLAMA:-}" ] || [ -f $L8/decoder-f16.gguf ] || ( $PDB make-model --arch llama --preset 8b --seed 7 --out $L8 --no-hf --hf-dtype bf16 --gguf-types f16 \
    > $R/make_llama8b.log 2>&1; echo $? > $R/llama8b.rc ) &
  [ -f $Q/decoder-f16.gguf ] || ( $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf \
    --hf-dtype bf16 --gguf-types f16 > $R/make_qwen.log 2>&1; echo $? > $R/qwen.rc ) &
  [ -f $V/decoder-f16.gguf ] || ( $PDB make-model --arch deepseek2 --preset deepseek-v2-lite --layers 8 --seed 13 --out $V --no-hf \
    --hf-dtype bf16 --gguf-types f16 > $R/make_dsv2.log 2>&1; echo $? > $R/dsv2.rc ) &
  make_test_models
  run itests_45b timeout 300 $P/build/tests/integration_tests --gtest_filter="${S45_ITESTS:-CudaBridge.*:CudaEngine.DefaultChunk*:CudaParity.BridgedState*}"
  wait
  local T="--tokens 8192,32768 --reps 3 --out $R/bench.jsonl" B="--modes engine,engine+recipe+frames"
  run moe_default $PDB bench prefill --model $Q/decoder-f16.gguf $T $B,full-forward --label qwen3moe-8l-f16-default
  run moe_4096 $PDB bench prefill --model $Q/decoder-f16.gguf $T --chunk 4096 $B,full-forward --label qwen3moe-8l-f16-chunk4096
  run dsv2_default $PDB bench prefill --model $V/decoder-f16.gguf $T $B --label dsv2-8l-f16-default
  run dsv2_4096 $PDB bench prefill --model $V/decoder-f16.gguf $T --chunk 4096 $B --label dsv2-8l-f16-chunk4096
  [ -n "${S45_SKIP_LLAMA:-}" ] || run llama_default $PDB bench prefill --model $L8/decoder-f16.gguf $T $B --label llama8b-f16-default
  [ -n "${S45_SKIP_LLAMA:-}" ] || run llama_8192 $PDB bench prefill --model $L8/decoder-f16.gguf $T --chunk 8192 $B --label llama8b-f16-chunk8192
  if [ "${PEERS:-1}" = 1 ]; then
    PYTHONUNBUFFERED=1 run torch_qwen python3 $DEV/torch_moe_peer.py qwen3moe 8
    PYTHONUNBUFFERED=1 run torch_dsv2 python3 $DEV/torch_moe_peer.py deepseek2 8
    [ -z "${S45_SKIP_LLAMA:-}" ] && [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_llama python3 $DEV/torch_prefill_peer.py
  fi
  if [ -n "${S45_DSV4:-}" ]; then
    make_dsv4_test_models
    run dsv4_bench_session45 env BENCH_TOKENS=32768,131072 BENCH_RUNS="${S45_RUNS:-fp4:32768 fp4:32768}" bash $DEV/dsv4_gpu.sh bench
  fi
}
# Session 46: MLA's rows from the engine under auto (DeepSeek-V2-Lite against --kv-rows decoder); a capture's last block in pieces, each copied out and hashed on its own thread as it lands
# (PDBRIDGE_TAIL_PIECES=4; measured in session 47 no faster, whole stays the default), against the block whole (=1), alternating in one call; the capture stats' tail
# part by part; the GPU suites over the pieces (CudaTailCapture: the same rows whole or in pieces; the bridges).
stage_session46() {
  local L8=$M/llama8b Q=$M/qwen30b8f16 V=$M/dsv2f16
  [ -f $Q/decoder-f16.gguf ] || ( $PDB make-model --arch qwen3moe --preset qwen3-30b-a3b --layers 8 --seed 11 --out $Q --no-hf \
    --hf-dtype bf16 --gguf-types f16 > $R/make_qwen.log 2>&1; echo $? > $R/qwen.rc ) &
  [ -f $V/decoder-f16.gguf ] || ( $PDB make-model --arch deepseek2 --preset deepseek-v2-lite --layers 8 --seed 13 --out $V --no-hf \
    --hf-dtype bf16 --gguf-types f16 > $R/make_dsv2.log 2>&1; echo $? > $R/dsv2.rc ) &
  [ -z "${S46_LLAMA:-}" ] || [ -f $L8/decoder-f16.gguf ] || ( $PDB make-model --arch llama --preset 8b --seed 7 --out $L8 --no-hf --hf-dtype bf16 \
    --gguf-types f16 > $R/make_llama8b.log 2>&1; echo $? > $R/llama8b.rc ) &
  make_test_models
  [ -n "${S46_SKIP_TESTS:-}" ] || run itests_46 timeout 420 $P/build/tests/integration_tests --gtest_filter="${S46_ITESTS:-CudaTailCapture.*:CudaBridge.*:CudaParity.*}"
  wait
  local T="--tokens 8192,32768 --reps 3 --out $R/bench.jsonl" B="--modes engine,engine+recipe+frames" S="--tokens 8192,32768 --reps 3 --modes engine+recipe+frames"
  for i in ${S46_ROUNDS:-1 2}; do
    run qwen_pieces_$i env PDBRIDGE_TAIL_PIECES=4 $PDB bench prefill --model $Q/decoder-f16.gguf $T $B --label qwen3moe-8l-f16-pieces4
    run qwen_whole_$i env PDBRIDGE_TAIL_PIECES=1 $PDB bench prefill --model $Q/decoder-f16.gguf $T $B --label qwen3moe-8l-f16-whole
  done
  run qwen_stats_pieces env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_TAIL_PIECES=4 $PDB bench prefill --model $Q/decoder-f16.gguf $S --label qwen3moe-stats-pieces4
  run qwen_stats_whole env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_TAIL_PIECES=1 $PDB bench prefill --model $Q/decoder-f16.gguf $S --label qwen3moe-stats-whole
  [ -z "${S46_SIX:-}" ] || run qwen_stats_6 env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_TAIL_PIECES=6 $PDB bench prefill --model $Q/decoder-f16.gguf $S --label qwen3moe-stats-pieces6
  for i in ${S46_DSV2_ROUNDS:-1}; do
    run dsv2_engine_rows_$i env PDBRIDGE_TAIL_PIECES=4 $PDB bench prefill --model $V/decoder-f16.gguf $T $B --kv-rows engine --label dsv2-8l-f16-engine-rows-pieces4
    run dsv2_recipe_rows_$i env PDBRIDGE_TAIL_PIECES=1 $PDB bench prefill --model $V/decoder-f16.gguf $T $B --kv-rows decoder --label dsv2-8l-f16-recipe-rows-whole
  done
  run dsv2_stats_engine env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_TAIL_PIECES=4 $PDB bench prefill --model $V/decoder-f16.gguf $S --kv-rows engine --label dsv2-stats-engine-pieces4
  run dsv2_stats_recipe env PDBRIDGE_CAPTURE_STATS=1 PDBRIDGE_TAIL_PIECES=1 $PDB bench prefill --model $V/decoder-f16.gguf $S --kv-rows decoder --label dsv2-stats-recipe-whole
  if [ -n "${S46_LLAMA:-}" ]; then
    run llama_pieces env PDBRIDGE_TAIL_PIECES=4 $PDB bench prefill --model $L8/decoder-f16.gguf $T $B --label llama8b-f16-pieces4
    run llama_whole env PDBRIDGE_TAIL_PIECES=1 $PDB bench prefill --model $L8/decoder-f16.gguf $T $B --label llama8b-f16-whole
  fi
  if [ "${PEERS:-1}" = 1 ]; then
    PYTHONUNBUFFERED=1 run torch_qwen python3 $DEV/torch_moe_peer.py qwen3moe 8
    PYTHONUNBUFFERED=1 run torch_dsv2 python3 $DEV/torch_moe_peer.py deepseek2 8
    [ -n "${S46_LLAMA:-}" ] && [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_llama python3 $DEV/torch_prefill_peer.py
  fi
}
# The f32 tensor products with k split in the server's 4,096-row chunks as the default: the twin tests and bench, the
# suites with the defaults (the tiny models' chunks now take the tensor products) and with PDBRIDGE_DSV4_F32=fp32,
# the layer bench at 32K prompts in 32K and 4K chunks, alternating with PDBRIDGE_DSV4_F32=fp32.
stage_session42c() {
  make_dsv4_test_models
  run f32_session42c env PDBRIDGE_BENCH=1 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaKernels.F32*:CudaKernels.Dsv4PreSumNorm*:CudaKernels.Dsv4CombineInThePostMix*:CudaKernels.Dsv4MixRotation*:CudaBench.Dsv4F32MixAndRouterProducts'
  run integration_dsv4_defaults timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  run integration_dsv4_fp32 env PDBRIDGE_DSV4_F32=fp32 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  local OLD=PDBRIDGE_DSV4_F32=fp32
  run dsv4_bench_session42c env BENCH_TOKENS=32768 BENCH_RUNS="${S42_RUNS:-fp4:4096 fp4:4096:$OLD fp4:32768 fp4:32768:$OLD fp4:4096 fp4:4096:$OLD}" bash $DEV/dsv4_gpu.sh bench
}
stage_session42() {
  make_dsv4_test_models
  [ -n "${S42_WITH_A:-}" ] && NCU_SKIP=1 stage_session42a
  run f32_session42 env PDBRIDGE_BENCH=1 timeout 300 $P/build/tests/unit_tests --gtest_filter='CudaKernels.F32*:CudaKernels.Dsv4PreSumNorm*:CudaKernels.Dsv4MixRotation*:CudaBench.Dsv4F32MixAndRouterProducts'
  run integration_dsv4_tf32x3 env PDBRIDGE_DSV4_F32=tf32x3 timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
  local OLD=PDBRIDGE_DSV4_F32=fp32 MIX=PDBRIDGE_DSV4_F32=mixes
  run dsv4_bench_session42 env BENCH_TOKENS=32768,131072 BENCH_RUNS="${S42_RUNS:-fp4:32768 fp4:32768:$MIX fp4:32768:$OLD fp4:32768 fp4:32768:$MIX fp4:32768:$OLD}" bash $DEV/dsv4_gpu.sh bench
  run integration_dsv4_defaults timeout 300 $P/build/tests/integration_tests --gtest_filter='Deepseek4Cuda.*:Deepseek4CudaBridge.*'
}
# The keys kernel under Nsight Compute: a 32K prompt's fifth chunk of 4,096 queries in the bench's timed pass.
stage_ncuidx() { ncu_kernel idx indexer_fp8_keys_kernel 20 CudaBench.Dsv4IndexerAtV4FlashShapes; }
# The FP4 expert products under Nsight Compute: the gate|up launch of the bench's uniform routing (its second
# launch: the first is the warm-up's), the full section set as text.
stage_ncufp4() { ncu_kernel fp4 moe_fp4_kernel 2 CudaBench.MoeFp4ProductsAtV4FlashShapes; }
# ncu_kernel NAME KERNEL_REGEX LAUNCH_SKIP TEST: one launch of a unit_tests bench's kernel, the full section set as
# text (ncu_NAME.txt), and the warps' stall reasons and the shared-memory conflicts from the raw metrics.
# NCU_BASE=demangled: KERNEL_REGEX matches the demangled name (template arguments and all).
ncu_kernel() {
  local NCU; NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { ts "no ncu here"; return 0; }
  run ncu_$1 env PDBRIDGE_BENCH=1 timeout 300 $NCU --clock-control none ${NCU_BASE:+--kernel-name-base $NCU_BASE} --kernel-name "regex:$2" --launch-skip $3 --launch-count 1 \
    --set full --import-source no -f -o $R/ncu_$1 $P/build/tests/unit_tests --gtest_filter=$4
  $NCU --import $R/ncu_$1.ncu-rep --page details > $R/ncu_$1.txt 2>&1
  # NCU_SASS=1: the kernel's SASS with each instruction's samples and stall reasons (the source page)
  [ -n "${NCU_SASS:-}" ] && $NCU --import $R/ncu_$1.ncu-rep --page source --csv --print-source sass > $R/ncu_$1_sass.csv 2>&1
  $NCU --import $R/ncu_$1.ncu-rep --page raw --csv 2>/dev/null | python3 -c "import csv,sys; r=list(csv.reader(sys.stdin)); [print(h, u, v) for h, u, v in zip(r[0], r[1], r[2]) if 'issue_stalled' in h or 'bank_conflict' in h or 'wavefronts_pipe_lsu_mem_shared' in h]" \
    > $R/ncu_$1_stalls.txt 2>&1
  rm -f $R/ncu_$1.ncu-rep
}
# Where DeepSeek-V4's sparse attention spends a tile (0.134 ms per 4,096 queries, ~3x its products' time): Nsight
# Compute on the wgmma kernel's second launch of each kind in the bench (ratio 4 at 32K: the indexer's choices; ratio 0:
# the window alone), the full section set as text; the kernel's launches in the bench are 11 per kind, ratio 4 first.
stage_ncudsv4() {
  local NCU; NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { ts "no ncu here"; return 0; }
  local skip name
  for spec in 1:r4 23:r0; do
    skip=${spec%%:*}; name=${spec##*:}
    [ -n "${NCU_ONLY:-}" ] && [ "$name" != "$NCU_ONLY" ] && continue
    run ncu_dsv4_$name env PDBRIDGE_BENCH=1 timeout 300 $NCU --clock-control none --kernel-name regex:sparse_attention_wgmma_kernel \
      --launch-skip $skip --launch-count 1 --set full --import-source no -f -o $R/ncu_dsv4_$name $P/build/tests/unit_tests \
      --gtest_filter=CudaBench.Dsv4SparseAttentionKernels
    $NCU --import $R/ncu_dsv4_$name.ncu-rep --page details > $R/ncu_dsv4_$name.txt 2>&1 && rm -f $R/ncu_dsv4_$name.ncu-rep
  done
}
# DeepSeek-V2-Lite's part of rowsgap alone (its F16 GGUF failed there before the engine's scratch counted the FFNs' widths)
stage_dsv2gap() {
  local B="--tokens 8192,32768 --reps 5 --chunk 4096 --modes engine,engine+recipe,engine+recipe+frames --out $R/bench_rowsgap.jsonl" V=$M/dsv2
  [ -f $V/decoder-f16.gguf ] || run make_dsv2 $PDB make-model --arch deepseek2 --preset deepseek-v2-lite --layers 8 --seed 13 --out $V --no-hf --hf-dtype bf16 --gguf-types f16
  run rowsgap_dsv2_recipe env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $V/decoder-f16.gguf $B --label dsv2-L8-gguf-f16-recipe
  run rowsgap_dsv2_rows env PDBRIDGE_CAPTURE_STATS=1 $PDB bench prefill --model $V/decoder-f16.gguf --kv-rows engine $B --label dsv2-L8-gguf-f16-rows
  [ "${PEERS:-1}" = 1 ] && PYTHONUNBUFFERED=1 run torch_dsv2 python3 $DEV/torch_moe_peer.py deepseek2 8
}
# The CUDA backend's row path after a change to it: the bridge end to end and the bridged state against the decoder's.
stage_rowpath() {
  make_test_models
  run integration_rowpath timeout 400 $P/build/tests/integration_tests --gtest_filter='CudaBridge.*:CudaParity.*:GpuRecipe*'
}
# A short re-check of the engines after a change that the full stages already covered: the test models, the CUDA
# engine's tests, tensor parallel on one GPU and DeepSeek-V4's GPU engine and bridge.
stage_recheck() {
  make_test_models  # the whole set: CudaEngine.* reads llama-tiny-h16 and the others too
  run recheck_cuda timeout 400 $P/build/tests/integration_tests --gtest_filter='CudaEngine.*:CudaParity.*:CudaTensorParallel.RanksOnOneGpu*:Deepseek4Cuda.*:Deepseek4CudaBridge.*'
}
# Issue 5's scale runs and the million-token prompt: scripts/device/scale.sh (one call of their own).
# Issue 5's link emulation on the device (needs ip/tc and CAP_NET_ADMIN there): 10 and 1 Gbit.
stage_link() {
  PDBRIDGE_NETNS_OUT=$R/link10.jsonl run link10 bash $REPO/scripts/netns_link.sh 10 300000 2 cuda
  PDBRIDGE_NETNS_OUT=$R/link1.jsonl run link1 bash $REPO/scripts/netns_link.sh 1 100000 2 cuda
}
has dsv4gguf && make_dsv4_flash3
# The stages run in the order they are named (all: tests, bench, train).
if [ "$STAGES" = all ]; then ORDERED="tests bench"; else ORDERED=${STAGES//,/ }; fi
for stage in $ORDERED; do
  case $stage in
    tests|bench|models|waitmodels|attn|cudnn|cudnnmoe|moecudnn|llamapeer|ab|qwen|moe|fp8|scale|pace|m1|demo|link|gpudec|golden|dsv4ab|framesab|recheck|gguf|ggufmoe|ggufab|kvrows|recheck35|rowpath|moe48|numerics|dsv4gguf|cudaparity|enginecheck|gapcheck|moegap|moegap2|moegap3|session30|rowsgap|dsv2gap|session32|session32b|session33|session34|session35|session35b|session35c|session35d|session35e|session36|session36b|session36c|session38|session38b|session38c|session38d|session39|session39b|session39c|session40|session40b|session40c|session40d|session40e|session40f|session41|session41c|session42|session42a|session42b|session42c|session43|session44|session45|session45b|session46|ncudsv4|ncufp4|ncuidx) stage_$stage ;;
    train) ;;  # started above, in the background
    *) ts "unknown stage $stage" ;;
  esac
done
if [ -f $DEV/train_needle.py ] && [ "$STAGES" = train ]; then while [ ! -e $R/train.rc ]; do sleep 5; done; fi
ts ALLDONE
touch $R/$DONE_MARK
