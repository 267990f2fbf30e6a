#!/bin/bash
# The GPU run behind docs/RESULTS.md (issue #4): kernel and engine tests, the CUDA bridge end to end
# against llama-server (on the device's CPU), pdbridge bench prefill on the 8b presets, and the peers
# in the same run: PyTorch (the device's torch/transformers, sdpa, bf16) and llama.cpp CUDA built
# here from the same npm source bundle. Every stage logs to /tmp/res and the pipeline continues
# past a failed stage. Usage: pipeline.sh <carried .dev folder> [all|tests|bench|train|scale]
DEV=$1; STAGES=${2:-all}; REPO=$(cd $DEV/.. && pwd)
# STAGES: all, or a comma-separated list of tests,bench,train,fp8,demo,scale,needle1m,link
has() { [ "$STAGES" = all ] && [ "$1" != fp8 ] && [ "$1" != scale ] && [ "$1" != needle1m ] && [ "$1" != link ] && [ "$1" != demo ] && return 0; [[ ",$STAGES," == *",$1,"* ]]; }
R=/tmp/res; M=/tmp/m; P=/tmp/pdb; LC=/tmp/llama-cuda
mkdir -p $R $M $P $LC
T0=$(date +%s)
ts() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*"; }
run() { local name=$1; shift; ts "start $name"; "$@" > $R/$name.log 2>&1; local rc=$?; ts "end $name rc=$rc"; tail -n 25 $R/$name.log | sed "s/^/  $name| /"; return $rc; }
{ nvidia-smi; lscpu | head -20; free -g; df -h /tmp; } > $R/sysinfo.txt 2>&1
tar -xJf $DEV/bundle.tar.xz -C $P || { ts "bundle extract failed"; touch $R/DONE; exit 1; }
# the tests find the build where it was configured
mkdir -p /work/main && ln -sfn $P/build /work/main/build
[ -e $REPO/build ] || ln -sfn $P/build $REPO/build
export LD_LIBRARY_PATH=$P/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
PDB=$P/build/pdbridge
run device_info $PDB device-info || { ts "pdbridge does not run here"; touch $R/DONE; exit 1; }
# llama.cpp CUDA (peer), in the background
has bench && ( tar -xJf $DEV/llama-src.tar.xz -C $LC && cd $LC && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
   -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
   -DLLAMA_BUILD_SERVER=OFF -DGGML_CUDA_NCCL=OFF > $R/llama_cmake.log 2>&1 && nice -n 10 cmake --build build -j 10 --target llama-bench > $R/llama_build.log 2>&1
  echo $? > $R/llama_build.rc ) &
# the embedded default model (issue #6): trains while the tests and model generation use the CPU
if [ -f $DEV/train_needle.py ] && has train; then
  ( PYTHONUNBUFFERED=1 python3 $DEV/train_needle.py /tmp/needle --minutes ${TRAIN_MINUTES:-5} > $R/train.log 2>&1; echo $? > $R/train.rc ) &
fi
if has tests; then
  run unit_cuda $P/build/tests/unit_tests --gtest_filter='Cuda*'
  TM=$P/build/test-models
  run test_models bash -c "set -e; $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0,q4_0; \
    $PDB make-model --arch llama --preset tiny --seed 1 --out $TM/llama-tiny-h16 --hf-dtype f16 --gguf-types f16; \
    $PDB make-model --arch qwen3 --preset tiny --seed 2 --out $TM/qwen3-tiny --hf-dtype f32 --gguf-types f32,f16,q8_0"
  run integration_cuda $P/build/tests/integration_tests --gtest_filter='GpuRecipe*:CudaEngine*:CudaBridge*:CudaParity*'
