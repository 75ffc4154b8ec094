"""Foreign load: how many cores other processes used while we measured, to reject contaminated timings.

The machine is shared; another process taking a core can make a step 10-30x slower. Every timed
measurement runs inside `ForeignLoad`, and benchmarks re-run the ones where others were busy.
"""

import os
import time
from pathlib import Path

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
        wall = time.perf_counter() - self._wall
        others = (_busy_seconds() - self._busy) - (time.process_time() - self._own)
        self.cores = max(0.0, others / wall) if wall > 0 else 0.0


MAX_FOREIGN_CORES = 0.3  # above this a measurement is re-run


def measure_quietly(fn, retries: int = 3):
    """Run `fn()` until other processes stayed under MAX_FOREIGN_CORES; returns (result, foreign cores)."""
    for attempt in range(retries + 1):
        with ForeignLoad() as load:
            result = fn()
        if load.cores <= MAX_FOREIGN_CORES or attempt == retries:
            return result, load.cores
        time.sleep(1.0)
    raise AssertionError("unreachable")
