#!/usr/bin/env python3
"""Issue 20's conversation benchmark driver: TURNS turns through a front door, each appending the previous answer
and TAIL fresh random tokens (a fresh seed per session), one generated token per turn (the time to first token).
Writes one JSON line per turn: wall time, the verdict header (tail_from, bridged tokens, bytes, stage times, the
prefill server's reused/computed tokens) and the decoder's timings (cache_n, prompt_n).
Usage: conversation.py FRONT_URL LABEL TURNS TAIL SEED VOCAB OUT.jsonl"""
import json, random, sys, time, urllib.request

front, label, turns, tail, seed, vocab, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
rng = random.Random(seed)
prompt = []
with open(out, "a") as f:
    for turn in range(1, turns + 1):
        prompt += [rng.randrange(1000, vocab - 1000) for _ in range(tail)]
        body = json.dumps({"prompt": prompt, "n_predict": 1, "temperature": 0, "return_tokens": True}).encode()
        req = urllib.request.Request(front + "/completion", body, {"Content-Type": "application/json"})
        t0 = time.time()
        with urllib.request.urlopen(req, timeout=3600) as r:
            reply = json.loads(r.read())
            verdict = json.loads(r.headers.get("X-PD-Bridge") or "null")
        wall = time.time() - t0
        answer = reply.get("tokens") or []
        row = {"label": label, "turn": turn, "tokens": len(prompt), "ttft_s": round(wall, 3), "verdict": verdict,
               "timings": {k: reply.get("timings", {}).get(k) for k in ("cache_n", "prompt_n", "prompt_ms")}}
        f.write(json.dumps(row) + "\n")
        f.flush()
        v = verdict or {}
        print(f"{label} turn {turn}: {len(prompt)} tokens, {wall:.2f}s, {v.get('verdict')} tail_from={v.get('tail_from')} "
              f"bridged={v.get('bridged_tokens')} bytes={v.get('bytes')} reused={v.get('prefill_reused_tokens')} "
              f"computed={v.get('prefill_computed_tokens')} engine={v.get('t_engine_s')} wire={v.get('t_wire_s')} hold={v.get('t_hold_s')} "
              f"copy={v.get('t_copy_s')} restore={v.get('t_restore_s')} cache_n={row['timings']['cache_n']}", flush=True)
        prompt += answer
