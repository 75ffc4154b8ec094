"""`specdecode bench drafting`: what a drafting round costs, against a one-position target pass.

A round is timed as decoding meets it: each of R requests in its second round (`in_second_round`: the last
round's target features still to project) and right after a one-position target pass at the same context,
which takes the caches (the drafter's weights come from memory again). Within a repetition every R runs once,
after its own target pass, whose time t(1) the round is paired with: this machine's memory speed moves between
processes and seconds (docs/runner.md, stop 50), and a ratio of medians taken in different states would mix
them. The first repetitions warm up (the drafter's context pool grows to its size) and are not kept.

The runner issue (#14) asks for a round of the shipped DSpark drafter (7 drafts) at <= 15% of t(1); the rows
for R > 1 say what batched drafting costs each request (the drafting gate's table prices the same calls).
"""

import statistics
import time

import torch

from specdecode.drafters import Drafter, build_drafter
from specdecode.drafters.base import TargetFeatures, in_second_round
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.premise import check_contexts, paired_ratio, time_pass
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target

WARMUP = 2  # repetitions not kept


def run_drafting_bench(
    target: Target,
    drafter_spec: str,
    requests: list[int],
    contexts: list[int],
    draft_length: int,
    repeats: int,
    out_dir: str,
    name: str = "drafting",
) -> dict:
    if draft_length < 1 or repeats < 1:
        raise SpecDecodeError(f"--draft-length and --repeats must be >= 1, got {draft_length} and {repeats}")
    check_contexts(target, contexts, 1)
    drafter = build_drafter(drafter_spec, target).costliest()
    drafter.check_target(target)
    target.set_capture_layers(drafter.target_layer_ids)
    generator = torch.Generator().manual_seed(0)
    runs, loads = [], []
    for context in contexts:
        ids = torch.randint(100, target.vocab_size, (context + 1,), generator=generator).tolist()
        target.reset()
        out = target.forward(torch.tensor(ids[:context]), logits=False)  # the cache now holds `context` tokens
        features = TargetFeatures(out.layer_hidden, out.last_hidden)
        rounds_ms = {r: [] for r in requests}
        passes_ms = {r: [] for r in requests}
        with ForeignLoad() as load:
            for repetition in range(WARMUP + repeats):
                for r in requests:
                    round_ms, t1 = timed_round(target, drafter, ids, features, r, draft_length, generator)
                    if repetition >= WARMUP:
                        rounds_ms[r].append(round_ms)
                        passes_ms[r].append(t1)
        loads.append(load.cores)
        for r in requests:
            rounds = rounds_ms[r]
            runs.append(
                {
                    "drafter": drafter.name,
                    "checkpoint": None if drafter_spec == "default" else drafter_spec,
                    "draft_length": draft_length,
                    "context": context,
                    "requests": r,
                    "round_ms": round(statistics.median(rounds), 3),
                    "round_ms_range": [round(min(rounds), 3), round(max(rounds), 3)],
                    "per_request_ms": round(statistics.median(rounds) / r, 3),
                    "t1_ms": round(statistics.median(passes_ms[r]), 3),
                    "round_over_t1": round(paired_ratio(rounds, passes_ms[r]), 3),
                    "repeats": repeats,
                }
            )
    table = _table(runs, max(loads))
    write_results(name, out_dir, target.name, runs, table, foreign_load_cores_max=round(max(loads), 3))
    print(table)
    return {"runs": runs}


def timed_round(
    target: Target,
    drafter: Drafter,
    ids: list[int],
    features: TargetFeatures,
    requests: int,
    draft_length: int,
    generator: torch.Generator,
) -> tuple[float, float]:
    """Milliseconds of one drafting round for `requests` requests in their second round (`features` cover
    `ids[:-1]`), and of the one-position target pass right before it, after `len(ids) - 1` cached tokens."""
    states = [in_second_round(drafter, ids, features, draft_length, seed) for seed in range(requests)]
    t1 = time_pass(target, len(ids) - 1, 1, generator)
    start = time.perf_counter()
    type(drafter).propose_batch(states, [ids] * requests, [draft_length] * requests)
    return (time.perf_counter() - start) * 1000, t1


def _table(runs: list[dict], foreign: float) -> str:
    lines = [
        "| context | requests | round ms (range) | per request ms | t(1) ms | round / t(1) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        low, high = r["round_ms_range"]
        lines.append(
            f"| {r['context']} | {r['requests']} | {r['round_ms']:.2f} ({low:.2f}-{high:.2f}) | "
            f"{r['per_request_ms']:.2f} | {r['t1_ms']:.2f} | {r['round_over_t1']:.2f} |"
        )
    first = runs[0]
    return (
        f"A drafting round of {first['drafter']} ({first['draft_length']} drafts a request) for R requests in their "
        "second round, each right after a one-position target pass at the same context; round / t(1) is the median "
        f"of each repetition's round against its own pass. Medians of {first['repeats']} repetitions. Cores used by "
        f"other processes: at most {foreign:.2f}.\n\n" + "\n".join(lines) + "\n"
    )
