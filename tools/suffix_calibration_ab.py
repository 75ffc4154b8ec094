"""Suffix decoding's survival odds scaled by a request's own factor (`suffix.RequestCalibration`, since stop 54)
against the shared acceptance table's odds alone, on the five-benchmark mix: suffix decoding alone and the
default hybrid (suffix + the shipped DSpark, prefix scheduler), every decode against normal decoding of the same
prompt just before, the variants interleaved prompt by prompt. Every greedy output is checked against normal
decoding.

    python tools/suffix_calibration_ab.py --limit 4 --out docs/results --name suffix_calibration_ab
"""

import math

from mix_cells import decode_mix, mix_parser, report

from specdecode.drafters import build_drafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.shipped import shipped_drafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixSettings
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target

ODDS = {"calibrated per request": SuffixSettings.calibration_prior, "shared table alone": math.inf}


def main() -> None:
    parser = mix_parser(__doc__, "suffix_calibration_ab")
    args = parser.parse_args()
    target = Target.load()
    model = build_drafter(str(shipped_drafter(target.name)), target)
    decoders = {}
    for odds, prior in ODDS.items():
        suffix = SuffixDrafter(SuffixSettings(calibration_prior=prior))
        decoders[(odds, "suffix alone")] = SpeculativeDecoder(target, suffix, 8, scheduler="prefix")
        hybrid = HybridDrafter(model, SuffixDrafter(SuffixSettings(calibration_prior=prior)))
        decoders[(odds, "default hybrid, prefix")] = SpeculativeDecoder(target, hybrid, 8, scheduler="prefix")
    cells, foreign = decode_mix(target, decoders, args.temperatures, args.limit, args.max_new_tokens)
    runs, table = report(cells, decoders, "suffix odds")
    write_results(args.name, args.out, target.name, runs, table, max_new_tokens=args.max_new_tokens,
                  prompts_per_benchmark=args.limit, foreign_load_cores_max=round(foreign, 3))  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
