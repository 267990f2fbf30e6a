#!/bin/bash
# Runs one of the .dev scripts once under setsid, so that it outlives one device command's limit, waits up to
# LIMIT seconds for it and packs the results ($R) into $OUT/res.tgz; called again (within the machine's idle release) it
# only waits. Usage: bash .dev/bg.sh LIMIT SCRIPT [ARGS...]   (its log: $R/bg_SCRIPT.out)
LIMIT=${1:-570}; shift; T=$(date +%s)
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1
name=$(basename "$1" .sh)
if [ ! -e $R/bg_$name.started ]; then
  touch $R/bg_$name.started
  ( setsid nohup bash -c "bash $DEV/$*; touch $R/bg_$name.done" > $R/bg_$name.out 2>&1 < /dev/null & )
  echo "started $name"
fi
while [ ! -e $R/bg_$name.done ] && [ $(( $(date +%s) - T )) -lt $LIMIT ]; do sleep 5; done
[ -e $R/bg_$name.done ] && echo "$name done" || echo "$name still running"
tail -60 $R/bg_$name.out
# one archive: the device tool brings back only a few files per command
rm -rf $OUT/* && (cd $R && tar czf $OUT/res.tgz $(ls *.log *.jsonl *.out 2>/dev/null))
true
