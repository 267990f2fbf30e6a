#!/usr/bin/env bash
# `make demo`: the main job on the embedded default model. Starts the decoder (unmodified llama-server),
# the prefill engine (CUDA if a GPU is present, else CPU) and the front door; sends one long cold prompt
# natively and one through the bridge (fresh seeds), and prints them side by side. Stops every process
# it started, also on Ctrl-C or failure, and exits non-zero if anything went wrong.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/build/pdbridge"
WORK="${PDBRIDGE_DEMO_DIR:-$ROOT/build/demo}"
WORDS="${PDBRIDGE_DEMO_WORDS:-4000}"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'echo; echo "[demo] interrupted"; exit 130' INT TERM
say() { printf '\033[1m[demo]\033[0m %s\n' "$*"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_ok() {  # url pid log
  for _ in $(seq 1 600); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { tail -20 "$3"; say "process for $1 exited"; return 1; }
    sleep 0.2
  done
  say "$1 did not come up"; return 1
}

mkdir -p "$WORK"
HF="$ROOT/models/needle-llama"          # the embedded default model (bf16 HF checkpoint, trained: models/needle-llama/TRAINING.md)
GGUF_DIR="$ROOT/build/models/needle"     # its decoder GGUFs, converted by `make` (scripts/models.sh)
if [[ ! -f $GGUF_DIR/decoder-q4_0.gguf ]]; then
  say "converting the default model to decoder GGUFs (F16, Q8_0, Q4_0) ..."
  "$ROOT/scripts/models.sh" >"$WORK/convert.log" 2>&1 || { tail -20 "$WORK/convert.log"; exit 1; }
fi
DEVICE=cpu
if "$BIN" device-info 2>/dev/null | grep -q "sm_"; then DEVICE=cuda; fi
"$BIN" device-info | sed 's/^/[demo]   /'
CHARS="${PDBRIDGE_DEMO_CHARS:-$([[ $DEVICE == cuda ]] && echo 16000 || echo 8000)}"
DEC_PORT=$(free_port); PRE_PORT=$(free_port); FRONT_PORT=$(free_port)
rm -rf "$WORK/slots"; mkdir -p "$WORK/slots"
say "starting the decoder (llama-server: the model's Q4_0 GGUF, F16 cache) on :$DEC_PORT"
"$BIN" decoder --gguf "$GGUF_DIR/decoder-q4_0.gguf" --port "$DEC_PORT" --slot-dir "$WORK/slots" --ctx 32768 --parallel 2 \
  --cache-type f16 >"$WORK/decoder.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$DEC_PORT/health" "${PIDS[-1]}" "$WORK/decoder.log"
say "starting the prefill engine on the $DEVICE (HF bf16 checkpoint; recipe from the decoder's Q4_0 GGUF) on :$PRE_PORT"
"$BIN" prefill --model "$HF" --recipe "$GGUF_DIR/decoder-q4_0.gguf" --port "$PRE_PORT" --device "$DEVICE" $([[ $DEVICE == cpu ]] && echo --cpu-fast) >"$WORK/prefill.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$PRE_PORT/health" "${PIDS[-1]}" "$WORK/prefill.log"
say "starting the front door on :$FRONT_PORT"
"$BIN" front --decoder "http://127.0.0.1:$DEC_PORT" --decoder-gguf "$GGUF_DIR/decoder-q4_0.gguf" --slot-dir "$WORK/slots" \
  --prefill "http://127.0.0.1:$PRE_PORT" --port "$FRONT_PORT" --min-tokens 1024 >"$WORK/front.log" 2>&1 &
PIDS+=($!); wait_ok "http://127.0.0.1:$FRONT_PORT/health" "${PIDS[-1]}" "$WORK/front.log"

say "sending two cold needle prompts of ~$CHARS characters (fresh seeds): one natively, one through the bridge"
python3 - "$DEC_PORT" "$FRONT_PORT" "$CHARS" <<'PY'
import json, os, random, sys, sysconfig, time, urllib.request
dec, front, chars = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
# The cold-prompt protocol of `pdbridge bench cold`: shuffled Python standard-library sources, a marker
# in the middle, the question; the model was trained on this format (models/needle-llama/TRAINING.md).
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(sysconfig.get_paths()["stdlib"]) if "site-packages" not in d
               for f in fs if f.endswith(".py"))
