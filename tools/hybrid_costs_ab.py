"""One-request decoding with the default hybrid (suffix + shipped DSpark, prefix scheduler) under pricings of a
round with the model's drafts: as measured since stop 45 (its drafting plus a pass over the drafts the
scheduler verifies, `RoundCosts.model`), as before (a pass over all 8 positions, since stop 43 with the drafting
of a request's second call), and as before stop 43 (2.04 normal steps: the model's first call, which also
projects the whole prompt's target features), interleaved prompt by prompt, each against normal decoding in
the same run. Each pricing keeps one hybrid for the whole run, as a server or `specdecode eval` does. Every
greedy output is checked against normal decoding.

    python tools/hybrid_costs_ab.py --limit 4 --out docs/results --name hybrid_costs_ab
"""

import argparse
import statistics

from mix_cells import BENCHMARKS, decode_mix, summary

from specdecode.drafters import build_drafter
from specdecode.drafters.hybrid import HybridDrafter, RoundCosts, round_costs
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target

FIRST_CALL_RATIO = 2.04  # model round / light round as priced before stop 43 (this machine's cached costs then)


def prices(costs: RoundCosts) -> list[float]:
    """A model round with 3 and with 7 drafts verified, over a round without the model."""
    return [round(costs.model(verified) / costs.light(), 3) for verified in (3, 7)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4, help="prompts per benchmark")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="hybrid_costs_ab")
    args = parser.parse_args()
    target = Target.load()
    model = build_drafter(str(shipped_drafter(target.name)), target)
    costs = round_costs(target, model)
    pricings = {
        "verified drafts (shipped)": costs,
        "all 8 positions (before stop 45)": RoundCosts.flat(costs.light(), costs.model(7)),
        "first call (before stop 43)": RoundCosts.flat(costs.light(), FIRST_CALL_RATIO * costs.light()),
    }
    # one hybrid per pricing for the whole run, as in a server or `specdecode eval`: what it learns of its model's
    # yield carries over from prompt to prompt (each prompt decoded from a drafter that forgot earlier outputs)
    hybrids = {
        (name,): SpeculativeDecoder(target, HybridDrafter(model, costs=costs), 8, scheduler="prefix")
        for name, costs in pricings.items()
    }
    temperatures = [float(t) for t in args.temperatures.split(",")]
    cells, foreign = decode_mix(target, hybrids, temperatures, args.limit, args.max_new_tokens)
    header = "| T | model round priced by (3 / 7 drafts verified) | mean speedup | " + " | ".join(BENCHMARKS)
    header += " | accepted | model rounds |"
    runs, lines = [], [header, "|---|---|---:|" + "---:|" * (len(BENCHMARKS) + 2)]
    for temperature in sorted({t for t, _, _ in cells}):
        for name, pricing in pricings.items():
            each = {b: cells[(temperature, name, b)] for b in BENCHMARKS}
            per_benchmark, mean, accepted = summary(each)
            share = statistics.mean(c[2] for cs in each.values() for c in cs)
            runs.append({"drafter": "default", "checkpoint": None, "benchmark": "mix", "temperature": temperature,
                         "draft_length": 8, "tree": None, "prompts": args.limit * len(BENCHMARKS), "pricing": name,
                         "model_round_over_light_round_at_3_and_7_verified": prices(pricing), "speedup": round(mean, 3),
                         "speedup_mean_of_benchmark_medians": round(mean, 3), "speedup_median_per_benchmark":
                         per_benchmark, "mean_accepted_length": round(accepted, 3), "model_round_share":
                         round(share, 3), "identical_to_normal_at_t0": True if temperature == 0 else None,
                         "cells": each})  # fmt: skip
            row = " | ".join(f"{per_benchmark[b]:.2f}x" for b in BENCHMARKS)
            at3, at7 = prices(pricing)
            lines.append(f"| {temperature:g} | {name} ({at3:.2f}x / {at7:.2f}x) | {mean:.2f}x | {row} | "
                         f"{accepted:.2f} | {share:.0%} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens,
                  prompts_per_benchmark=args.limit, passes_s=list(costs.passes), drafting_s=costs.drafting,
                  foreign_load_cores_max=round(foreign, 3))  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
