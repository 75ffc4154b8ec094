# Sourced by the GPU scripts (train_h200.sh, train_long_h200.sh) on the lent machine, from the repository root:
# the environment, the `sd` command (specdecode through the GPU's own python and torch, transformers carried as
# a wheel in .device/b), the log, the target folder rebuilt bit for bit from its GGUF rows, and `step_time`.
# Needs OUT (the call's return folder) and PAYLOAD (the folder the first call copied .device/a into).
START=${START:-$(date +%s)}
WORK=${WORK:-/root}
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-$WORK/cache} TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=3
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/b/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
sd() { python3 -c 'import sys; from specdecode.cli import main; sys.argv[0] = "specdecode"; main()' "$@"; }
log=$OUT/log.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' | tee -a "$log"
cat "$PAYLOAD"/part-* .device/b/part-* >/tmp/target.tar && python3 tools/gpu/target_payload.py unpack /tmp/target.tar 2>&1 | tee -a "$log" || exit 1
DATA=data/regenerated/smollm2-135m.npz

step_time() {  # RUN_DIR: median seconds of the last 20 logged steps (stop 39: the first ~10 took 0.2-3 s, warm-up)
    python3 - "$1" <<'PY'
import statistics, sys
from specdecode.training.trainer import read_metrics
rows = read_metrics(sys.argv[1])[0][-21:]
print(f"{statistics.median(b['elapsed'] - a['elapsed'] for a, b in zip(rows, rows[1:])):.4f}")
PY
}
