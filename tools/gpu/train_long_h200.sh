#!/usr/bin/env bash
# Train DSpark alone on one lent GPU for as long as the session's device time allows (the shipped drafter, #15).
#
# Usage (on the GPU machine, from a copy of the repository root, the payload as for train_h200.sh):
#     bash tools/gpu/train_long_h200.sh BUDGET_S
#     INIT=specdecode/drafters/shipped/smollm2-135m LR=3e-4 bash tools/gpu/train_long_h200.sh BUDGET_S
# The run may outlast one device call (10 minutes at most): start it with setsid in one call, which keeps it
# running while the machine is held, and collect $BACK in the next call once $BACK/done exists.
#
#  1. rebuild the target (setup.sh);
#  2. one run, from scratch or from INIT (fine-tuning keeps that drafter's architecture), at ANCHORS blocks a
#     sequence (128: in stop 40 it learned more per step than 32 at 1.8x the step; the papers train 512),
#     whose learning rate follows the clock (`specdecode train --max-time`) to end with the budget, less the
#     export; past that deadline it is stopped with SIGTERM (the trainer saves a checkpoint). Until stop 49 a
#     cosine planned in steps from 40 timed smoke steps ended stop 40's run after 233 s of a 750 s budget: the
#     GPU's first ~500 steps ran 3x slower than the rest, so the smoke steps timed only the warm-up;
#  3. into $BACK: the drafter as a bfloat16 export (or, for a stopped run, its last checkpoint's weights in
#     bfloat16) split into < 16 MiB parts, the metrics and the log; then $BACK/done.
set -u -o pipefail
BUDGET_S=${1:-560}
BATCH=${BATCH:-32} ANCHORS=${ANCHORS:-128} LR=${LR:-6e-4} INIT=${INIT:-}  # overridable (and for a dry run on a CPU)
START=$(date +%s)
BACK=${BACK:-/root/back}
mkdir -p "$BACK"
OUT=$BACK
source tools/gpu/setup.sh

ARGS=(--drafter dspark --data "$DATA" --batch-size "$BATCH" --lr "$LR" --anchors "$ANCHORS" --max-steps 1000000)
if [ -n "$INIT" ]; then ARGS+=(--init "$INIT"); fi
# the loop's clock starts after the target and data load (~30 s); the export, packing and last evaluation take ~20 s
LEFT=$((BUDGET_S - ($(date +%s) - START) - 75))
echo "${ANCHORS} anchors, lr ${LR}, init ${INIT:-none}: ${LEFT}s of training on the clock" | tee -a "$log"

RUN=$WORK/runs/dspark-long
sd train "${ARGS[@]}" --max-time "$LEFT" --eval-every 500 --save-every 1000 --out $RUN >$RUN.log 2>&1 &
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