def document(seed):
    g = random.Random(seed)
    order = files[:]
    g.shuffle(order)
    hay = ""
    for f in order:
        if len(hay) >= chars: break
        try: hay += "# file: " + os.path.basename(f) + "\n" + open(f, encoding="utf-8", errors="replace").read() + "\n"
        except OSError: pass
    hay = hay[:chars]
    marker = "ZEBRA-%d-%d" % (seed % 10000, 1000 + g.randrange(9000))
    mid = hay.find("\n", len(hay) // 2)
    mid = len(hay) // 2 if mid < 0 else mid + 1
    text = hay[:mid] + "\nThe secret marker is " + marker + ".\n" + hay[mid:]
    return text + "\n\nWhat is the secret marker mentioned in the text above? Answer with the marker only.", marker
def run(port, text, native):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0, "stream": True}
    if native: body.update({"cache_prompt": False})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.time(); ttft = None; out = ""; timings = {}
    with urllib.request.urlopen(req, timeout=3600) as r:
        verdict = json.loads(r.headers.get("X-PD-Bridge") or '{"verdict": "native (direct to llama-server)"}')
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]": continue
            ev = json.loads(line[6:])
            delta = (ev.get("choices") or [{}])[0].get("delta", {}).get("content") or ""
            if delta and ttft is None: ttft = time.time() - t0
            out += delta
            timings = ev.get("timings", timings)
    return dict(ttft=ttft or 0.0, total=time.time() - t0, verdict=verdict, timings=timings, text=out.strip())
seeds = os.environ.get("PDBRIDGE_DEMO_SEEDS")  # "native,bridged" to replay a run; fresh otherwise
seed_native, seed_bridged = map(int, seeds.split(",")) if seeds else (random.randrange(1, 1 << 30), random.randrange(1, 1 << 30))
doc_n, marker_n = document(seed_native)
doc_b, marker_b = document(seed_bridged)
n = run(dec, doc_n, True)
b = run(front, doc_b, False)
ref = run(dec, doc_b, True)  # the bridged prompt natively: what the decoder answers on its own
right = lambda r, m: "yes" if r["text"] == m else "no"
rows = [("", "native (llama-server alone)", "bridged (pdbridge)"),
        ("seed / marker", f"{seed_native} / {marker_n}", f"{seed_bridged} / {marker_b}"),
        ("prompt tokens", str(n["timings"].get("prompt_n", "?")), str(b["verdict"].get("tokens", "?"))),
        ("TTFT", f'{n["ttft"]:.2f} s', f'{b["ttft"]:.2f} s'),
        ("total", f'{n["total"]:.2f} s', f'{b["total"]:.2f} s'),
        ("verdict", "native", b["verdict"].get("verdict", "?")),
        ("decoder fidelity class", "-", "%s (ISA %s)" % (b["verdict"].get("fidelity", {}).get("class", "?"), b["verdict"].get("fidelity", {}).get("decoder_isa", "?"))),
        ("cached tokens", str(n["timings"].get("cache_n", 0)), str(b["timings"].get("cache_n", "?"))),
        ("answer", repr(n["text"][:40]), repr(b["text"][:40])),
        ("right?", right(n, marker_n), right(b, marker_b)),
        ("= decoder's own answer?", "-", "yes" if b["text"] == ref["text"] else "no (natively: %r)" % ref["text"][:40])]
w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
print()
for r in rows: print(f"  {r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}")
print()
mounted = b["verdict"].get("verdict") == "complete" and b["timings"].get("cache_n", 0) >= b["verdict"]["tokens"] - 1
own = b["text"] == ref["text"]  # the bridge's job: the decoder's own answer
n_ok, b_ok = right(n, marker_n) == "yes", right(b, marker_b) == "yes"
# The small Q4_0 needle model misses a rare seed on its own (docs/RESULTS.md: e.g. ZEBRA-777-77178 for ZEBRA-7777-7178,
# natively too). Such a miss is the model's, not the bridge's: it passes when the decoder answers the bridged prompt the
# same natively and the other prompt is right; two wrong answers fail (a broken model or set-up).
ok = mounted and own and (n_ok or b_ok)
if not mounted:
    print("[demo] FAILED: the bridge did not deliver a complete, mounted cache (see the table and build/demo/*.log)")
elif not own:
    print("[demo] FAILED: the bridged answer is not the decoder's own (see the table)")
elif not ok:
    print("[demo] FAILED: both answers are wrong (see the table)")
elif not (n_ok and b_ok):
    print("[demo] the bridged decoder reused the whole prompt (cache_n) and gave the decoder's own answer; the model missed "
          "one marker on its own (the decoder answers it the same natively: a rare miss of the small needle model, "
          "PDBRIDGE_DEMO_SEEDS=%d,%d replays it)" % (seed_native, seed_bridged))
else:
    print("[demo] both answers are right; the bridged decoder reused the whole prompt (cache_n) and only decoded")
sys.exit(0 if ok else 1)
PY
say "done (logs in $WORK)"
