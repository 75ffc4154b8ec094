"""End to end at T = 1: block verification in one C++ call (csrc/sampling.cpp `block_verify`, stop 65) against the
ATen steps it replaced, the two paths alternating prompt by prompt in one process (which goes first alternates too).
The shipped DSpark drafter alone verifies chains of 7 (no gate, no suffix index, nothing timed decides a round), a
fresh copy each run and the same seed on both paths: the same uniform numbers, the same kept drafts and the same
text, so the ratio of each prompt's tokens/s is the verification's own cost (the outputs are compared).

    python tools/block_verify_ab.py --limit 4 --name block_verify_e2e_ab
"""

import argparse
import statistics

from specdecode import verify
from specdecode.drafters import build_drafter
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.hybrid_bench import MIX
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

PATHS = ("C++ call", "ATen steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4, help="prompts a benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="block_verify_e2e_ab")
    args = parser.parse_args()
    target = Target.load()
    prompts = [
        (name, target.encode_chat([{"role": "user", "content": item.turns[0]}]))
        for name in MIX
        for item in load_benchmark(name, limit=args.limit)
    ]
    folder = str(shipped_drafter(target.name))
    params = SamplingParams(temperature=args.temperature)
    SpeculativeDecoder(target, build_drafter(folder, target), 7).generate(prompts[0][1], params, 32)  # warm-up
    cpp_takes = verify.cpp_takes
    runs = []
    with ForeignLoad() as load:
        for i, (name, prompt) in enumerate(prompts):
            rates, texts = {}, {}
            for path in PATHS if i % 2 else PATHS[::-1]:
                verify.cpp_takes = cpp_takes if path == PATHS[0] else lambda values: False
                decoder = SpeculativeDecoder(target, build_drafter(folder, target), 7)
                completion = decoder.generate(prompt, params, args.max_new_tokens, seed=i)[0]
                rates[path], texts[path] = len(completion.token_ids) / completion.stats.wall_s, completion.token_ids
            verify.cpp_takes = cpp_takes
            rounded = {p: round(r, 2) for p, r in rates.items()}
            runs.append({"benchmark": name, "prompt": i, "identical": texts[PATHS[0]] == texts[PATHS[1]]} | rounded)
    ratios = [run[PATHS[0]] / run[PATHS[1]] for run in runs]
    rows = [
        f"| {b} | {statistics.median(r[PATHS[1]] for r in runs if r['benchmark'] == b):.1f} | "
        f"{statistics.median(r[PATHS[0]] for r in runs if r['benchmark'] == b):.1f} | "
        f"{statistics.median(x for r, x in zip(runs, ratios, strict=True) if r['benchmark'] == b):.3f} |"
        for b in MIX
    ]
    table = (
        f"The shipped DSpark drafter alone, chains of 7, at T = {args.temperature:g}, {args.limit} prompts a "
        f"benchmark, {args.max_new_tokens} new tokens; block verification in one C++ call or in ATen steps, "
        f"alternating prompt by prompt; outputs identical on {sum(r['identical'] for r in runs)} of {len(runs)} "
        f"prompts. Median tokens/s and the median per-prompt ratio; all {len(runs)} prompts: "
        f"**{statistics.median(ratios):.3f}x** (range {min(ratios):.2f}-{max(ratios):.2f}). Cores used by other "
        f"processes: at most {load.cores:.2f}.\n\n"
        "| benchmark | ATen steps tok/s | C++ call tok/s | C++ / ATen |\n|---|---:|---:|---:|\n"
        + "\n".join(rows)
        + "\n"
    )
    write_results(
        args.name, args.out, target.name, runs, table, ratio_median=round(statistics.median(ratios), 4),
        foreign_load_cores_max=round(load.cores, 3),
    )  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
