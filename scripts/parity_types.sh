#!/usr/bin/env bash
# Issue 35's parity table: the shipped needle model quantized by the pinned llama-quantize into every weight type
# (an importance matrix from the pinned llama-imatrix on this repository's docs), then for each type the output parity
# of the bridge against the decoder's own prefill (scripts/fidelity_stack.sh, CPU decoder, f16 cache), with the GGUF
# itself as the prefill's model and, with LEGS="gguf ckpt", the bf16 checkpoint too. Same prompts for every cell.
# Legs: gguf (the GGUF as the model, the recipe's rows), ckpt (the bf16 checkpoint), engine (the GGUF on the GPU with
# --kv-rows engine: the engine's own K/V as the rows), half / cpu / cuda (the GGUF on the GPU with that --numerics: the
# engine's products rounded as that decoder class rounds them), and joins of them (engine+cpu). DEVICE=cuda runs the
# gguf and ckpt legs' prefill on the GPU;
# IMATRIX=0 quantizes without an importance matrix (the IQ1/IQ2/IQ3 types need one); IMATRIX_FILE uses that one.
# GGUF_DIR keeps the quantized files apart from the reports (default: OUTDIR).
# SERVER_BIN and DECODER_FLAGS: the decoder's llama-server and its flags (a CUDA build with "-ngl 99"; default: the
# pinned CPU build, no flags).
# REF_SERVER_BIN (and REF_FLAGS): a second build of the same llama.cpp (another ISA, OpenBLAS, CUDA) beside the decoder
# in every cell; its native answers against the decoder's ("ref") are the decoder's own reproducibility across builds.
# Usage: scripts/parity_types.sh OUTDIR [TYPE ...]   (env: PARITY_SEED, LEGS, PROMPTS, CHARS, DEVICE, IMATRIX, GGUF_DIR)
set -euo pipefail
OUT=${1:?outdir}; shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TYPES=("$@"); [ ${#TYPES[@]} -gt 0 ] || TYPES=(Q8_0 Q6_K Q5_K_M Q5_0 Q5_1 Q4_K_M Q4_0 Q4_1 IQ4_NL IQ4_XS Q3_K_M Q2_K IQ3_S IQ3_XXS IQ2_S IQ2_XS IQ2_XXS IQ1_M IQ1_S)
export PARITY_SEED=${PARITY_SEED:-$(date +%s)}
LLAMA_BUILD=$(dirname "$(readlink -f "$ROOT/build/llama/bin/llama-quantize")")/../build
SRC=$ROOT/build/models/needle/decoder-f16.gguf
GD=${GGUF_DIR:-$OUT}
mkdir -p "$OUT" "$GD"
QARGS=()
if [ -n "${IMATRIX_FILE:-}" ]; then  # an importance matrix made elsewhere (the GPU box carries this machine's)
  QARGS=(--imatrix "$IMATRIX_FILE")
elif [ "${IMATRIX:-1}" = 1 ]; then
  [ -x "$LLAMA_BUILD/bin/llama-imatrix" ] || cmake --build "$LLAMA_BUILD" --target llama-imatrix -j "$(nproc)" > "$OUT/imatrix-build.log"
  cat "$ROOT"/docs/*.md "$ROOT/README.md" > "$OUT/calib.txt"
  [ -f "$OUT/imatrix.gguf" ] || "$LLAMA_BUILD/bin/llama-imatrix" -m "$SRC" -f "$OUT/calib.txt" -o "$OUT/imatrix.gguf" -c 512 > "$OUT/imatrix.log" 2>&1
  QARGS=(--imatrix "$OUT/imatrix.gguf")
fi
for T in "${TYPES[@]}"; do
  t=$(echo "$T" | tr A-Z a-z); g=$GD/decoder-$t.gguf
  [ -f "$g" ] || { [ "$t" = f16 ] && cp "$SRC" "$g"; } || "$ROOT/build/llama/bin/llama-quantize" "${QARGS[@]}" "$SRC" "$g" "$T" > "$OUT/quantize-$t.log" 2>&1
  for leg in ${LEGS:-gguf}; do
    model=$g; dev=${DEVICE:-cpu}; extra=()
    [ "$leg" = ckpt ] && model=$ROOT/models/needle-llama
    for part in ${leg//+/ }; do
      case $part in
        engine) dev=cuda; extra+=(--prefill-arg --kv-rows --prefill-arg engine) ;;
        half|cpu|cuda) dev=cuda; extra+=(--prefill-arg --numerics --prefill-arg "$part") ;;
      esac
    done
    [ -n "${REF_SERVER_BIN:-}" ] && extra+=(--ref-server-bin "$REF_SERVER_BIN" --ref-flags "${REF_FLAGS:-}")
    "$ROOT/scripts/fidelity_stack.sh" "$t-$leg" "$OUT" "$g" "$model" "$dev" f16 --cold 0 0 --parity "${PROMPTS:-6}" "${CHARS:-6000}" "${extra[@]}" -- ${DECODER_FLAGS:-} > "$OUT/$t-$leg.run.log" 2>&1 || true
    python3 -c "
import json,sys
j=json.load(open(sys.argv[1]))
for key,name in (('bridged_vs_native',sys.argv[2]),('reference_vs_native',sys.argv[2]+' ref')):
    r=j.get(key)
    if r: print(name, 'KL %.5f top1 %.2f greedy %.2f' % (r['mean_kl_first_token'], r['top1_agreement'], r['greedy_match_rate']))
" "$OUT/$t-$leg.parity_report.json" "$t-$leg" 2>/dev/null || echo "$t-$leg: no report ($OUT/$t-$leg.run.log)"
  done
done
