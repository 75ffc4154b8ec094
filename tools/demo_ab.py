"""`specdecode demo`'s flow, repeated: normal decoding against the default hybrid on the demo's three prompts,
with the drafting gate's exploration backoff (`MAX_EXPLORE_EVERY`) as shipped and with a fixed 16-round wait
(the code before stop 41). One speculative decoder serves the three prompts of a repeat, as in the demo; each
repeat builds fresh ones. Every output is checked against normal greedy decoding.

    python tools/demo_ab.py --max-new-tokens 96 --repeats 5 --out docs/results --name demo_ab
"""

import argparse
import statistics

from specdecode.demo import DEMO_PROMPTS
from specdecode.drafters import Drafter, build_drafter
from specdecode.engine import drafting_gate
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

WAITS = {"backoff": drafting_gate.MAX_EXPLORE_EVERY, "fixed-16": drafting_gate.EXPLORE_EVERY}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="demo_ab")
    args = parser.parse_args()
    target, params = Target.load(), SamplingParams()
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    ratios = {(wait, n): [] for wait in WAITS for n in range(1, len(DEMO_PROMPTS) + 1)}
    for _ in range(args.repeats):
        for wait, limit in WAITS.items():
            drafting_gate.MAX_EXPLORE_EVERY = limit
            spec = SpeculativeDecoder(target, build_drafter("default", target), draft_length=8, scheduler="prefix")
            for n, prompt in enumerate(DEMO_PROMPTS, 1):
                ids = target.encode(prompt)
                base = normal.generate(ids, params, args.max_new_tokens)[0]
                got = spec.generate(ids, params, args.max_new_tokens)[0]
                if got.token_ids != base.token_ids:
                    raise SystemExit(f"prompt {n}: the speculative output differs from normal decoding")
                ratios[(wait, n)].append(got.stats.tokens_per_s / base.stats.tokens_per_s)
    drafting_gate.MAX_EXPLORE_EVERY = WAITS["backoff"]
    runs = [
        {"exploration": wait, "prompt": n, "speedup_median": round(statistics.median(r), 3), "speedups": r}
        for (wait, n), r in ratios.items()
    ]
    lines = ["| exploration | prompt | median speedup | per repeat |", "|---|---:|---:|---|"]
    for run in runs:
        each = ", ".join(f"{x:.2f}" for x in run["speedups"])
        lines.append(f"| {run['exploration']} | {run['prompt']} | {run['speedup_median']:.2f}x | {each} |")
    table = "\n".join(lines) + "\n"
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens)
    print(table)


if __name__ == "__main__":
    main()
