"""SPS(B): the verify pass's steps per second at B tokens, profiled on the machine the engine runs on.

The scheduler needs the real cost curve, not a model of it: on this CPU a pass over 4 positions costs
~1.5x a one-token step and the curve has kernel-switch steps (MKL below 4 rows, oneDNN above). The
table is measured once per (target, kernel, machine, batch rows), takes a few seconds, and is cached
under `$XDG_CACHE_HOME/specdecode/sps/`. Between profiled sizes the step time is interpolated linearly;
beyond the last size it is extrapolated with the last segment's slope.
"""

import bisect
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.errors import SpecDecodeError
from specdecode.machine import machine_info, measurement_file, quiet_samples, ratio_medians
from specdecode.models.linear import kernels_digest
from specdecode.paths import write_text_atomically

if TYPE_CHECKING:
    from specdecode.models.target import Target

DEFAULT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class StepCostTable:
    """Measured seconds of one verify pass at each profiled token count, and what they were measured on."""

    tokens: list[int]
    seconds: list[float]
    key: dict

    def step_seconds(self, num_tokens: int) -> float:
        if num_tokens < 1:
            raise SpecDecodeError(f"a verify pass holds at least one token, not {num_tokens}")
        i = bisect.bisect_left(self.tokens, num_tokens)
        if i < len(self.tokens) and self.tokens[i] == num_tokens:
            return self.seconds[i]
        lo = min(max(i - 1, 0), len(self.tokens) - 2)  # the segment to interpolate or extrapolate along
        (t0, t1), (s0, s1) = self.tokens[lo : lo + 2], self.seconds[lo : lo + 2]
        return max(s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0), min(self.seconds))

    def steps_per_s(self, num_tokens: int) -> float:
        return 1.0 / self.step_seconds(num_tokens)

    def to_dict(self) -> dict:
        return asdict(self)


def profile_steps(
    run_pass: Callable[[int], None],
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    reps: int = 5,
    prepare: Callable[[int], None] | None = None,
) -> list[float]:
    """Seconds of `run_pass(B)` at each size over `reps` sweeps of every size, sizes interleaved so drift hits
    all of them alike: the first size's median, the others at their median ratio to it within a sweep
    (`ratio_medians`). A sweep during which other processes were busy is measured again (`quiet_samples`).
    `prepare(B)`, untimed, runs before each pass (state that a pass uses up)."""
    if len(sizes) < 2 or list(sizes) != sorted(set(sizes)):
        raise SpecDecodeError(f"profile sizes must be at least two increasing token counts, got {sizes}")
    prepare = prepare or (lambda b: None)
    prepare(sizes[-1])
    run_pass(sizes[-1])  # warm-up: allocator and kernel caches

    def sweep() -> dict[int, float]:
        seconds = {}
        for b in sizes:
            prepare(b)
            start = time.perf_counter()
            run_pass(b)
            seconds[b] = time.perf_counter() - start
        return seconds

    sweeps = quiet_samples(sweep, reps)
    return ratio_medians([[s[b] for b in sizes] for s in sweeps])


def load_or_profile(
    what: str,
    key: dict,
    run_pass: Callable[[int], None],
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    reps: int = 5,
    refresh: bool = False,
    prepare: Callable[[int], None] | None = None,
) -> StepCostTable:
    """The cached table for `key` (plus this machine's identity and the runner kernels' build), profiling it
    first when missing (`profile_steps`), which a line names by `what` it measures."""
    key = {**key, "machine": machine_info(), "kernels": kernels_digest(), "sizes": list(sizes), "sweeps": reps}
    key["estimate"] = "ratio medians"
    path = measurement_file("sps", key)
    if path.exists() and not refresh:
        try:
            return StepCostTable(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            pass  # a damaged cache entry is simply measured again
    print(f"specdecode: measuring {what} on this machine (once)", file=sys.stderr)
    table = StepCostTable(tokens=list(sizes), seconds=profile_steps(run_pass, sizes, reps, prepare), key=key)
    write_text_atomically(path, json.dumps(table.to_dict(), indent=1) + "\n")
    return table


def profile_target(
    target: "Target", context: int = 256, sizes: tuple[int, ...] = DEFAULT_SIZES, reps: int = 15, refresh: bool = False
) -> StepCostTable:
    """SPS(B) of one request's verify pass: B new tokens after `context` cached ones (the cache is reset). Fifteen
    sweeps (~6 s for SmolLM2 on 2 cores, once per machine): with five, a pass over three positions came out at
    1.10x one on the Zen 3 EPYC where sweeps around it measured 1.17-1.22x, and suffix drafts priced by it lost
    at temperature 1."""
    prefilled = False

    def run_pass(num_tokens: int) -> None:
        nonlocal prefilled
        if not prefilled:
            target.reset()
            target.forward(torch.zeros(context, dtype=torch.long), logits=False)
            prefilled = True
        target.forward(torch.zeros(num_tokens, dtype=torch.long))
        target.rollback(context)

    key = {"target": target.name, "kernel": target.kernel, "dtype": str(target.dtype), "context": context, "rows": 1}
    table = load_or_profile("one request's verify-pass costs", key, run_pass, sizes, reps, refresh)
    if prefilled:
        target.reset()
    return table
