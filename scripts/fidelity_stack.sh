#!/usr/bin/env bash
# One decoder's fidelity, end to end (issue 17): starts llama-server (any build, any backend flags), the
# prefill server and the front door on free ports; records the guard's verdict on that decoder (doctor
# --fidelity-json), then, where the guard lets bridges through, cold needle prompts native vs bridged
# (bench cold, fresh seeds) and the output parity bridged vs the same decoder's own prefill (eval
# parity: KL, top-1, greedy match). Stops everything on exit. Runs anywhere (CPU or CUDA prefill).
# Usage: scripts/fidelity_stack.sh LABEL OUTDIR GGUF HF_DIR PREFILL_DEVICE CACHE_TYPE [options] [-- llama-server flags]
#   --server-bin BIN    llama-server to run (default: $SERVER_BIN, else the pinned CPU build)
#   --cold CHARS RUNS   bench cold sizes and runs per size (default: 8000,16000 2; 0 0 skips)
#   --skip-native       bench cold's bridged leg only (a slow native decoder)
#   --parity N CHARS    eval parity prompts and length (default: 8 8000; 0 skips); PARITY_SEED=S: its first seed (two runs on the same fresh prompts)
#   --ctx N             tokens per decoder slot (default: 20000)
#   --decoder-cpu       hide CUDA devices from the decoder alone (a CUDA-built llama-server on the CPU; also DECODER_CPU=1)
#   --prefill-arg ARG   one more argument for `pdbridge prefill` (repeat: --prefill-arg --kv-rows --prefill-arg engine)
#   --ref-server-bin BIN  a second llama-server (another build of the same release: another ISA, OpenBLAS, CUDA) on the
#                       same GGUF and cache type, as eval parity's --ref-decoder: its native answers against the first's are
#                       the decoder's own reproducibility across builds, the floor under the bridge's parity
#   --ref-flags "FLAGS" its llama-server flags (default: none); REF_DECODER_CPU=1 hides CUDA devices from it alone
# Output: OUTDIR/LABEL.{doctor.txt,fidelity.json,cold.jsonl,parity.jsonl,parity_report.json,summary.txt} and the servers' logs.
set -uo pipefail
LABEL=${1:?label}; OUTD=${2:?outdir}; G=${3:?gguf}; HF=${4:?hf dir}; DEVICE=${5:?cpu|cuda}; CACHE=${6:?cache type}; shift 6
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/build/pdbridge"
DENV=(); PARGS=(); SERVER_BIN=${SERVER_BIN:-}; COLD_CHARS=8000,16000; COLD_RUNS=2; SKIP_NATIVE=""; PAR_N=8; PAR_CHARS=8000; CTX=20000; REF_BIN=""; REF_FLAGS=""
[[ ${DECODER_CPU:-0} == 1 ]] && DENV=(env CUDA_VISIBLE_DEVICES=)
while (($#)); do
  case $1 in
    --server-bin) SERVER_BIN=$2; shift 2 ;;
    --cold) COLD_CHARS=$2; COLD_RUNS=$3; shift 3 ;;
    --skip-native) SKIP_NATIVE=--skip-native; shift ;;
    --parity) PAR_N=$2; PAR_CHARS=$3; shift 3 ;;
    --ctx) CTX=$2; shift 2 ;;
    --decoder-cpu) DENV=(env CUDA_VISIBLE_DEVICES=); shift ;;
    --prefill-arg) PARGS+=("$2"); shift 2 ;;
    --ref-server-bin) REF_BIN=$2; shift 2 ;;
    --ref-flags) REF_FLAGS=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "fidelity_stack.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUTD"
