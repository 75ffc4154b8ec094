"""`specdecode demo`'s flow, repeated: normal decoding against the default hybrid on the demo's three prompts,
with the hybrid's choices as shipped and as they were before: its model round priced at a pass over all 8
positions (before stop 45), by the model's first drafting call (2.04x a normal step; before stop 43), its
model's yield a mean over ~10 rounds (a 0.9 decay; before stop 42), and also a fixed 16-round wait between
tries (before stop 41); and, to see what the model's rounds add, the hybrid with its model never drafting (its
rounds priced out, no tries) and suffix decoding alone; and the suffix's odds from its shared table alone, as
before stop 54 (not scaled by a request's own factor). One speculative decoder serves the three prompts of a
repeat, as in the demo; each repeat builds fresh ones. Every output is checked against normal greedy decoding.

    python tools/demo_ab.py --max-new-tokens 96 --repeats 5 --out docs/results --name demo_ab
    python tools/demo_ab.py --variants shipped "model never" "suffix alone" --repeats 5 --name demo_zen3
    python tools/demo_ab.py --variants shipped "suffix odds uncalibrated" --repeats 7 --name demo_suffix_calibration
"""

import argparse
import math
import statistics
import sys

from specdecode.demo import DEMO_PROMPTS
from specdecode.drafters import Drafter, build_drafter, yields
from specdecode.drafters.hybrid import HybridDrafter, RoundCosts, round_costs
from specdecode.drafters.shipped import shipped_drafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixSettings
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

# (MAX_EXPLORE_EVERY, PRIOR_ROUNDS, WINDOW): the longest wait between tries, and the yield means' memory; a
# prior of 9 rounds and a window of 10 weigh every round 0.1, as the 0.9 decay before stop 42 did; then the
# model round's price: None as measured (`hybrid.round_costs`), "all" a pass over all 8 positions whatever the
# scheduler verifies, a number that many normal steps, "never" priced out (and never tried), "suffix" no model
SHIPPED = (yields.MAX_EXPLORE_EVERY, yields.PRIOR_ROUNDS, yields.WINDOW)
VARIANTS = {
    "shipped": (*SHIPPED, None),
    "all-positions price": (*SHIPPED, "all"),
    "first-call price": (*SHIPPED, 2.04),
    "10-round mean": (yields.MAX_EXPLORE_EVERY, 9, 10, None),
    "10-round mean, fixed-16 wait": (yields.EXPLORE_EVERY, 9, 10, None),
    "model never": (*SHIPPED, "never"),
    "suffix alone": (*SHIPPED, "suffix"),
    "suffix odds uncalibrated": (*SHIPPED, None),
}
# the suffix's survival odds: the shared table's times a request's own factor (since stop 54), or the table's alone
SUFFIX_CALIBRATION_PRIOR = {"suffix odds uncalibrated": math.inf}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="demo_ab")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants}
    target, params = Target.load(), SamplingParams()
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    model = build_drafter(str(shipped_drafter(target.name)), target)
    costs = round_costs(target, model)
    pricings = {
        None: costs,
        "all": RoundCosts.flat(costs.light(), costs.model(7)),
        "never": RoundCosts.flat(costs.light(), math.inf),
    }
    ratios = {(name, n): [] for name in variants for n in range(1, len(DEMO_PROMPTS) + 1)}
    for _ in range(args.repeats):
        for name, (*settings, price) in variants.items():
            yields.MAX_EXPLORE_EVERY, yields.PRIOR_ROUNDS, yields.WINDOW = settings
            prior = SUFFIX_CALIBRATION_PRIOR.get(name, SuffixSettings.calibration_prior)
            suffix = SuffixDrafter(SuffixSettings(calibration_prior=prior))
            if price == "suffix":
                drafter = suffix
            else:
                priced = pricings.get(price) or RoundCosts.flat(costs.light(), price * costs.light())
                drafter = HybridDrafter(model, suffix, costs=priced)
                if price == "never":
                    drafter.shared.exploration.every = sys.maxsize
            spec = SpeculativeDecoder(target, drafter, draft_length=8, scheduler="prefix")
            for n, prompt in enumerate(DEMO_PROMPTS, 1):
                ids = target.encode(prompt)
                base = normal.generate(ids, params, args.max_new_tokens)[0]
                got = spec.generate(ids, params, args.max_new_tokens)[0]
                if got.token_ids != base.token_ids:
                    raise SystemExit(f"prompt {n}: the speculative output differs from normal decoding")
                ratios[(name, n)].append(got.stats.tokens_per_s / base.stats.tokens_per_s)
    yields.MAX_EXPLORE_EVERY, yields.PRIOR_ROUNDS, yields.WINDOW = SHIPPED
    runs = [
        {"variant": name, "prompt": n, "speedup_median": round(statistics.median(r), 3), "speedups": r}
        for (name, n), r in ratios.items()
    ]
    lines = ["| variant | prompt | median speedup | per repeat |", "|---|---:|---:|---|"]
    for run in runs:
        each = ", ".join(f"{x:.2f}" for x in run["speedups"])
        lines.append(f"| {run['variant']} | {run['prompt']} | {run['speedup_median']:.2f}x | {each} |")
    table = "\n".join(lines) + "\n"
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens)
    print(table)


if __name__ == "__main__":
    main()
