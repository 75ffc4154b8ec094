"""The shipped DSpark drafter run over blocks shorter than it was trained on (anchor + fewer mask slots, a draft
per slot): does cutting the block, whose slots attend to each other both ways, cost the first drafts their
acceptance, and does the cheaper drafting pay inside the default hybrid (prefix scheduler, each block length
priced by its own measured round)? On the five-benchmark mix, every decode against normal decoding of the same
prompt just before, the variants interleaved prompt by prompt. Every greedy output is checked against normal
decoding.

    python tools/block_length_ab.py --limit 4 --out docs/results --name block_length_ab
"""

import dataclasses

from mix_cells import decode_mix, mix_parser, report

from specdecode.drafters import build_drafter
from specdecode.drafters.hybrid import HybridDrafter, round_costs
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target


def main() -> None:
    parser = mix_parser(__doc__, "block_length_ab")
    parser.add_argument("--blocks", type=lambda s: [int(b) for b in s.split(",")], default="7,5,4")
    parser.add_argument("--alone", type=int, default=4, help="drafts verified per round by the drafter alone")
    args = parser.parse_args()
    target = Target.load()
    path = str(shipped_drafter(target.name))
    decoders, columns = {}, {}
    for block in args.blocks:
        drafter = build_drafter(path, target)
        drafter.config = dataclasses.replace(drafter.config, block_size=block)
        costs = round_costs(target, drafter)
        setting = f"block of {block}"
        columns[setting] = {"drafting / t(1)": costs.drafting / costs.light()}
        if block >= args.alone:
            decoders[(setting, f"dspark alone, {args.alone} drafts")] = SpeculativeDecoder(target, drafter, args.alone)
        hybrid = HybridDrafter(drafter, costs=costs)
        decoders[(setting, "default hybrid, prefix")] = SpeculativeDecoder(target, hybrid, 8, scheduler="prefix")
    cells, foreign = decode_mix(target, decoders, args.temperatures, args.limit, args.max_new_tokens)
    runs, table = report(cells, decoders, "drafter's block", columns)
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens,
                  prompts_per_benchmark=args.limit, foreign_load_cores_max=round(foreign, 3))  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
