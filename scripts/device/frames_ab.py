#!/usr/bin/env python3
"""Issue 34's byte-for-byte check of the CUDA prefill before and after a change: the same request to two
`pdbridge prefill --device cuda` binaries, every K/V (and section) frame's bytes hashed, order-free (the CUDA
backend's order across layers is not fixed). Usage: frames_ab.py OLD_BIN NEW_BIN MODEL_DIR GGUF TOKENS CHUNK K_TYPE [PORT]"""
import hashlib, json, os, random, struct, subprocess, sys, time, urllib.request

def capture(binary, model, gguf, tokens, chunk, k_type, port):
    proc = subprocess.Popen([binary, "prefill", "--model", model, "--recipe", gguf, "--device", os.environ.get("FRAMES_DEVICE", "cuda"), "--port", str(port),
                             "--chunk", str(chunk)], stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        for _ in range(600):
            try:
                health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2))
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError(f"{binary}: the prefill server exited ({proc.returncode}) before /health answered")
                time.sleep(0.5)
        else:
            raise RuntimeError(f"{binary}: no /health")
        body = {"wire_version": 1, "tokens": tokens, "fingerprint": health["fingerprint"], "k_type": k_type, "v_type": k_type,
                "rot_k": False, "rot_v": False, "simd_width": 0, "chunk": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/bridge/prefill", json.dumps(body).encode(), {"Content-Type": "application/json"})
        data = urllib.request.urlopen(req, timeout=600).read()
    finally:
        proc.terminate()
        proc.wait()
    frames, off, trailer = [], 0, None
    while off < len(data):
        magic, ver, kind, gtype, layer, pos, rows, hcs, nbytes, pcs = struct.unpack_from("<IHBBIIIIQQ", data, off)
        assert magic == 0x46424450, "bad magic"
        payload = data[off + 40: off + 40 + nbytes]
        off += 40 + nbytes
        if kind in (1, 4, 15):
            if kind == 4: trailer = payload[:300]
            continue
        frames.append((kind, gtype, layer, pos, rows, hashlib.sha256(payload).hexdigest()))
    frames.sort()
    return hashlib.sha256(repr(frames).encode()).hexdigest(), len(frames), trailer

old, new, model, gguf, n, chunk, k_type = sys.argv[1:8]
port = int(sys.argv[8]) if len(sys.argv) > 8 else 18800
vocab = json.load(open(model + "/config.json"))["vocab_size"]
rng = random.Random(34)
tokens = [rng.randrange(vocab) for _ in range(int(n))]
a = capture(old, model, gguf, tokens, int(chunk), k_type, port)
b = capture(new, model, gguf, tokens, int(chunk), k_type, port + 1)
same = a[0] == b[0]
print(json.dumps({"model": model, "gguf": gguf.split("/")[-1], "tokens": int(n), "chunk": int(chunk), "k_type": k_type, "frames_old": a[1],
                  "frames_new": b[1], "old": a[0][:16], "new": b[0][:16], "identical": same}))
sys.exit(0 if same else 1)