fi
if has bench; then
  run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16
  if [ -f $DEV/train_needle.py ]; then ts "waiting for training"; while [ ! -e $R/train.rc ]; do sleep 5; done; ts "training rc=$(cat $R/train.rc)"; tail -n 12 $R/train.log; fi
  [ -f $DEV/torch_prefill_peer.py ] && PYTHONUNBUFFERED=1 run torch_peer python3 $DEV/torch_prefill_peer.py
  run bench_llama8b $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b --out $R/bench.jsonl
  PDBRIDGE_ATTN_WARPS=4 run bench_llama8b_attn4 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 32768 --reps 2 --chunk 4096 --label llama8b-attn4 --out $R/bench.jsonl
  run bench_llama8b_128k $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 131072 --reps 1 --chunk 8192 --label llama8b --out $R/bench.jsonl
  ts "waiting for the llama.cpp CUDA build"; while [ ! -e $R/llama_build.rc ]; do sleep 5; done; ts "llama build rc=$(cat $R/llama_build.rc)"
  run llama_bench $LC/build/bin/llama-bench -m $M/llama8b/decoder-f16.gguf -ngl 99 -fa 1 -b 4096 -ub 2048 -p 8192,32768 -n 0 -r 2 -o md
  rm -rf $M/llama8b/hf
  run make_qwen8b $PDB make-model --arch qwen3 --preset 8b --seed 8 --out $M/qwen8b --hf-dtype bf16 --gguf-types f16
  run bench_qwen8b $PDB bench prefill --model $M/qwen8b/hf --recipe $M/qwen8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label qwen3-8b --out $R/bench.jsonl
fi
# Issue 4's FP8 row: the same Llama-3.1-8B-shape master weights as bf16 and as block-FP8 (128x128 e4m3 +
# scales), bench prefill on both in the same run (the FP8 engine runs block-scaled FP8 products when its
# probe finds the scale order; the bench's "weights" field says which path ran). Also the GPU-encoded
# q8_0 cache rows against f16 ones.
if has fp8; then
  [ -f $M/llama8b/decoder-f16.gguf ] || run make_llama8b $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types f16
  run make_llama8b_fp8 $PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b_fp8 --hf-dtype fp8 --gguf-types ""
  run bench_fp8 $PDB bench prefill --model $M/llama8b_fp8/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-fp8 --out $R/bench.jsonl
  run bench_bf16 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192,32768 --reps 3 --chunk 4096 --label llama8b-bf16 --out $R/bench.jsonl
  run bench_bf16_q8 $PDB bench prefill --model $M/llama8b/hf --recipe $M/llama8b/decoder-f16.gguf --tokens 8192 --reps 3 --chunk 4096 --cache-type q8_0 --label llama8b-bf16-q8cache --out $R/bench.jsonl
fi
# Issue 6 on the GPU: the demo with CUDA prefill (the bundle's prebuilt binaries stand in for `make`,
# which needs apt and cannot run there), on a 24K-character haystack.
has demo && run demo env PDBRIDGE_DEMO_CHARS=24000 bash $REPO/scripts/demo.sh
# Issue 5's scale runs: H200 prefill, llama-server on the device's CPU (8B Q4_0, q8_0 cache, 16 threads) as
# the decoder; bridged TTFT at ~8K/32K/128K tokens (3 fresh seeds each), ~256K (1 seed), native at ~8K;
# VmRSS of the prefill server and the front door sampled every 0.5 s (windows per size in scale_windows.txt).
if has scale; then
  run make_llama8b_q4 bash -c "$PDB make-model --arch llama --preset 8b --seed 7 --out $M/llama8b --hf-dtype bf16 --gguf-types q4_0 && rm -f $M/llama8b/decoder-f16.gguf $M/llama8b/decoder-f32.gguf; ls -la $M/llama8b; df -h /tmp"
  G=$M/llama8b/decoder-q4_0.gguf; mkdir -p /tmp/slots
  $PDB decoder --gguf $G --port 8080 --slot-dir /tmp/slots --ctx 272000 --parallel 1 --cache-type q8_0 --threads 16 > $R/scale_decoder.log 2>&1 &
  DEC=$!
  $PDB prefill --model $M/llama8b/hf --recipe $G --device cuda --chunk 4096 --port 8090 > $R/scale_prefill.log 2>&1 &
  PRE=$!
  for _ in $(seq 1 900); do curl -sf localhost:8080/health > /dev/null && curl -sf localhost:8090/health > /dev/null && break; sleep 1; done
  $PDB front --decoder http://127.0.0.1:8080 --decoder-gguf $G --slot-dir /tmp/slots --prefill http://127.0.0.1:8090 --port 8000 > $R/scale_front.log 2>&1 &
  FR=$!
  for _ in $(seq 1 300); do curl -sf localhost:8000/health > /dev/null && break; sleep 1; done
  ( while kill -0 $PRE 2>/dev/null; do echo "$(date +%s.%N) $(awk '/VmRSS/{print $2}' /proc/$PRE/status) $(awk '/VmRSS/{print $2}' /proc/$FR/status 2>/dev/null)"; sleep 0.5; done ) > $R/scale_rss.txt &
  window() { local label=$1; shift; local t0=$(date +%s.%N); run "scale_$label" "$@"; echo "$label $t0 $(date +%s.%N)" >> $R/scale_windows.txt; }
  window b8k $PDB bench cold --front http://127.0.0.1:8000 --skip-native --chars 36000 --runs 3 --max-tokens 300 --out $R/scale.jsonl
  window b32k $PDB bench cold --front http://127.0.0.1:8000 --skip-native --chars 143000 --runs 3 --max-tokens 300 --out $R/scale.jsonl
  window n8k $PDB bench cold --front http://127.0.0.1:8000 --native-url http://127.0.0.1:8080 --skip-bridged --chars 36000 --runs 1 --max-tokens 300 --out $R/scale.jsonl
  window b128k $PDB bench cold --front http://127.0.0.1:8000 --skip-native --chars 573000 --runs 3 --max-tokens 300 --out $R/scale.jsonl
  window b256k $PDB bench cold --front http://127.0.0.1:8000 --skip-native --chars 1146000 --runs 1 --max-tokens 300 --out $R/scale.jsonl
  grep -H VmHWM /proc/$PRE/status /proc/$FR/status > $R/scale_hwm.txt 2>&1
  kill $FR $PRE $DEC 2>/dev/null; sleep 2
