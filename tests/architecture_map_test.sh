#!/bin/bash
# Fails when docs/ARCHITECTURE.md (or WIRE.md, README.md) names a file or folder of the tree that does not exist:
# every backticked path under src/ (with or without the src/ prefix), tests/, scripts/, fuzz/, models/, docs/.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
src_dirs='common|formats|numerics|definitions|recipes|cache|wire|model|cuda|prefill|arch|front|decoder|tools|cli'
missing=0 checked=0
for doc in docs/ARCHITECTURE.md docs/WIRE.md README.md; do
  while IFS= read -r tok; do
    [[ "$tok" == *"<"* || "$tok" == *" "* ]] && continue
    if [[ "$tok" =~ ^($src_dirs)/ ]]; then path="src/$tok"
    elif [[ "$tok" =~ ^(src|tests|scripts|fuzz|docs|models/needle) ]]; then path="$tok"
    else continue; fi
    checked=$((checked + 1))
    # a trailing .* names a family (foo.h + foo.cpp): any match will do
    if ! compgen -G "$root/$path" > /dev/null && ! compgen -G "$root/$path.*" > /dev/null; then
      echo "$doc names $tok, which does not exist ($path)"
      missing=$((missing + 1))
    fi
  done < <(grep -o '`[^`]*`' "$root/$doc" | tr -d '`' | tr ',' '\n' | sed 's/^ *//; s/ *$//')
done
echo "$checked paths checked, $missing missing"
[ "$checked" -gt 100 ] || { echo "too few paths found: is the map's format still backticked paths?"; exit 1; }
[ "$missing" = 0 ]
