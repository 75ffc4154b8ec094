"""The shipped DSpark drafter on its float32 weights and inputs against its weights rounded to Q8_0 or Q4_1 rows and
its inputs to 8 bits (what `frozen` gives it where the target's plan took 8-bit inputs: Q8_0 until stop 60, then
Q4_1), on the five-benchmark mix:
the drafter alone at a fixed draft length (its acceptance: does the rounding cost drafts?) and inside the
default hybrid with the prefix scheduler (each variant priced by its own measured round), every decode against
normal decoding of the same prompt just before, the variants interleaved prompt by prompt. Every greedy output
is checked against normal decoding.

    python tools/drafter_rounding_ab.py --limit 4 --out docs/results --name drafter_rounding_ab
    python tools/drafter_rounding_ab.py --roundings Q8_0 Q4_1 --name drafter_q4_1_ab
"""

from mix_cells import decode_mix, mix_parser, report

from specdecode.drafters.checkpoint import frozen, load_model
from specdecode.drafters.dspark import BlockDrafter
from specdecode.drafters.hybrid import HybridDrafter, round_costs
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target

VARIANTS = {  # --roundings choice -> the label its rows carry in the table
    "float32": "float32 weights and inputs",
    "Q8_0": "Q8_0 rows, 8-bit inputs",
    "Q4_1": "Q4_1 rows, 8-bit inputs",
}


def main() -> None:
    parser = mix_parser(__doc__, "drafter_rounding_ab")
    parser.add_argument("--draft-length", type=int, default=7)
    parser.add_argument("--roundings", nargs="+", choices=list(VARIANTS), default=["float32", "Q8_0"])
    args = parser.parse_args()
    target = Target.load()
    if not target.eight_bit_inputs:
        raise SystemExit("the target's plan runs no linear on 8-bit inputs on this machine: nothing to compare")
    path = shipped_drafter(target.name)
    decoders, round_ms = {}, {}
    for rows in args.roundings:
        rounding, kwargs = VARIANTS[rows], {"eight_bit_inputs": False} if rows == "float32" else {"rows": rows}
        kind, model = load_model(path, target)
        drafter = BlockDrafter(frozen(model, kind, target, **kwargs))
        costs = round_costs(target, drafter)
        round_ms[rounding] = round(costs.drafting * 1000, 3)
        decoders[(rounding, "dspark alone")] = SpeculativeDecoder(target, drafter, args.draft_length)
        hybrid = HybridDrafter(drafter, costs=costs)
        decoders[(rounding, "default hybrid, prefix")] = SpeculativeDecoder(target, hybrid, 8, scheduler="prefix")
    cells, foreign = decode_mix(target, decoders, args.temperatures, args.limit, args.max_new_tokens)
    runs, table = report(cells, decoders, "drafter's linears", {r: {"round ms": ms} for r, ms in round_ms.items()})
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens,
                  prompts_per_benchmark=args.limit, foreign_load_cores_max=round(foreign, 3))  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
