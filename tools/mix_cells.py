"""The five-benchmark mix decoded by several speculative decoders, each against normal decoding of the same prompt
just before, the decoders interleaved prompt by prompt (shared by the A/B tools that compare decoders on it)."""

import argparse
import statistics
from collections.abc import Callable

from specdecode.drafters import Drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

BENCHMARKS = ("gsm8k", "math500", "aime25", "humaneval", "mt-bench")


Cell = tuple[float, float, float]  # speedup over normal decoding, mean accepted length, model's share of rounds


def mix_parser(doc: str, name: str, limit: int = 4) -> argparse.ArgumentParser:
    """The arguments every tool decoding the mix takes (its own are added after): prompts per benchmark, the
    temperatures (parsed into a list of floats), tokens per answer, and where and under what name results go."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--limit", type=int, default=limit, help="prompts per benchmark")
    parser.add_argument("--temperatures", type=lambda s: [float(t) for t in s.split(",")], default="0,1")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default=name)
    return parser


def decode_mix(
    target: Target,
    decoders: dict,
    temperatures: list[float],
    limit: int,
    max_new_tokens: int,
    before: Callable[[tuple], None] | None = None,
) -> tuple[dict[tuple, list[Cell]], float]:
    """{(temperature, *key, benchmark): [a `Cell` per prompt]} for every decoder of `decoders` ({key tuple:
    SpeculativeDecoder}), and the cores other processes used meanwhile. The model's share is of the rounds
    whose verified drafts a hybrid's model made (0 for other drafters). Every drafter forgets earlier outputs
    before each prompt, and `before(key)` runs before each of its decodes (a variant's module settings); every
    greedy output is checked against normal decoding."""
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    items = [(b, item) for b in BENCHMARKS for item in load_benchmark(b, limit)]
    cells: dict[tuple, list[Cell]] = {}
    with ForeignLoad() as load:
        for temperature in temperatures:
            params = SamplingParams(temperature=temperature)
            for benchmark, item in items:
                ids = target.encode_chat([{"role": "user", "content": item.turns[0]}])
                base = normal.generate(ids, params, max_new_tokens, seed=0)[0]
                for key, decoder in decoders.items():
                    decoder.drafter.forget()  # the prompt was decoded before, at another temperature
                    if before:
                        before(key)
                    got = decoder.generate(ids, params, max_new_tokens, seed=0)[0]
                    if params.greedy and got.token_ids != base.token_ids:
                        raise SystemExit(f"{key} on {benchmark}/{item.id}: the output differs from normal decoding")
                    stats = got.stats
                    model_share = stats.proposers.get("model", 0) / max(1, len(stats.accepted_lengths))
                    cell = (stats.tokens_per_s / base.stats.tokens_per_s, stats.mean_accepted_length, model_share)
                    cells.setdefault((temperature, *key, benchmark), []).append(cell)
    return cells, load.cores


def report(
    cells: dict[tuple, list[Cell]],
    decoders: dict[tuple, SpeculativeDecoder],
    variant: str,
    extra: dict[str, dict[str, float]] | None = None,
) -> tuple[list[dict], str]:
    """The run records (`shared/RESULTS.md`) and the markdown table of `decode_mix`'s cells, for decoders keyed
    (variant, decoder label); `variant` titles the compared setting's column, `extra` adds columns per variant."""
    extra = extra or {}
    columns = list(next(iter(extra.values()), {}))
    lines = [
        f"| T | decoder | {variant} | "
        + "".join(f"{c} | " for c in columns)
        + "accepted | mean speedup | "
        + " | ".join(BENCHMARKS)
        + " |",
        "|---:|---|---|" + "---:|" * (len(columns) + 2 + len(BENCHMARKS)),
    ]
    runs = []
    for temperature in sorted({key[0] for key in cells}):
        for (setting, label), decoder in decoders.items():
            each = {b: cells[(temperature, setting, label, b)] for b in BENCHMARKS}
            per_benchmark, mean, accepted = summary(each)
            fields = extra.get(setting, {})
            runs.append({"drafter": label, "checkpoint": None, "benchmark": "mix", "temperature": temperature,
                         "draft_length": decoder.draft_length, "tree": None,
                         "prompts": sum(len(cs) for cs in each.values()), "variant": setting,
                         **fields, "mean_accepted_length": round(accepted, 3), "speedup": round(mean, 3),
                         "speedup_median_per_benchmark": per_benchmark,
                         "identical_to_normal_at_t0": True if temperature == 0 else None, "cells": each})  # fmt: skip
            values = "".join(f"{fields[c]:.2f} | " for c in columns)
            row = " | ".join(f"{per_benchmark[b]:.2f}x" for b in BENCHMARKS)
            lines.append(f"| {temperature:g} | {label} | {setting} | {values}{accepted:.2f} | {mean:.2f}x | {row} |")
    return runs, "\n".join(lines) + "\n"


def summary(cells: dict[str, list[Cell]]) -> tuple[dict[str, float], float, float]:
    """Per benchmark the median speedup, their mean, and the mean accepted length, of {benchmark: cells}."""
    per_benchmark = {b: round(statistics.median(c[0] for c in cs), 3) for b, cs in cells.items()}
    accepted = statistics.mean(c[1] for cs in cells.values() for c in cs)
    return per_benchmark, statistics.mean(per_benchmark.values()), accepted
