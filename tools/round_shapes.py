"""What a round of each shape costs inside decoding, against what the hybrid's round costs price it.

The default hybrid (suffix + shipped DSpark, prefix scheduler) and normal decoding decode the same prompts, in
turn; every round's wall time (from one round's record to the next: drafting, the verify pass, verification,
bookkeeping) is filed under its shape: who made the verified drafts (none, the suffix, the model) and how many.
Each shape's median is given in normal decoding's rounds, beside the price `RoundCosts` puts on it (a light
round with k drafts at a pass over k + 1 positions; a model round at its drafting plus that pass).

    python tools/round_shapes.py --limit 3 --temperature 0 --out docs/results --name round_shapes
"""

import argparse
import statistics
import time
from collections import defaultdict

from specdecode.drafters import Drafter, build_drafter
from specdecode.drafters.hybrid import HybridDrafter, round_costs
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine import decode as decode_module
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.engine.stats import DecodeStats
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

BENCHMARKS = ("gsm8k", "humaneval", "mt-bench")


ROUNDS: dict[tuple[str, str, int], list[float]] = defaultdict(list)  # (decoder, proposer, drafts) -> seconds
LABEL = {"decoder": ""}  # the decoder whose rounds are being timed


class RoundClock(DecodeStats):
    """DecodeStats that also files each round's wall time (since the previous round's record) under its shape;
    the decoding loop's stats while this tool runs."""

    def record_round(self, proposed: int, accepted: int, source: str | None = None) -> None:
        now = time.perf_counter()
        last = getattr(self, "_last", None)
        if last is not None:
            ROUNDS[(LABEL["decoder"], source if proposed else "none", proposed)].append(now - last)
        self._last = now
        super().record_round(proposed, accepted, source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=3, help="prompts per benchmark")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="round_shapes")
    args = parser.parse_args()
    target = Target.load()
    model = build_drafter(str(shipped_drafter(target.name)), target)
    costs = round_costs(target, model)
    decoders = {
        "normal": SpeculativeDecoder(target, Drafter(), 0),
        "hybrid": SpeculativeDecoder(target, HybridDrafter(model, costs=costs), 8, scheduler="prefix"),
    }
    params = SamplingParams(temperature=args.temperature)
    decode_module.DecodeStats = RoundClock  # every round of the loop timed
    with ForeignLoad() as load:
        for benchmark in BENCHMARKS:
            for item in load_benchmark(benchmark, args.limit):
                ids = target.encode_chat([{"role": "user", "content": item.turns[0]}])
                for label, decoder in decoders.items():
                    LABEL["decoder"] = label
                    decoder.generate(ids, params, args.max_new_tokens, seed=0)
    normal = statistics.median(ROUNDS[("normal", "none", 0)])
    light = costs.light()
    lines = ["| round | rounds | median ms | in normal rounds | priced (light pass = 1) |", "|---|---:|---:|---:|---:|"]
    runs = []
    for (label, source, drafts), seconds in sorted(ROUNDS.items()):
        if label != "hybrid" or len(seconds) < 5:
            continue
        price = costs.model(drafts) if source == "model" else costs.passes[min(drafts, len(costs.passes) - 1)]
        median = statistics.median(seconds)
        runs.append({"drafter": "default", "checkpoint": None, "benchmark": "+".join(BENCHMARKS),
                     "temperature": args.temperature, "draft_length": 8, "tree": None, "proposer": source,
                     "verified_drafts": drafts, "rounds": len(seconds), "median_s": median,
                     "in_normal_rounds": round(median / normal, 3), "priced": round(price / light, 3)})  # fmt: skip
        lines.append(f"| {source}, {drafts} drafts | {len(seconds)} | {median * 1e3:.2f} | {median / normal:.3f} | "
                     f"{price / light:.3f} |")  # fmt: skip
    table = "\n".join(lines) + f"\n\nA normal decoding round: {normal * 1e3:.2f} ms (median).\n"
    write_results(args.name, args.out, target.name, runs, table, normal_round_s=normal, passes_s=list(costs.passes),
                  drafting_s=costs.drafting, prompts_per_benchmark=args.limit,
                  foreign_load_cores=round(load.cores, 3))  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
