#!/usr/bin/env bash
# Train the drafters of issue #15 on one lent GPU (an H200), inside one device call of at most ~9.5 minutes.
#
# Usage (on the GPU machine, from the repository root, with the target payload of tools/gpu/target_payload.py
# at $PAYLOAD and the transformers wheel in .device/b):  bash tools/gpu/train_h200.sh BUDGET_S
#
#  1. rebuild the target folder bit for bit from its GGUF rows;
#  2. a smoke run (DSpark, 40 steps) that also measures the step time alone on the GPU (the last 20 steps: in stop
#     39 the first ~10 took 0.2-3 s against ~0.05 s after, and a median that kept them overestimated it 3.4x);
#  3. in parallel, from that step time: DSpark, DFlash and EAGLE-3 on all the regenerated data with the same
#     steps and batch (Table 1), and DSpark on the first 600 and 2,600 training conversations (the scaling curve);
#  4. every run's metrics and log, and the drafters as bfloat16 exports split into <16 MiB pieces, go to $OUT.
set -u -o pipefail
BUDGET_S=${1:-500}
BATCH=${BATCH:-32} SLOWDOWN=${SLOWDOWN:-4.5} MIN_STEPS=${MIN_STEPS:-50}  # overridable for a dry run on a CPU
source tools/gpu/setup.sh

COMMON=(--data "$DATA" --batch-size "$BATCH" --lr 6e-4 --eval-every 100 --save-every 100000)
sd train --drafter dspark "${COMMON[@]}" --out $WORK/runs/smoke --max-steps 40 --max-conversations 1400 2>&1 | tail -3 | tee -a "$log"
STEP_S=$(step_time $WORK/runs/smoke) || exit 1
LEFT=$((BUDGET_S - ($(date +%s) - START) - 75))  # leave time to export and pack
# five runs share the GPU: each step takes SLOWDOWN x its time alone (stop 39: 3.6-4.5x); at most 12 epochs
STEPS=$(python3 -c "print(max($MIN_STEPS, min(12 * 20300 // $BATCH, int($LEFT / ($STEP_S * $SLOWDOWN)))))")
echo "step alone ${STEP_S}s; ${LEFT}s left for training: ${STEPS} steps per run" | tee -a "$log"

run() {  # name, then train arguments
    local name=$1; shift
    sd train "${COMMON[@]}" --out $WORK/runs/$name --max-steps "$STEPS" "$@" >$WORK/runs/$name.log 2>&1
    echo "$name finished: exit $? at $(($(date +%s) - START))s" | tee -a "$log"
}
mkdir -p $WORK/runs
run dspark --drafter dspark &
run dflash --drafter dflash &
run eagle3 --drafter eagle3 &
run dspark-n600 --drafter dspark --max-conversations 600 &
run dspark-n2600 --drafter dspark --max-conversations 2600 &
DEADLINE=$((START + BUDGET_S - 60))
while [ "$(jobs -r | wc -l)" -gt 0 ] && [ "$(date +%s)" -lt $DEADLINE ]; do sleep 2; done
pkill -TERM -f "specdecode.cli" && sleep 8  # a late run saves its checkpoint and stops; its metrics still come back

mkdir -p $WORK/back
for name in dspark dflash eagle3 dspark-n600 dspark-n2600; do
    mkdir -p $WORK/back/$name
    cp $WORK/runs/$name/metrics.jsonl $WORK/runs/$name.log $WORK/back/$name/ 2>/dev/null
    cp $WORK/runs/$name/drafter/config.json $WORK/back/$name/ 2>/dev/null
done
tar czf "$OUT/metrics.tar.gz" -C $WORK/back .
for name in dspark eagle3 dflash; do  # what fits in the 64 MiB that comes back; the rest stays for another call
    [ -f $WORK/runs/$name/drafter/model.safetensors ] || continue
    sd export $WORK/runs/$name/drafter $WORK/export/$name --dtype bfloat16 2>&1 | tail -1 | tee -a "$log"
done
tar cf - -C $WORK/export dspark | split -b 15M - "$OUT/dspark.tar.part-"
tar cf - -C $WORK/export eagle3 | split -b 15M - "$OUT/eagle3.tar.part-"
ls -la "$OUT" | tee -a "$log"
echo "done at $(($(date +%s) - START))s" | tee -a "$log"
