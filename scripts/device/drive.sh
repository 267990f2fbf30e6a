#!/bin/bash
# On the device machine: starts pipeline.sh once under setsid (so it outlives one command's limit)
# and waits up to $1 seconds for it; then copies the summary and all logs to $OUT. Call again to
# keep waiting. Usage (device tool): bash .dev/drive.sh 560 [stages]
LIMIT=${1:-560}
STAGES=${2:-all}
T=$(date +%s)
R=/tmp/res
if [ ! -e $R/STARTED ]; then
  mkdir -p $R; touch $R/STARTED
  setsid nohup bash "$(dirname "$0")/pipeline.sh" "$(cd "$(dirname "$0")" && pwd)" "$STAGES" > $R/pipeline.log 2>&1 < /dev/null &
  echo "pipeline started"
else
  echo "pipeline already running"
fi
# Results come back even if this call is cut off: they are copied to $OUT every 30 s while waiting.
N=0
while [ ! -e $R/DONE ] && [ $(( $(date +%s) - T )) -lt $LIMIT ]; do
  sleep 5; N=$((N + 1))
  [ $((N % 6)) = 0 ] && tar czf $OUT/res.tgz -C /tmp res 2>/dev/null
done
[ -e $R/DONE ] && echo "pipeline DONE" || echo "pipeline still running"
tar czf $OUT/res.tgz -C /tmp res 2>/dev/null
cp $R/pipeline.log $OUT/ 2>/dev/null
for f in model.safetensors config.json pdbridge-vocab.json train_log.txt; do cp /tmp/needle/$f $OUT/ 2>/dev/null; done
cat $R/pipeline.log | tail -c 11000
