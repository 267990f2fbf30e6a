#!/usr/bin/env bash
# The whole stack across an emulated Ethernet link: two network namespaces (pdb-gpu: the prefill
# engine; pdb-dec: llama-server and the front door) joined by a veth pair shaped with tc (tbf) to
# RATE Gbit/s in both directions. Traffic stays inside the namespaces. It first measures the shaped
# link with a raw TCP transfer, then sends bridged cold needle prompts through the front door and
# reports, from the verdicts, bytes on the wire, wire time and wire rate against the link rate.
# PDBRIDGE_NETNS_OUT=FILE keeps the bench rows. Needs root (ip netns, tc). Usage: scripts/netns_link.sh [RATE_GBIT=1] [CHARS=8000] [RUNS=2] [DEVICE=cpu|cuda]
set -euo pipefail
RATE=${1:-1}; CHARS=${2:-8000}; RUNS=${3:-2}; DEVICE=${4:-cpu}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/build/pdbridge"; HF="$ROOT/models/needle-llama"; G="$ROOT/build/models/needle/decoder-q4_0.gguf"
WORK=$(mktemp -d /tmp/pdbridge-netns.XXXX)
A=pdb-gpu; B=pdb-dec; IPA=10.77.0.1; IPB=10.77.0.2
say() { printf '[netns] %s\n' "$*"; }
cleanup() {
  ip netns pids $A 2>/dev/null | xargs -r kill 2>/dev/null || true
  ip netns pids $B 2>/dev/null | xargs -r kill 2>/dev/null || true
  sleep 0.5
  ip netns del $A 2>/dev/null || true
  ip netns del $B 2>/dev/null || true
}
trap cleanup EXIT
[[ $(id -u) == 0 ]] || { echo "needs root (ip netns, tc)"; exit 2; }
[[ -x $BIN && -f $G ]] || { echo "build first: make"; exit 2; }
cleanup
ip netns add $A; ip netns add $B
ip link add veth-gpu type veth peer name veth-dec
ip link set veth-gpu netns $A; ip link set veth-dec netns $B
ip -n $A addr add $IPA/24 dev veth-gpu; ip -n $B addr add $IPB/24 dev veth-dec
for ns in $A $B; do ip -n $ns link set lo up; done
ip -n $A link set veth-gpu up; ip -n $B link set veth-dec up
# tbf: RATE Gbit/s, a burst of ~1 ms of traffic (at least 64 KB), 50 ms of queue
BURST=$(python3 -c "print(max(65536, int($RATE*1e9/8/1000)))")
ip netns exec $A tc qdisc add dev veth-gpu root tbf rate ${RATE}gbit burst $BURST latency 50ms
ip netns exec $B tc qdisc add dev veth-dec root tbf rate ${RATE}gbit burst $BURST latency 50ms
say "link: veth pair $IPA <-> $IPB shaped to $RATE Gbit/s (tbf burst $BURST B)"

# 1. the link itself: 1 GB... scaled to ~3 s of traffic, raw TCP from the GPU side to the decoder side
BYTES=$(python3 -c "print(int($RATE*1e9/8*3))")
ip netns exec $B python3 -c "
import socket,time
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('$IPB', 19500)); s.listen(1)
c,_=s.accept(); n=0; t0=None
while True:
    b=c.recv(1<<20)
    if not b: break
    if t0 is None: t0=time.time()
    n+=len(b)
print('%.3f' % (n*8/(time.time()-t0)/1e9))" > $WORK/link.txt &
sleep 0.5
ip netns exec $A python3 -c "
import socket
s=socket.create_connection(('$IPB', 19500)); buf=b'x'*(1<<20); left=$BYTES
while left>0: s.sendall(buf[:min(left,len(buf))]); left-=len(buf)
s.close()"
wait
LINK=$(cat $WORK/link.txt)
say "measured TCP throughput over the shaped link: $LINK Gbit/s (target $RATE)"

# 2. the stack: prefill on the GPU side, decoder + front door on the decoder side
mkdir -p $WORK/slots
ip netns exec $B "$BIN" decoder --gguf "$G" --host 127.0.0.1 --port 8080 --slot-dir $WORK/slots --ctx $(( (CHARS + 4096) * 2 )) --parallel 2 --cache-type f16 > $WORK/decoder.log 2>&1 &
ip netns exec $A "$BIN" prefill --model "$HF" --recipe "$G" --host $IPA --port 8090 --device $DEVICE $([[ $DEVICE == cpu ]] && echo --cpu-fast) > $WORK/prefill.log 2>&1 &
for _ in $(seq 1 300); do ip netns exec $B curl -sf http://127.0.0.1:8080/health >/dev/null 2>&1 && break; sleep 0.2; done
for _ in $(seq 1 300); do ip netns exec $B curl -sf http://$IPA:8090/health >/dev/null 2>&1 && break; sleep 0.2; done
ip netns exec $B "$BIN" front --decoder http://127.0.0.1:8080 --decoder-gguf "$G" --slot-dir $WORK/slots --prefill http://$IPA:8090 \
  --host 127.0.0.1 --port 8000 --min-tokens 1024 > $WORK/front.log 2>&1 &
for _ in $(seq 1 300); do ip netns exec $B curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1 && break; sleep 0.2; done
say "stack up: prefill ($DEVICE) in $A, llama-server + front door in $B; $RUNS bridged cold prompts of $CHARS chars"
ip netns exec $B "$BIN" bench cold --front http://127.0.0.1:8000 --skip-native --chars $CHARS --runs $RUNS --max-tokens 32 \
  --out $WORK/bench.jsonl > $WORK/bench.log 2>&1 || { tail -5 $WORK/bench.log; exit 1; }
python3 - $WORK/bench.jsonl "$RATE" "$LINK" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rate, link = float(sys.argv[2]), float(sys.argv[3])
print("[netns] %-8s %-9s %-8s %-12s %-8s %-8s %-10s %s" % ("tokens", "verdict", "cached", "wire bytes", "wire s", "engine s", "wire Gb/s", "marker"))
ok = True
for r in rows:
    gbps = r.get("bytes", 0) * 8 / max(r.get("t_wire_s", 0), 1e-9) / 1e9
    print("[netns] %-8s %-9s %-8s %-12s %-8.2f %-8.2f %-10.3f %s" % (r["prompt_tokens"], r["verdict"], r["cached_tokens"], r.get("bytes", 0),
          r.get("t_wire_s", 0), r.get("t_engine_s", 0), gbps, "found" if r["marker_found"] else "MISSED"))
    ok &= r["verdict"] == "complete" and r["cached_tokens"] >= r["prompt_tokens"] - 1
print("[netns] link %.3f Gbit/s measured (%.0f%% of %s); the wire rate reaches the link only where the engine outpaces it" % (link, 100 * link / rate, rate))
sys.exit(0 if ok else 1)
PY
[[ -n ${PDBRIDGE_NETNS_OUT:-} ]] && cp $WORK/bench.jsonl "$PDBRIDGE_NETNS_OUT"
say "done (logs in $WORK)"
