#!/bin/bash
# On the device machine: starts pipeline.sh once under setsid (so it outlives one command's limit)
# and waits up to $1 seconds for it; then copies the summary and all logs to $OUT. Call again to
# keep waiting. Usage (device tool): [STAGES2=...] bash .dev/drive.sh 560 [stages]
# STAGES2 (on a machine of two GPUs): a second pipeline of those stages on the second GPU, beside the first
# (e.g. `waitmodels,m1,scale` while the first runs tests and benches), logging to pipeline2.log.
LIMIT=${1:-560}
STAGES=${2:-all}
T=$(date +%s)
DEV=$(cd "$(dirname "$0")" && pwd)
source $DEV/env.sh || exit 1  # unpacks the bundle once, before two pipelines could race to do it
if [ ! -e $R/STARTED ]; then
  mkdir -p $R; touch $R/STARTED
  setsid nohup bash $DEV/pipeline.sh $DEV "$STAGES" > $R/pipeline.log 2>&1 < /dev/null &
  echo "pipeline started"
  if [ -n "${STAGES2:-}" ]; then
    touch $R/STARTED2
    CUDA_VISIBLE_DEVICES=1 DONE_MARK=DONE2 setsid nohup bash $DEV/pipeline.sh $DEV "$STAGES2" > $R/pipeline2.log 2>&1 < /dev/null &
    echo "second pipeline started on GPU 1"
  fi
else
  echo "pipeline already running"
fi
finished() { [ -e $R/DONE ] && { [ ! -e $R/STARTED2 ] || [ -e $R/DONE2 ]; }; }
# Results come back even if this call is cut off: they are copied to $OUT every 30 s while waiting.
N=0
while ! finished && [ $(( $(date +%s) - T )) -lt $LIMIT ]; do
  sleep 5; N=$((N + 1))
  [ $((N % 6)) = 0 ] && tar czf $OUT/res.tgz -C /tmp res 2>/dev/null
done
finished && echo "pipeline DONE" || echo "pipeline still running"
tar czf $OUT/res.tgz -C /tmp res 2>/dev/null
cp $R/pipeline.log $R/pipeline2.log $OUT/ 2>/dev/null
for f in model.safetensors config.json pdbridge-vocab.json train_log.txt; do cp /tmp/needle/$f $OUT/ 2>/dev/null; done
if [ -e $R/STARTED2 ]; then tail -c 5500 $R/pipeline.log; echo "==== pipeline 2"; tail -c 5500 $R/pipeline2.log; else tail -c 11000 $R/pipeline.log; fi
