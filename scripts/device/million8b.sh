#!/bin/bash
# Issue 5's million-token prompt on the 8B shape (Llama-3.1-8B, random weights): the H200 prefill with the
# engine's fp8 K/V (`--kv-dtype fp8`: bf16 K/V for 1M tokens would take 137 GB of the GPU's 141), llama-server on
# the device's CPU with a q4_0 cache (~40 GB of RAM at 1.1M), slot files on /dev/shm. Needs the pipeline's `attn`
# stage model (declared context 1.1M, Q4_0 GGUF). One bridged cold prompt of CHARS characters (~4.05 per token: 246,360 tokens for 996,000 in the 2026-11-30 runs),
# TTFT only (--stop-after 4); the attention alone is ~10.5 minutes at the bf16 kernel's ~420 TFLOP/s (the fused fp8 kernel: ~18), so run it under drive.sh (setsid)
# as pipeline stage `m1`. Usage: bash .dev/million8b.sh [CHARS=4150000]
CHARS=${1:-4150000}
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1
# HF, G, CTX, THREADS and PREFILL_ARGS stand in for the 8B model and the GPU: the same script runs a miniature
# of the leg on any machine (e.g. HF=models/needle-llama G=build/models/needle/decoder-q4_0.gguf CTX=30000 THREADS=2
# PREFILL_ARGS="--device cpu --cpu-fast" bash scripts/device/million8b.sh 20000), which checks its plumbing first.
HF=${HF:-$M/llama8b/hf}; G=${G:-$M/llama8b/decoder-q4_0.gguf}; CTX=${CTX:-1100000}; THREADS=${THREADS:-16}
PREFILL_ARGS=${PREFILL_ARGS:---device cuda --kv-dtype fp8 --chunk 8192}
[ -f $G ] || { echo "million8b: no decoder GGUF at $G (the models stage makes the 8B one)"; exit 1; }
[ "$CTX" -le 131072 ] || [ -e $(dirname $G)/CTX1100000 ] || { echo "million8b: $G does not declare a context of $CTX (models stage)"; exit 1; }
# The slot file (~38 GB at 1M tokens, q4_0 cache) goes to RAM where /dev/shm has room for it, else to disk.
SLOTS=/dev/shm/m1
[ $(df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9) -lt $(( CTX / 26000 + 2 )) ] && SLOTS=$M/m1slots
echo "million8b: slot files in $SLOTS"
rm -rf /dev/shm/slots* $SLOTS && mkdir -p $SLOTS
$PDB decoder --gguf $G --port 8380 --slot-dir $SLOTS --ctx $CTX --parallel 1 --cache-type q4_0 --threads $THREADS > $R/m1_8b_decoder.log 2>&1 & D=$!
$PDB prefill --model $HF --recipe $G $PREFILL_ARGS --port 8390 > $R/m1_8b_prefill.log 2>&1 & PF=$!
up localhost:8380/health $D && up localhost:8390/health $PF || { echo "million8b: the stack did not come up"; kill $D $PF; exit 1; }
$PDB front --decoder http://127.0.0.1:8380 --decoder-gguf $G --slot-dir $SLOTS --prefill http://127.0.0.1:8390 --port 8300 --bridge-timeout 1200 \
  > $R/m1_8b_front.log 2>&1 & F=$!
up localhost:8300/health $F || { echo "million8b: the front door did not come up"; kill $D $PF $F; exit 1; }
( while kill -0 $PF 2>/dev/null; do echo "$(date +%s.%N) $(awk '/VmRSS/{print $2}' /proc/$PF/status) $(awk '/VmRSS/{print $2}' /proc/$F/status 2>/dev/null)"; sleep 1; done ) > $R/m1_8b_rss.txt &
command -v nvidia-smi > /dev/null && ( while kill -0 $PF 2>/dev/null; do nvidia-smi --query-gpu=memory.used --format=csv,noheader; sleep 10; done ) > $R/m1_8b_gpumem.txt 2>&1 &
timeout 1800 $PDB bench cold --front http://127.0.0.1:8300 --skip-native --chars $CHARS --runs 1 --max-tokens 300 --stop-after 4 --out $R/m1_8b.jsonl \
  > $R/m1_8b_bench.log 2>&1 & B=$!
# A bridge that does not complete leaves the prompt to the CPU decoder (hours at 1M tokens): stop as soon as the
# front door logs any other verdict.
while kill -0 $B 2>/dev/null; do
  v=$(grep -o "verdict '[^']*'" $R/m1_8b_front.log | head -1)
  if [ -n "$v" ] && [ "$v" != "verdict 'complete'" ]; then echo "million8b: $v; stopping the native fallback"; kill $B; break; fi
  sleep 5
done
wait $B; echo "million8b: bench rc=$?"; tail -4 $R/m1_8b_bench.log
grep -H VmHWM /proc/$PF/status /proc/$F/status > $R/m1_8b_hwm.txt 2>&1
kill $F $PF $D 2>/dev/null; wait $F $PF $D 2>/dev/null
rm -rf $SLOTS  # ~38 GB of RAM or disk: the stages after this one need it
