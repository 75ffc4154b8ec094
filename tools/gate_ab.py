"""One-request decoding of benchmark prompts: fixed chains, the prefix scheduler with the drafting gate (its
yield means as shipped, and with the short memory of before stop 42), and the prefix scheduler without the
gate, interleaved prompt by prompt, each against normal decoding in the same run (`mix_cells.decode_mix`). Every
greedy output is checked against normal decoding.

    python tools/gate_ab.py --drafter specdecode/drafters/shipped/smollm2-135m --limit 3 --out docs/results
"""

import statistics

from mix_cells import BENCHMARKS, decode_mix, mix_parser

from specdecode.drafters import build_drafter, yields
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target

# (scheduler, gate, (PRIOR_ROUNDS, WINDOW) of the gate's yield means); (4, 5) weighs every round 0.2, as the
# 0.8 decay before stop 42 did
VARIANTS = {
    "chain": ("fixed", False, None),
    "prefix + gate": ("prefix", True, (yields.PRIOR_ROUNDS, yields.WINDOW)),
    "prefix + gate, short memory": ("prefix", True, (4, 5)),
    "prefix, no gate": ("prefix", False, None),
}


def main() -> None:
    parser = mix_parser(__doc__, "gate_ab", limit=3)
    parser.add_argument("--drafter", default="specdecode/drafters/shipped/smollm2-135m")
    parser.add_argument("--draft-length", type=int, default=7)
    args = parser.parse_args()
    target = Target.load()
    decoders = {
        (name,): SpeculativeDecoder(
            target, build_drafter(args.drafter, target), args.draft_length, scheduler=scheduler, gate=gate
        )
        for name, (scheduler, gate, _) in VARIANTS.items()
    }
    shipped = VARIANTS["prefix + gate"][2]

    def memory(key: tuple) -> None:  # the gate's yield means, as each variant has them
        yields.PRIOR_ROUNDS, yields.WINDOW = VARIANTS[key[0]][2] or shipped

    try:
        cells, _ = decode_mix(target, decoders, args.temperatures, args.limit, args.max_new_tokens, before=memory)
    finally:
        yields.PRIOR_ROUNDS, yields.WINDOW = shipped
    ratios = {(name, t, b): [c[0] for c in cs] for (t, name, b), cs in cells.items()}
    header = "| T | variant | median speedup | " + " | ".join(BENCHMARKS) + " |"
    runs, lines = [], [header, "|---|---|---:|" + "---:|" * len(BENCHMARKS)]
    for temperature in sorted({t for _, t, _ in ratios}):
        for name in VARIANTS:
            each = {b: ratios[(name, temperature, b)] for b in BENCHMARKS}
            overall = statistics.median([r for rs in each.values() for r in rs])
            per_benchmark = {b: round(statistics.median(rs), 3) for b, rs in each.items()}
            runs.append({"temperature": temperature, "variant": name, "speedup_median": round(overall, 3),
                         "speedup_median_per_benchmark": per_benchmark, "speedups": each})  # fmt: skip
            row = " | ".join(f"{per_benchmark[b]:.2f}x" for b in BENCHMARKS)
            lines.append(f"| {temperature:g} | {name} | {overall:.2f}x | {row} |")
    table = "\n".join(lines) + "\n"
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens,
                  draft_length=args.draft_length, prompts_per_benchmark=args.limit)  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
