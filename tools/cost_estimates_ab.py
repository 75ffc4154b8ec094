"""How far a measured round-cost table strays from one measurement to the next: many sweeps of the hybrid's round
costs (the shipped DSpark drafting 7 tokens, passes over 1 .. 8 positions; `hybrid.round_cost_sweeps`) cut into
windows of 5 and of 40 sweeps, each window estimated two ways: every column's own median (as before stop 55), and
the one-position pass's median with every other column at its median ratio to that pass within a sweep
(`machine.ratio_medians`). The table gives, per estimate and window size, the spread over windows of what the
decisions read: the drafting and a four- and an eight-position pass in one-position passes.

    python tools/cost_estimates_ab.py --seconds 150 --out docs/results --name cost_estimates_ab
"""

import argparse
import statistics
import time

from specdecode.drafters import build_drafter
from specdecode.drafters.hybrid import round_cost_sweeps
from specdecode.drafters.shipped import shipped_drafter
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad, ratio_medians
from specdecode.models.target import Target

COLUMNS = {"drafting": 0, "pass(4)": 4, "pass(8)": 8}  # sweep columns, in one-position passes (column 1)
WINDOWS = (5, 40)


def column_medians(sweeps: list[list[float]]) -> list[float]:
    return [statistics.median(column) for column in zip(*sweeps, strict=True)]


ESTIMATES = {"column medians": column_medians, "ratio medians": lambda sweeps: ratio_medians(sweeps, reference=1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150, help="how long to keep sweeping")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="cost_estimates_ab")
    args = parser.parse_args()
    target = Target.load()
    model = build_drafter(str(shipped_drafter(target.name)), target)
    sweeps: list[list[float]] = []
    with ForeignLoad() as load:
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            sweeps += round_cost_sweeps(target, model, context=128, reps=40)
    whole = ratio_medians(sweeps, reference=1)
    runs, lines = [], ["| estimate | sweeps a window | windows | " + " | ".join(f"{c} sd [min, max]" for c in COLUMNS)]
    lines.append("|---|---:|---:|" + "---|" * len(COLUMNS))
    for window in WINDOWS:
        cut = [sweeps[i : i + window] for i in range(0, len(sweeps) - window + 1, window)]
        for estimate, aggregate in ESTIMATES.items():
            tables = [aggregate(w) for w in cut]
            spread = {}
            for column, j in COLUMNS.items():
                ratios = [t[j] / t[1] for t in tables]
                spread[column] = {"sd": round(statistics.pstdev(ratios), 4), "min": round(min(ratios), 3),
                                  "max": round(max(ratios), 3)}  # fmt: skip
            runs.append({"drafter": "dspark", "checkpoint": "shipped", "benchmark": None, "temperature": None,
                         "draft_length": 7, "tree": None, "estimate": estimate, "sweeps_per_window": window,
                         "windows": len(cut), "ratios_to_one_position_pass": spread})  # fmt: skip
            cells = " | ".join(f"{s['sd']:.3f} [{s['min']:.2f}, {s['max']:.2f}]" for s in spread.values())
            lines.append(f"| {estimate} | {window} | {len(cut)} | {cells} |")
    reference = {c: round(whole[j] / whole[1], 3) for c, j in COLUMNS.items()}
    table = (
        "\n".join(lines)
        + "\n\nAll sweeps together (ratio medians): "
        + ", ".join(f"{c} {v:.3f}" for c, v in reference.items())
    )
    table += f" one-position passes; one-position pass {whole[1] * 1e3:.2f} ms; {len(sweeps)} sweeps.\n"
    write_results(args.name, args.out, target.name, runs, table, sweeps=len(sweeps), seconds=args.seconds,
                  all_sweeps_ratio_medians=reference, one_position_pass_s=whole[1],
                  foreign_load_cores=round(load.cores, 3))  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
