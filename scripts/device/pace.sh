#!/bin/bash
# Issue 5's wire rate vs link rate on the device, whose image has no `ip`/`tc` (so no netns/veth link):
# the prefill server's sender-side pacing (--link-gbps) at 10 and 1 Gbit/s, CUDA prefill of the shipped
# model (converted with a declared 1.1M context so long prompts fit a slot), llama-server on the CPU,
# bridged cold prompts of CHARS characters. CACHE (f16) is the decoder's cache type, RATES ("10 1") the links.
# PREFILL_ARGS (--device cuda --chunk 8192) lets a miniature run anywhere: PREFILL_ARGS="--device cpu --cpu-fast".
# Usage: [CACHE=f32] [RATES="10 1"] bash .dev/pace.sh [CHARS=200000]
CHARS=${1:-200000}; CACHE=${CACHE:-f16}
DEV=$(cd "$(dirname "$0")" && pwd); REPO=$(cd $DEV/.. && pwd)
[ -d $REPO/models ] || REPO=$(cd $DEV/../.. && pwd)  # run from scripts/device/ (a local miniature) rather than .dev/
source $DEV/env.sh || exit 1
mkdir -p /tmp/needle1m && cp $REPO/models/needle-llama/* /tmp/needle1m/
sed -i 's/"max_position_embeddings": [0-9]*/"max_position_embeddings": 1100000/' /tmp/needle1m/config.json
$PDB convert --hf /tmp/needle1m --out /tmp/needle1m/gguf --types q4_0 > $R/pace_convert.log 2>&1
G=/tmp/needle1m/gguf/decoder-q4_0.gguf; mkdir -p /dev/shm/pace
$PDB decoder --gguf $G --port 8280 --slot-dir /dev/shm/pace --ctx $((CHARS + 50000)) --parallel 1 --cache-type $CACHE --threads 16 > $R/pace_decoder.log 2>&1 & D=$!
up localhost:8280/health $D || { echo "pace: the decoder did not come up"; exit 1; }
for RATE in ${RATES:-10 1}; do
  $PDB prefill --model /tmp/needle1m --recipe $G ${PREFILL_ARGS:---device cuda --chunk 8192} --port 8290 --link-gbps $RATE > $R/pace_prefill_$RATE.log 2>&1 & PF=$!
  up localhost:8290/health $PF || { echo "pace: the prefill server did not come up"; kill $D; exit 1; }
  $PDB front --decoder http://127.0.0.1:8280 --decoder-gguf $G --slot-dir /dev/shm/pace --prefill http://127.0.0.1:8290 --port 8200 > $R/pace_front_$RATE.log 2>&1 & F=$!
  up localhost:8200/health $F || { echo "pace: the front door did not come up"; kill $D $PF; exit 1; }
  echo "== link $RATE Gbit/s (sender pacing), $CHARS chars, $CACHE cache"
  timeout 100 $PDB bench cold --front http://127.0.0.1:8200 --skip-native --chars $CHARS --runs 2 --max-tokens 300 --stop-after 8 --out $R/pace_${RATE}_$CACHE.jsonl 2>&1 | tail -4
  python3 -c "
import json
for l in open('$R/pace_${RATE}_$CACHE.jsonl'):
    r=json.loads(l); b=r.get('bytes',0); tw=r.get('t_wire_s',0); te=r.get('t_engine_s',0)
    print('tokens', r['prompt_tokens'], r['verdict'], 'cached', r['cached_tokens'], 'bytes', b, 'engine_s', te, 'wire_s', tw, 'wire Gbit/s %.3f' % (b*8/max(tw,1e-9)/1e9), ('of link %.0f%%' % (100*b*8/max(tw,1e-9)/1e9/$RATE) if $RATE > 0 else 'unpaced'), 'ttft', r['ttft_s'])
"
  kill $F $PF; wait $F $PF 2>/dev/null
  cp $R/pace_* $OUT/ 2>/dev/null
done
kill $D