WORK=$(mktemp -d /tmp/pdbridge-fid.XXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; cp "$WORK"/*.log "$OUTD/" 2>/dev/null; rm -rf "$WORK"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ok() { for _ in $(seq 1 1800); do curl -sf "$1" >/dev/null 2>&1 && return 0; kill -0 "$2" 2>/dev/null || { tail -20 "$3"; return 1; }; sleep 0.2; done; return 1; }
D=$(free_port); P=$(free_port); F=$(free_port); R=$(free_port)
mkdir -p "$WORK/slots" "$WORK/ref-slots"
REF_ARGS=()
if [[ -n $REF_BIN ]]; then
  RENV=(); [[ ${REF_DECODER_CPU:-0} == 1 ]] && RENV=(env CUDA_VISIBLE_DEVICES=)
  # shellcheck disable=SC2086
  "${RENV[@]}" "$BIN" decoder --gguf "$G" --port "$R" --slot-dir "$WORK/ref-slots" --ctx "$CTX" --parallel 2 --cache-type "$CACHE" \
    --server-bin "$REF_BIN" -- $REF_FLAGS >"$WORK/$LABEL.ref-decoder.log" 2>&1 &
  PIDS+=($!); wait_ok "http://127.0.0.1:$R/health" "${PIDS[-1]}" "$WORK/$LABEL.ref-decoder.log" || { echo "$LABEL: reference decoder did not start"; exit 1; }
  REF_ARGS=(--ref-decoder "http://127.0.0.1:$R")
fi
"${DENV[@]}" "$BIN" decoder --gguf "$G" --port "$D" --slot-dir "$WORK/slots" --ctx "$CTX" --parallel 2 --cache-type "$CACHE" \
  ${SERVER_BIN:+--server-bin "$SERVER_BIN"} -- "$@" >"$WORK/$LABEL.decoder.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$D/health" "${PIDS[-1]}" "$WORK/$LABEL.decoder.log" || { echo "$LABEL: decoder did not start"; exit 1; }
"$BIN" prefill --model "$HF" --recipe "$G" --port "$P" --device "$DEVICE" "${PARGS[@]}" >"$WORK/$LABEL.prefill.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$P/health" "${PIDS[-1]}" "$WORK/$LABEL.prefill.log" || { echo "$LABEL: prefill did not start"; exit 1; }
"$BIN" front --decoder "http://127.0.0.1:$D" --decoder-gguf "$G" --slot-dir "$WORK/slots" --prefill "http://127.0.0.1:$P" \
  --port "$F" --min-tokens 1024 >"$WORK/$LABEL.front.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$F/health" "${PIDS[-1]}" "$WORK/$LABEL.front.log" || { echo "$LABEL: front did not start"; exit 1; }
# the front door's own startup calibration first (doctor probes a slot of its own too)
for _ in $(seq 1 1800); do grep -q "layout learned at startup\|startup layout probe:" "$WORK/$LABEL.front.log" && break; sleep 0.2; done
"$BIN" doctor --front "http://127.0.0.1:$F" --fidelity-json "$OUTD/$LABEL.fidelity.json" >"$OUTD/$LABEL.doctor.txt" 2>&1
CLASS=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('class','?'))" "$OUTD/$LABEL.fidelity.json" 2>/dev/null || echo "?")
{
  echo "== $LABEL: $(basename "$G"), cache $CACHE, prefill $DEVICE, decoder flags: $*"
  grep -E "decoder calibration|fidelity class" "$OUTD/$LABEL.doctor.txt"
} | tee "$OUTD/$LABEL.summary.txt"
if [[ $CLASS != mismatch && $COLD_RUNS != 0 ]]; then
  "$BIN" bench cold --front "http://127.0.0.1:$F" --native-url "http://127.0.0.1:$D" --chars "$COLD_CHARS" --runs "$COLD_RUNS" \
    --max-tokens 32 $SKIP_NATIVE --out "$OUTD/$LABEL.cold.jsonl" 2>&1 | tail -n 12 | tee -a "$OUTD/$LABEL.summary.txt"
fi
if [[ $CLASS != mismatch && $PAR_N != 0 ]]; then
  "$BIN" eval parity --front "http://127.0.0.1:$F" --decoder "http://127.0.0.1:$D" --prompts "$PAR_N" --chars "$PAR_CHARS" \
    ${PARITY_SEED:+--seed $PARITY_SEED} "${REF_ARGS[@]}" --out "$OUTD/$LABEL.parity.jsonl" 2>/dev/null | tee "$OUTD/$LABEL.parity_report.json" | tee -a "$OUTD/$LABEL.summary.txt"
fi
exit 0
