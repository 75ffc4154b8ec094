"""How many draft tokens of each request to verify: DSpark's hardware-aware prefix scheduler (Algorithm 1).

A verify pass over B tokens runs at SPS(B) steps per second (profiled on this machine, `models/sps.py`).
Request r's j-th draft survives with probability a_{r,j} = prod_{i<=j} c_{r,i}, its prefix survival
computed from the calibrated confidences. Verifying l_r drafts of each request yields in expectation
tau = sum_r (1 + sum_{j<=l_r} a_{r,j}) tokens per step, so the batch produces Theta = tau * SPS(B)
tokens per second with B = sum_r (1 + l_r).

Algorithm 1 admits (request, position) pairs by decreasing a and stops at the *first* pair that does not
raise Theta. The early stop is what keeps sampling exact: c_{k+1} depends on the sampled x_k (through the
Markov head), so a search that looks past a non-improving pair lets x_k decide whether x_k itself is
verified (the paper's Appendix A, reproduced in tests/test_scheduler.py).
"""

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.drafters.base import Drafter

SCHEDULER_MODES = ("prefix", "threshold", "fixed")
AUTO = "auto"  # the command line's default: `resolve_scheduler` picks one of them


def has_confidences(drafter: "Drafter") -> bool:
    """Whether the drafter's proposals carry confidences (DSpark's head), which `prefix` and `threshold` need."""
    return drafter.has_confidences


def resolve_scheduler(mode: str, drafter: "Drafter", tree: bool = False) -> str:
    """`auto`: the prefix scheduler for chains of a drafter with confidences (DSpark, and the default drafter, the
    hybrid over it), `fixed` otherwise; other modes as given. Why prefix: it verifies only the drafts that pay on
    this machine, and with its drafting gate a batch skips drafting where it would not pay. Measured on a Zen 4
    EPYC (docs/results/hybrid_zen4.md, serving_zen4.md): the default drafter 2.04x normal decoding at T = 0 under
    it against ~1.9x with fixed chains, and served to 4 / 8 / 16 clients 1.00 / 1.03 / 0.91x against 0.72 /
    0.73 / 0.53x."""
    if mode != AUTO:
        return mode
    return "prefix" if has_confidences(drafter) and not tree else "fixed"


def prefix_survival(confidences: torch.Tensor) -> torch.Tensor:
    """a_j = prod_{i<=j} c_i: the probability that drafts 1..j all survive."""
    return torch.cumprod(confidences.double(), dim=-1)


def schedule_prefix(
    survivals: Sequence[torch.Tensor], steps_per_s: Callable[[int], float], early_stop: bool = True
) -> list[int]:
    """Algorithm 1: verify lengths l_r maximising tau * SPS(B), admitting pairs by decreasing survival.

    `survivals[r]` holds a_{r,1..gamma_r} (non-increasing). `early_stop=False` is the retrospective
    global search the paper warns against; it exists only so the tests can show the bias it causes.
    """
    num_requests = len(survivals)
    pairs = sorted(
        ((float(a), r, j + 1) for r, s in enumerate(survivals) for j, a in enumerate(s.tolist()) if a > 0),
        key=lambda pair: -pair[0],
    )
    lengths, best_lengths = [0] * num_requests, [0] * num_requests
    tokens, expected = num_requests, float(num_requests)
    best = expected * steps_per_s(tokens)
    for survival, r, j in pairs:
        lengths[r] = j
        tokens += 1
        expected += survival
        throughput = expected * steps_per_s(tokens)
        if throughput > best:
            best, best_lengths = throughput, list(lengths)
        elif early_stop:
            break
    return best_lengths


def schedule_threshold(confidences: Sequence[torch.Tensor], threshold: float) -> list[int]:
    """Static threshold: verify drafts up to the first whose own confidence falls below `threshold`."""
    lengths = []
    for c in confidences:
        low = (c < threshold).nonzero()
        lengths.append(int(low[0]) if len(low) else int(c.numel()))
    return lengths


def schedule(
    mode: str,
    confidences: Sequence[torch.Tensor | None],
    proposed: Sequence[int],
    steps_per_s: Callable[[int], float] | None = None,
    threshold: float = 0.5,
) -> list[int]:
    """Verify lengths for a batch under `mode`; drafts without confidences are verified in full."""
    if mode == "fixed":
        return list(proposed)
    if any(c is None for c in confidences):
        raise SpecDecodeError(f"the '{mode}' scheduler needs a drafter with a confidence head (DSpark)")
    if mode == "threshold":
        return schedule_threshold(confidences, threshold)
    if mode == "prefix":
        if steps_per_s is None:
            raise SpecDecodeError("the prefix scheduler needs this machine's SPS(B) table")
        return schedule_prefix([prefix_survival(c) for c in confidences], steps_per_s)
    raise SpecDecodeError(f"unknown scheduler mode '{mode}'; choose one of {', '.join(SCHEDULER_MODES)}")
