"""The machine a measurement was made on, where machine-specific measurements are cached, and how busy
other processes kept it while we measured.

Kernel choices, step-cost tables and round costs are measured where the code runs, never assumed: each is
cached under `$XDG_CACHE_HOME/specdecode/<kind>/`, keyed by what it measured plus this machine's identity.
The machine is shared; another process taking a core can make a step 10-30x slower. Every timed
measurement runs inside `ForeignLoad`, and a contaminated one is measured again: a cost table measured
under load would mislead every decision that reads it until the kernels change.
"""

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from specdecode.paths import cache_dir


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def measurement_file(kind: str, key: dict) -> Path:
    """The cache file of the measurement `key` (a JSON-able dict that includes the machine) of this `kind`."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir(kind) / f"{key.get('target', 'target')}-{digest}.json"


T = TypeVar("T")
_TICKS = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICKS


class ForeignLoad:
    """Context manager; afterwards `.cores` is the average number of cores used by other processes."""

    def __enter__(self) -> "ForeignLoad":
        self._wall, self._busy, self._own = time.perf_counter(), _busy_seconds(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall
        self.others_s = (_busy_seconds() - self._busy) - (time.process_time() - self._own)
        self.cores = self.cores_besides(0.0)

    def cores_besides(self, cpu_s: float) -> float:
        """The cores other processes used, less `cpu_s` seconds of CPU that were part of the measured work (a
        helper process's own)."""
        return max(0.0, (self.others_s - cpu_s) / self.wall_s) if self.wall_s > 0 else 0.0


MAX_FOREIGN_CORES = 0.3  # above this a measurement is re-run


def quiet_samples(measure: Callable[[], T], count: int) -> list[T]:
    """`count` results of `measure()`, each taken while other processes stayed under MAX_FOREIGN_CORES: a
    contaminated one is measured again, within `2 * count` tries in all, after which results are kept as
    they come (never fewer than `count`)."""
    kept: list[T] = []
    for attempt in range(2 * count):
        with ForeignLoad() as load:
            result = measure()
        tries_left = 2 * count - attempt - 1
        if load.cores <= MAX_FOREIGN_CORES or tries_left < count - len(kept):
            kept.append(result)
        if len(kept) == count:
            break
    return kept


def ratio_medians(sweeps: list[list[float]], reference: int = 0) -> list[float]:
    """Column j: the median over sweeps of (column j / column `reference`) of the same sweep, times the median of
    column `reference`. A cost table is read as ratios (a pass over k positions against one over 1, a round
    with drafting against one without), and this machine's passes drift from sweep to sweep (memory state,
    frequency), so medians of the columns taken apart, each from another sweep, spread their ratios further. On
    the Zen 3 EPYC, over windows of 40 sweeps (sd of the ratio; results/cost_estimates_ab.md): a model round's
    drafting against a one-position pass 0.018 that way, 0.014 this way; a four-position pass 0.062 and 0.049."""
    timed = [sweep for sweep in sweeps if sweep[reference] > 0]  # a pass too short for the clock gives no ratio
    if not timed:
        return [statistics.median(column) for column in zip(*sweeps, strict=True)]
    ratios = [[sweep[j] / sweep[reference] for sweep in timed] for j in range(len(sweeps[0]))]
    scale = statistics.median(sweep[reference] for sweep in sweeps)
    return [statistics.median(column) * scale for column in ratios]


def measure_quietly(fn, retries: int = 3):
    """Run `fn()` until other processes stayed under MAX_FOREIGN_CORES; returns (result, foreign cores)."""
    for attempt in range(retries + 1):
        with ForeignLoad() as load:
            result = fn()
        if load.cores <= MAX_FOREIGN_CORES or attempt == retries:
            return result, load.cores
        time.sleep(1.0)
    raise AssertionError("unreachable")
