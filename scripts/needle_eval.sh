#!/usr/bin/env bash
# Needle retrieval of the shipped model (issue 6), natively and through the bridge, with the cold-prompt
# protocol of `pdbridge bench cold` (fresh seed per run and leg). Starts its own stack on free ports
# (llama-server with the model's Q4_0 GGUF, the prefill engine, the front door) and stops it on exit.
# Usage: scripts/needle_eval.sh CHARS[,CHARS...] RUNS OUT.jsonl [cpu|cuda] [more bench cold options]
set -euo pipefail
CHARS=${1:?chars}; RUNS=${2:?runs}; OUTF=${3:?out.jsonl}; DEVICE=${4:-cpu}; shift 4 || shift $#
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/build/pdbridge"; HF="$ROOT/models/needle-llama"; G="$ROOT/build/models/needle/decoder-q4_0.gguf"
[[ -x $BIN && -f $G ]] || { echo "build first: make"; exit 2; }
WORK=$(mktemp -d /tmp/pdbridge-needle.XXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ok() { for _ in $(seq 1 900); do curl -sf "$1" >/dev/null 2>&1 && return 0; kill -0 "$2" 2>/dev/null || { tail -20 "$3"; return 1; }; sleep 0.2; done; return 1; }
MAXC=$(tr ',' '\n' <<<"$CHARS" | sort -n | tail -1)
CTX=$(( MAXC + 4096 ))
D=$(free_port); P=$(free_port); F=$(free_port)
mkdir -p "$WORK/slots"
"$BIN" decoder --gguf "$G" --port "$D" --slot-dir "$WORK/slots" --ctx $(( CTX * 2 )) --parallel 2 --cache-type f16 >"$WORK/decoder.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$D/health" "${PIDS[-1]}" "$WORK/decoder.log"
"$BIN" prefill --model "$HF" --recipe "$G" --port "$P" --device "$DEVICE" $([[ $DEVICE == cpu ]] && echo --cpu-fast) >"$WORK/prefill.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$P/health" "${PIDS[-1]}" "$WORK/prefill.log"
"$BIN" front --decoder "http://127.0.0.1:$D" --decoder-gguf "$G" --slot-dir "$WORK/slots" --prefill "http://127.0.0.1:$P" \
  --port "$F" --min-tokens 1024 >"$WORK/front.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$F/health" "${PIDS[-1]}" "$WORK/front.log"
"$BIN" bench cold --front "http://127.0.0.1:$F" --native-url "http://127.0.0.1:$D" --chars "$CHARS" --runs "$RUNS" \
  --max-tokens 32 --out "$OUTF" "$@"
