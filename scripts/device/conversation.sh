#!/bin/bash
# Issue 20's measurement: a TURNS-turn conversation on the 8B stack (Llama-3.1-8B shape, random weights; the
# H200 prefill, llama-server on the device's CPU with an f16 cache, slot files on /dev/shm), +TAIL tokens a turn,
# bridged tail-only (the default front door) and whole-prompt (`--no-tail`), each with fresh random tokens, then the
# decoder's own prompt rate on a short cold prompt (native TTFT per turn is that rate's extrapolation: a lower
# bound, the attention grows with the context). Usage: bash .dev/conversation.sh [TURNS=10] [TAIL=8192]
# HF, G, CTX, THREADS, PREFILL_ARGS and VOCAB stand in for the 8B model and the GPU (a miniature on any machine:
# HF=build/test-models/llama-tiny/hf G=build/test-models/llama-tiny/decoder-f16.gguf CTX=20000 THREADS=2
# PREFILL_ARGS="--device cpu" VOCAB=128000 bash scripts/device/conversation.sh 4 1500).
TURNS=${1:-10}; TAIL=${2:-8192}
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1
HF=${HF:-$M/llama8b/hf}; G=${G:-$M/llama8b/decoder-f16.gguf}; CTX=${CTX:-$(( TURNS * (TAIL + 8) + 1024 ))}; THREADS=${THREADS:-16}
PREFILL_ARGS=${PREFILL_ARGS:---device cuda --chunk 8192 --prefix-cache-gb 24}; VOCAB=${VOCAB:-128000}
[ -f $G ] || { echo "conversation: no decoder GGUF at $G"; exit 1; }
SLOTS=/dev/shm/conv; rm -rf $SLOTS && mkdir -p $SLOTS
OUT=$R/conversation.jsonl; : > $OUT
$PDB decoder --gguf $G --port 8480 --slot-dir $SLOTS --ctx $CTX --parallel 1 --cache-type f16 --threads $THREADS > $R/conv_decoder.log 2>&1 & D=$!
$PDB prefill --model $HF --recipe $G $PREFILL_ARGS --port 8490 > $R/conv_prefill.log 2>&1 & PF=$!
up localhost:8480/health $D && up localhost:8490/health $PF || { echo "conversation: the stack did not come up"; kill $D $PF; exit 1; }
front() {  # front [extra args]: a front door on 8400 for one session
  $PDB front --decoder http://127.0.0.1:8480 --decoder-gguf $G --slot-dir $SLOTS --prefill http://127.0.0.1:8490 --port 8400 \
    --bridge-timeout 1200 --min-tokens 1024 --min-tail ${MIN_TAIL:-2048} "$@" > $R/conv_front_$#.log 2>&1 & F=$!
  up localhost:8400/health $F || { echo "conversation: the front door did not come up"; return 1; }
  while ! grep -q "layout learned at startup\|startup layout probe" $R/conv_front_$#.log; do sleep 0.5; done
}
# MODES: the sessions to run (tail: the default front door, the prefix from its kept file of the previous turn;
# pwrite: tail with the state file written by pwrite instead of through its mapping (PDBRIDGE_STATE_PWRITE=1);
# slot: tail-only with the prefix from the decoder's saved slot, --keep-states-gb 0; whole: --no-tail)
for mode in ${MODES:-tail whole}; do
  case $mode in tail) front ;; pwrite) export PDBRIDGE_STATE_PWRITE=1; front; unset PDBRIDGE_STATE_PWRITE ;;
    slot) front --keep-states-gb 0 ;; *) front --no-tail ;; esac && python3 $DEV/conversation.py http://127.0.0.1:8400 $mode $TURNS $TAIL $RANDOM$RANDOM $VOCAB $OUT
  kill $F; wait $F 2>/dev/null
done
curl -s localhost:8490/metrics | grep -E "^pdbridge_prefill_(prefix|computed|tail|wire)" > $R/conv_prefill_metrics.txt
# the decoder's own prompt rate, a cold 2,048-token prompt of fresh tokens
python3 - $VOCAB > $R/conv_native.json <<'PY'
import json, random, sys, urllib.request
vocab = int(sys.argv[1]); rng = random.Random()
p = [rng.randrange(1000, vocab - 1000) for _ in range(2048)]
req = urllib.request.Request("http://127.0.0.1:8480/completion", json.dumps({"prompt": p, "n_predict": 1, "cache_prompt": False}).encode(), {"Content-Type": "application/json"})
print(json.dumps(json.loads(urllib.request.urlopen(req, timeout=3600).read())["timings"]))
PY
cat $R/conv_native.json
kill $D $PF; wait 2>/dev/null
