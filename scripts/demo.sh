#!/usr/bin/env bash
# `make demo`: makes the embedded default model, starts the decoder (unmodified llama-server via
# `pdbridge decoder`), completes one prompt, and stops everything it started (also on Ctrl-C/failure).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/build/pdbridge"
WORK="${PDBRIDGE_DEMO_DIR:-$ROOT/build/demo}"
PORT="${PDBRIDGE_DEMO_PORT:-18180}"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
trap 'echo "[demo] interrupted"; exit 130' INT TERM

say() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }
mkdir -p "$WORK"
if [[ ! -f $WORK/model/decoder-q8_0.gguf ]]; then
  say "making the default model (llama tiny, random weights) ..."
  "$BIN" make-model --arch llama --preset tiny --seed 1 --out "$WORK/model" --gguf-types f16,q8_0 >"$WORK/make-model.log" 2>&1 \
    || { tail -20 "$WORK/make-model.log"; exit 1; }
fi
say "starting the decoder on 127.0.0.1:$PORT"
"$BIN" decoder --gguf "$WORK/model/decoder-q8_0.gguf" --port "$PORT" --slot-dir "$WORK/slots" --ctx 4096 --parallel 1 \
  >"$WORK/decoder.log" 2>&1 &
PIDS+=($!)
for i in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "${PIDS[0]}" 2>/dev/null || { tail -20 "$WORK/decoder.log"; say "decoder exited"; exit 1; }
  sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { say "decoder did not become healthy"; exit 1; }
say "completing one prompt"
RESP="$(curl -sf "http://127.0.0.1:$PORT/completion" -H 'content-type: application/json' \
  -d '{"prompt":"Prefill on the GPU, decode on the Mac:","n_predict":16,"temperature":0,"id_slot":0}')"
python3 - "$RESP" <<'PY'
import json, sys
r = json.loads(sys.argv[1]); t = r["timings"]
print(f"  prompt tokens {t['prompt_n']}, generated {r['tokens_predicted']} tokens at {t['predicted_per_second']:.1f} tok/s")
print(f"  text: {r['content']!r}")
assert r["tokens_predicted"] > 0
PY
say "ok"
