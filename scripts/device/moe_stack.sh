#!/bin/bash
# Issue 18's bridged TTFT at the real Qwen3-30B-A3B / DeepSeek-V2-Lite layer shapes (MOE_LAYERS / MLA_LAYERS
# layers: the 64 GB disk holds one checkpoint + GGUF at this size), by the 8B stack's protocol (scale.sh): H200
# prefill (`pdbridge prefill --device cuda`), llama-server on the device's CPU (F16 weights, f16 cache,
# 16 threads), `bench cold` with --stop-after 16: native ~4K tokens (a CPU decoder's attention makes a native
# 32K take far longer than a call), bridged ~4K and ~32K with fresh seeds. The JSONL rows carry each bridge's
# verdict and wire bytes; the slot file's size gives the decoder's cache bytes per token. Then llama.cpp's own
# convert_hf_to_gguf.py on the tiny presets against make-model's GGUFs (convert_compare.py).
# Usage (device): bash .dev/moe_stack.sh   [DEVICE=cpu MODELS_ONLY=... for a local dry run]
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1
T0=$(date +%s)
ts() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a $R/moe_stack.log; }
save() { tar czf $OUT/res.tgz -C /tmp res 2>/dev/null; }
DEVICE=${DEVICE:-cuda}
run_stack() {  # arch preset layers tag
  local arch=$1 preset=$2 layers=$3 tag=$4 dir=$M/$4
  [ -f $dir/decoder-f16.gguf ] || $PDB make-model --arch $arch --preset $preset --layers $layers --seed 21 --out $dir --hf-dtype bf16 \
    --gguf-types f16 > $R/stack_make_$tag.log 2>&1 || { ts "make-model $tag failed"; tail -3 $R/stack_make_$tag.log; return 1; }
  local G=$dir/decoder-f16.gguf S=/dev/shm/slots_$tag
  mkdir -p $S
  $PDB decoder --gguf $G --port 8280 --slot-dir $S --ctx 40000 --parallel 1 --cache-type f16 --threads 16 > $R/stack_decoder_$tag.log 2>&1 & local D=$!
  $PDB prefill --model $dir/hf --recipe $G --device $DEVICE --chunk 4096 --port 8290 > $R/stack_prefill_$tag.log 2>&1 & local P=$!
  up localhost:8280/health $D && up localhost:8290/health $P || { ts "$tag: decoder or prefill did not come up"; tail -5 $R/stack_decoder_$tag.log $R/stack_prefill_$tag.log; kill $D $P; return 1; }
  $PDB front --decoder http://127.0.0.1:8280 --decoder-gguf $G --slot-dir $S --prefill http://127.0.0.1:8290 --port 8200 > $R/stack_front_$tag.log 2>&1 & local F=$!
  up localhost:8200/health $F || { ts "$tag: front did not come up"; kill $D $P $F; return 1; }
  ts "$tag stack up"
  local B="$PDB bench cold --front http://127.0.0.1:8200 --max-tokens 64 --stop-after 16 --out $R/stack_$tag.jsonl"
  ts "$tag native ~4K"; timeout ${NATIVE_LIMIT:-150} $B --native-url http://127.0.0.1:8280 --skip-bridged --chars ${NATIVE_CHARS:-15500} --runs 1 > $R/stack_${tag}_n4k.log 2>&1; tail -n 2 $R/stack_${tag}_n4k.log
  ts "$tag bridged ~4K"; timeout 90 $B --skip-native --chars ${NATIVE_CHARS:-15500} --runs 2 > $R/stack_${tag}_b4k.log 2>&1; tail -n 3 $R/stack_${tag}_b4k.log
  ts "$tag bridged ~32K"; timeout 120 $B --skip-native --chars ${LONG_CHARS:-125000} --runs 2 > $R/stack_${tag}_b32k.log 2>&1; tail -n 3 $R/stack_${tag}_b32k.log
  curl -s -X POST localhost:8280/slots/0?action=save -H 'Content-Type: application/json' -d '{"filename":"after.bin"}' > $R/stack_${tag}_save.json
  ls -l $S >> $R/stack_${tag}_slots.txt; curl -s localhost:8200/metrics | grep -E "^pdbridge_(bridge|wire)" | head -20 > $R/stack_${tag}_metrics.txt
  kill $F $P $D 2>/dev/null; wait $F $P $D 2>/dev/null
  rm -rf $S; [ -n "${KEEP:-}" ] || rm -rf $dir
  ts "$tag done"; save
}
if [ -f $DEV/convert_compare.py ]; then
  SRC=${LLAMA_SRC:-$P/llama-src}
  [ -f $SRC/convert_hf_to_gguf.py ] || { mkdir -p $SRC && tar -xJf $DEV/llama-src.tar.xz -C $SRC; }
  TM=$M/convert-models
  $PDB make-model --arch qwen3moe --preset tiny --seed 3 --out $TM/qwen3moe-tiny --hf-dtype f32 --gguf-types f32 > $R/convert_make.log 2>&1
  $PDB make-model --arch deepseek2 --preset tiny --seed 4 --out $TM/deepseek2-tiny --hf-dtype f32 --gguf-types f32 >> $R/convert_make.log 2>&1
  for m in qwen3moe-tiny deepseek2-tiny; do
    ts "convert_hf_to_gguf.py $m"; timeout 120 python3 $DEV/convert_compare.py $SRC $TM/$m/hf $TM/$m/decoder-f32.gguf /tmp/conv_$m.gguf > $R/convert_$m.log 2>&1
    grep CONVERT-COMPARE $R/convert_$m.log || tail -n 8 $R/convert_$m.log
  done
fi
run_stack deepseek2 ${MLA_PRESET:-deepseek-v2-lite} ${MLA_LAYERS:-8} dsv2s
run_stack qwen3moe ${MOE_PRESET:-qwen3-30b-a3b} ${MOE_LAYERS:-8} q3moes
ts ALLDONE; save
