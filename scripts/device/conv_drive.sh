#!/bin/bash
# Starts conv_job.sh once under setsid (it outlives one command's limit) and waits up to $1 seconds; copies $R
# to $OUT. Call again (within the machine's idle release) to keep waiting. Usage: bash .dev/conv_drive.sh 570
LIMIT=${1:-570}; T=$(date +%s)
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1
[ -e $R/STARTED ] || { touch $R/STARTED; setsid nohup bash $DEV/conv_job.sh > $R/conv_job.out 2>&1 < /dev/null & echo "job started"; }
while [ ! -e $R/DONE ] && [ $(( $(date +%s) - T )) -lt $LIMIT ]; do sleep 5; done
cat $R/conv_job.log 2>/dev/null | tail -40
tar czf $OUT/res.tgz -C /tmp res --exclude='*.gguf' 2>/dev/null
