"""Decoders measured side by side: interleaved prompt by prompt and repeat by repeat, medians, re-runs.

Every variant decodes each prompt in turn before the next prompt starts, so a slow spell of the machine
hits all variants alike; measurements disturbed by other processes are re-run (`measure_quietly`), and a
group's tokens/s is its new tokens over the sum of each prompt's median wall time.
"""

import statistics
from collections.abc import Callable

from tqdm import tqdm

from specdecode.engine.decode import Completion, SpeculativeDecoder
from specdecode.engine.stats import DecodeStats
from specdecode.machine import measure_quietly
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams


def measure_side_by_side(
    target: Target,
    decoders: dict[str, SpeculativeDecoder],
    groups: dict[str, list[str]],
    max_new_tokens: int,
    repeats: int,
    desc: str,
) -> tuple[dict[tuple[str, str, int], list[Completion]], float]:
    """Greedy completions per (variant, group, prompt index), one per repeat; and the median foreign load."""
    params = SamplingParams()
    cells: dict[tuple[str, str, int], list[Completion]] = {}
    foreign = []
    jobs = [(g, i, p) for g, prompts in groups.items() for i, p in enumerate(prompts)]
    for group, i, prompt in tqdm(jobs * repeats, desc=desc, unit="prompt"):
        ids = target.encode(prompt)
        for name, decoder in decoders.items():
            decoder.drafter.forget()  # a repeat must not copy its own earlier answer
            completion, cores = measure_quietly(lambda d=decoder, x=ids: d.generate(x, params, max_new_tokens)[0])
            cells.setdefault((name, group, i), []).append(completion)
            foreign.append(cores)
    return cells, round(statistics.median(foreign), 3)


def group_rows(
    cells: dict[tuple[str, str, int], list[Completion]],
    groups: dict[str, list[str]],
    draft_lengths: dict[str, int],
    normal: str = "none",
    extra: Callable[[DecodeStats], dict] | None = None,
) -> list[dict]:
    """One result row per (group, variant): pooled statistics, tokens/s, speedup against `normal` and
    whether every output equals normal decoding's (the temperature-0 promise)."""
    runs = []
    for group, prompts in groups.items():
        n = len(prompts)
        normal_wall = _group_wall(cells, normal, group, n)
        for name, draft_length in draft_lengths.items():
            completions = [cells[(name, group, i)] for i in range(n)]
            new_tokens = sum(c[0].stats.new_tokens for c in completions)
            wall = _group_wall(cells, name, group, n)
            pooled = DecodeStats()
            for c in completions:
                pooled.merge(c[0].stats)
            row = {
                "drafter": name,
                "checkpoint": None,
                "benchmark": group,
                "temperature": 0.0,
                "draft_length": draft_length,
                "tree": None,
                "prompts": n,
                "new_tokens": new_tokens,
                "mean_accepted_length": round(pooled.mean_accepted_length, 3),
                "per_position_acceptance": [round(a, 3) for a in pooled.per_position_acceptance],
                "tokens_per_s": round(new_tokens / wall, 2),
                "speedup": round(normal_wall / wall, 3),
                "identical_to_normal_at_t0": all(
                    c.token_ids == cells[(normal, group, i)][0].token_ids
                    for i in range(n)
                    for c in cells[(name, group, i)]
                ),
                "draft_s_share": round(pooled.draft_s / pooled.wall_s, 3),
            }
            runs.append(row | (extra(pooled) if extra else {}))
    return runs


def _group_wall(cells, name: str, group: str, n_prompts: int) -> float:
    """Sum over prompts of the median wall time across repeats."""
    return sum(statistics.median(c.stats.wall_s for c in cells[(name, group, i)]) for i in range(n_prompts))
