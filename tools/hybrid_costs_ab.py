"""One-request decoding with the default hybrid (suffix + shipped DSpark, prefix scheduler) under pricings of a
round with the model's drafts: as measured since stop 45 (its drafting plus a pass over the drafts the
scheduler verifies, `RoundCosts.model`; since stop 55 from 40 sweeps of ratio medians), with the costs that
stop 54 had cached (five sweeps of column medians, an outlier of that estimate: the drafting at 0.56
one-position passes, a four-position pass at 1.71, where long runs of sweeps measure ~0.49 and ~1.43), as before
stop 45 (a pass over all 8 positions, since stop 43 with the drafting of a request's second call), and as before
stop 43 (2.04 normal steps: the model's first call, which also projects the whole prompt's target features),
interleaved prompt by prompt, each against normal decoding in the same run; and, since stop 57, with a sampled
round's costs measured as such (`measured`) against the greedy table at every temperature as before, and with the
model never drafting. Each pricing keeps one hybrid for the whole run, as a server or `specdecode eval` does.
Every greedy output is checked against normal decoding.

    python tools/hybrid_costs_ab.py --limit 4 --out docs/results --name hybrid_costs_ab
    python tools/hybrid_costs_ab.py --limit 4 --pricings "measured,stop 54 cache" --name cost_outlier_ab
    python tools/hybrid_costs_ab.py --limit 4 --temperatures 1 --pricings "measured,greedy at T > 0,model never" \
        --name sampled_costs_ab
"""

import math
import statistics

from mix_cells import BENCHMARKS, decode_mix, mix_parser, summary

from specdecode.drafters import build_drafter
from specdecode.drafters.hybrid import HybridDrafter, RoundCosts, round_costs
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target

FIRST_CALL_RATIO = 2.04  # model round / light round as priced before stop 43 (this machine's cached costs then)
# stop 54's cached round costs on the Zen 3 EPYC, in one-position passes: passes over 1 .. 8 positions, drafting
STOP54_PASSES = (1.0, 1.158, 1.436, 1.714, 2.135, 2.588, 1.966, 1.892)
STOP54_DRAFTING = 0.563


def prices(costs: RoundCosts) -> list[float]:
    """A model round with 3 and with 7 drafts verified, over a round without the model."""
    return [round(costs.model(verified) / costs.light(), 3) for verified in (3, 7)]


def main() -> None:
    parser = mix_parser(__doc__, "hybrid_costs_ab")
    parser.add_argument("--pricings", default="measured,stop 54 cache,all 8,first call", help="which, comma-separated")
    args = parser.parse_args()
    target = Target.load()
    model = build_drafter(str(shipped_drafter(target.name)), target)
    costs, sampled = round_costs(target, model), round_costs(target, model, sampled=True)
    light = costs.light()
    pricings = {  # None: the hybrid's own tables, greedy or sampled as each request's rounds are
        "measured": ("verified drafts, greedy or sampled rounds (shipped)", None),
        "greedy at T > 0": ("greedy rounds' costs at every temperature (before stop 57)", costs),
        "model never": ("the model never drafting", RoundCosts.flat(light, math.inf)),
        "stop 54 cache": (
            "stop 54's cached costs",
            RoundCosts(tuple(r * light for r in STOP54_PASSES), STOP54_DRAFTING * light),
        ),
        "all 8": ("all 8 positions (before stop 45)", RoundCosts.flat(light, costs.model(7))),
        "first call": ("first call (before stop 43)", RoundCosts.flat(light, FIRST_CALL_RATIO * light)),
    }
    pricings = {p.strip(): pricings[p.strip()] for p in args.pricings.split(",")}
    # one hybrid per pricing for the whole run, as in a server or `specdecode eval`: what it learns of its model's
    # yield carries over from prompt to prompt (each prompt decoded from a drafter that forgot earlier outputs)
    hybrids = {
        (name,): SpeculativeDecoder(target, HybridDrafter(model, costs=pricing), 8, scheduler="prefix")
        for name, (_, pricing) in pricings.items()
    }
    cells, foreign = decode_mix(target, hybrids, args.temperatures, args.limit, args.max_new_tokens)
    header = "| T | model round priced by (3 / 7 drafts verified) | mean speedup | " + " | ".join(BENCHMARKS)
    header += " | accepted | model rounds |"
    runs, lines = [], [header, "|---|---|---:|" + "---:|" * (len(BENCHMARKS) + 2)]
    for temperature in sorted({t for t, _, _ in cells}):
        for name, (label, pricing) in pricings.items():
            pricing = pricing or (sampled if temperature > 0 else costs)
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
            lines.append(f"| {temperature:g} | {label} ({at3:.2f}x / {at7:.2f}x) | {mean:.2f}x | {row} | "
                         f"{accepted:.2f} | {share:.0%} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens,
                  prompts_per_benchmark=args.limit, passes_s=list(costs.passes), drafting_s=costs.drafting,
                  sampled_passes_s=list(sampled.passes), sampled_drafting_s=sampled.drafting,
                  foreign_load_cores_max=round(foreign, 3))  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
