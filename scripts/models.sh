#!/usr/bin/env bash
# The embedded default model's decoder GGUFs (F16, Q8_0, Q4_0), converted from the bf16 HF checkpoint
# shipped in models/needle-llama with our converter and llama-quantize. Skips work already done for
# the same checkpoint (keyed by its hash). Usage: scripts/models.sh  (after the build)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/models/needle-llama"
OUT="$ROOT/build/models/needle"
KEY=$(cat "$SRC/config.json" "$SRC/pdbridge-vocab.json" "$SRC/model.safetensors" | sha256sum | cut -c1-16)
if [[ -f $OUT/KEY && $(cat "$OUT/KEY") == "$KEY" && -f $OUT/decoder-q4_0.gguf ]]; then exit 0; fi
rm -rf "$OUT"; mkdir -p "$OUT"
"$ROOT/build/pdbridge" convert --hf "$SRC" --out "$OUT" --types f16,q8_0,q4_0 --name pdbridge-needle-llama
echo "$KEY" > "$OUT/KEY"
