"""The request's confidence shift (drafters/confidence_shift.py) on and off, side by side: the default hybrid
with the prefix scheduler against normal decoding, on the first prompts of four benchmarks and the demo's prose
prompt, at T = 0 and T = 1, each prompt's three decodes back to back (normal, shift on, shift off, with the same
seed) and the repeats interleaved. Every T = 0 output is checked against normal decoding.

    python tools/confidence_shift_ab.py --prompts 2 --repeats 2 --name confidence_shift_ab
"""

import argparse
import statistics

from specdecode.demo import DEMO_PROMPTS
from specdecode.drafters import Drafter, build_drafter
from specdecode.drafters.hybrid import HybridDrafter, round_costs
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

BENCHMARKS = ("gsm8k", "humaneval", "mt-bench", "math500")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2, help="per benchmark")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="confidence_shift_ab")
    args = parser.parse_args()
    target = Target.load()
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    models = {}
    for variant in ("shift on", "shift off"):
        models[variant] = build_drafter(str(shipped_drafter(target.name)), target)
        models[variant].adapt_confidences = variant == "shift on"
    costs = round_costs(target, models["shift on"])
    prompts = [("demo", DEMO_PROMPTS[2])]
    prompts += [(b, item.turns[0]) for b in BENCHMARKS for item in load_benchmark(b, args.prompts)]
    ratios = {}
    for repeat in range(args.repeats):
        for temperature in (float(t) for t in args.temperatures.split(",")):
            params = SamplingParams(temperature=temperature)
            for n, (benchmark, text) in enumerate(prompts):
                ids = target.encode(text)
                base = normal.generate(ids, params, args.max_new_tokens, seed=repeat)[0]
                for variant, model in models.items():
                    spec = SpeculativeDecoder(target, HybridDrafter(model, costs=costs), 8, scheduler="prefix")
                    got = spec.generate(ids, params, args.max_new_tokens, seed=repeat)[0]
                    if params.greedy and got.token_ids != base.token_ids:
                        raise SystemExit(f"{benchmark} prompt {n}: the output differs from normal decoding")
                    key = (variant, temperature, benchmark, n)
                    ratios.setdefault(key, []).append(got.stats.tokens_per_s / base.stats.tokens_per_s)
            print(f"repeat {repeat} T={temperature} done", flush=True)
    runs = [
        {"variant": v, "temperature": t, "benchmark": b, "prompt": n, "speedups": [round(x, 3) for x in r]}
        for (v, t, b, n), r in ratios.items()
    ]
    lines = ["| variant | T | median speedup | mean | median per benchmark |", "|---|---:|---:|---:|---|"]
    for variant in models:
        for temperature in sorted({t for _, t, _, _ in ratios}):
            mine = [(b, x) for (v, t, b, _), r in ratios.items() if v == variant and t == temperature for x in r]
            each = ", ".join(
                f"{b} {statistics.median([x for bb, x in mine if bb == b]):.2f}" for b in ("demo", *BENCHMARKS)
            )
            values = [x for _, x in mine]
            median, mean = statistics.median(values), statistics.mean(values)
            lines.append(f"| {variant} | {temperature:g} | {median:.3f}x | {mean:.3f}x | {each} |")
    table = "\n".join(lines) + "\n"
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens)
    print(table)


if __name__ == "__main__":
    main()