fi
# Issue 5's million-token prompt, on the shipped model (an 8B cache for 1M tokens is ~74 GB even as q4_0:
# more than this machine's 64 GB of disk): CUDA prefill, decoder with a 1.1M context, bridged only.
if has needle1m; then
  NG=$REPO/build/models/needle/decoder-q4_0.gguf; mkdir -p /tmp/slots1m
  $PDB decoder --gguf $NG --port 8180 --slot-dir /tmp/slots1m --ctx 1100000 --parallel 1 --cache-type f16 --threads 16 > $R/m1_decoder.log 2>&1 &
  DEC=$!
  $PDB prefill --model $REPO/models/needle-llama --recipe $NG --device cuda --chunk 8192 --port 8190 > $R/m1_prefill.log 2>&1 &
  PRE=$!
  for _ in $(seq 1 300); do curl -sf localhost:8180/health > /dev/null && curl -sf localhost:8190/health > /dev/null && break; sleep 1; done
  $PDB front --decoder http://127.0.0.1:8180 --decoder-gguf $NG --slot-dir /tmp/slots1m --prefill http://127.0.0.1:8190 --port 8100 > $R/m1_front.log 2>&1 &
  FR=$!
  for _ in $(seq 1 300); do curl -sf localhost:8100/health > /dev/null && break; sleep 1; done
  run needle1m $PDB bench cold --front http://127.0.0.1:8100 --skip-native --chars 1000000 --runs 1 --max-tokens 32 --out $R/needle1m.jsonl
  grep -H VmHWM /proc/$PRE/status /proc/$FR/status > $R/needle1m_hwm.txt 2>&1
  kill $FR $PRE $DEC 2>/dev/null; sleep 2
fi
# Issue 5's link emulation on the device (needs ip/tc and CAP_NET_ADMIN there): 10 and 1 Gbit.
if has link; then
  PDBRIDGE_NETNS_OUT=$R/link10.jsonl run link10 bash $REPO/scripts/netns_link.sh 10 300000 2 cuda
  PDBRIDGE_NETNS_OUT=$R/link1.jsonl run link1 bash $REPO/scripts/netns_link.sh 1 100000 2 cuda
fi
if [ -f $DEV/train_needle.py ] && [ "$STAGES" = train ]; then while [ ! -e $R/train.rc ]; do sleep 5; done; fi
ts ALLDONE
touch $R/DONE
