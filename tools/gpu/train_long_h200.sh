#!/usr/bin/env bash
# Train DSpark alone on one lent GPU for as long as the session's device time allows (the shipped drafter, #15).
#
# Usage (on the GPU machine, from a copy of the repository root, the payload as for train_h200.sh):
#     bash tools/gpu/train_long_h200.sh BUDGET_S
# The run may outlast one device call (10 minutes at most): start it with setsid in one call, which keeps it
# running while the machine is held, and collect $BACK in the next call once $BACK/done exists.
#
#  1. rebuild the target (setup.sh);
#  2. two smoke runs of 40 steps, 32 and 128 anchors (blocks) per sequence: the step time of each alone;
#  3. 128 anchors when its step costs at most 1.6x the 32-anchor step (then >= 2.5x the supervised blocks a
#     second; the papers train 512 a sequence), else 32;
#  4. one run whose cosine schedule is planned to end BUDGET_S after the start, less the export; past that
#     deadline it is stopped with SIGTERM (the trainer saves a checkpoint);
#  5. into $BACK: the drafter as a bfloat16 export (or, for a stopped run, its last checkpoint's weights in
#     bfloat16) split into < 16 MiB parts, the metrics and the log; then $BACK/done.
set -u -o pipefail
BUDGET_S=${1:-560}
BATCH=${BATCH:-32} SMOKE_STEPS=${SMOKE_STEPS:-40}  # overridable for a dry run on a CPU
START=$(date +%s)
BACK=${BACK:-/root/back}
mkdir -p "$BACK"
OUT=$BACK
source tools/gpu/setup.sh

COMMON=(--drafter dspark --data "$DATA" --batch-size "$BATCH" --lr 6e-4)
declare -A STEP
for anchors in 32 128; do
    sd train "${COMMON[@]}" --anchors $anchors --out $WORK/runs/smoke-$anchors --max-steps "$SMOKE_STEPS" --max-conversations 1400 \
        --eval-every 1000 2>&1 | tail -1 | tee -a "$log"
    STEP[$anchors]=$(step_time $WORK/runs/smoke-$anchors) || STEP[$anchors]=1e9
done
ANCHORS=$(python3 -c "print(128 if ${STEP[128]} <= 1.6 * ${STEP[32]} else 32)")
LEFT=$((BUDGET_S - ($(date +%s) - START) - 40))  # the export and packing take ~20 s
STEPS=$(python3 -c "print(max(1, int(0.93 * $LEFT / ${STEP[$ANCHORS]})))")  # the held-out evaluations take the rest
echo "step alone: ${STEP[32]}s at 32 anchors, ${STEP[128]}s at 128; ${ANCHORS} anchors, ${STEPS} steps in ${LEFT}s" \
    | tee -a "$log"

RUN=$WORK/runs/dspark-long
sd train "${COMMON[@]}" --anchors "$ANCHORS" --max-steps "$STEPS" --eval-every 500 --save-every 1000 --out $RUN \
    >$RUN.log 2>&1 &
DEADLINE=$((START + BUDGET_S - 25))
while [ "$(jobs -r | wc -l)" -gt 0 ] && [ "$(date +%s)" -lt $DEADLINE ]; do sleep 2; done
pkill -TERM -f "specdecode.cli"  # a late run saves its checkpoint and stops
wait
echo "training ended at $(($(date +%s) - START))s: $(tail -c 300 $RUN.log | tr '\r' '\n' | tail -2)" | tee -a "$log"

cp $RUN/metrics.jsonl $RUN.log "$BACK/" && gzip -f "$BACK/metrics.jsonl" "$BACK/dspark-long.log"
if [ -f $RUN/drafter/model.safetensors ]; then
    sd export $RUN/drafter $WORK/export/dspark --dtype bfloat16 2>&1 | tail -1 | tee -a "$log"
    tar cf - -C $WORK/export dspark | split -b 15M - "$BACK/dspark.tar.part-"
else  # stopped: the last checkpoint's weights, rebuilt into a drafter on the CPU (docs/training.md section 8)
    python3 - "$RUN" "$BACK" <<'PY'
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
run, back = Path(sys.argv[1]), Path(sys.argv[2])
last = run / (run / "latest").read_text().strip()
save_file({k: v.bfloat16() for k, v in load_file(last / "weights.safetensors").items()}, "/tmp/checkpoint.safetensors")
(back / "checkpoint-state.json").write_text((last / "state.json").read_text())
PY
    split -b 15M /tmp/checkpoint.safetensors "$BACK/checkpoint.safetensors.part-"
fi
ls -la "$BACK" | tee -a "$log"
echo "done at $(($(date +%s) - START))s" | tee -a "$log"
touch "$BACK/done"
