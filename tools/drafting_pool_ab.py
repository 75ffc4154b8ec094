"""A drafting round with and without the context pool (stop 51), in alternating processes: this tree's
`specdecode bench drafting` beside the same bench module run on the package of a checkout of the commit before
the pool (26845df), whose block drafter copied every request's context into a fresh batch cache each round.

    git worktree add /tmp/before 26845df
    python tools/drafting_pool_ab.py /tmp/before --processes 3 --name drafting_pool_ab
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specdecode.evaluation.results import write_results

BENCH = Path(__file__).resolve().parents[1] / "specdecode" / "evaluation" / "drafting_bench.py"

# Run in the checkout's package: its premise module named the pass timer `_time_pass`; the bench is this tree's.
BEFORE = """
import sys, types
import specdecode.evaluation.premise as premise
assert premise.__file__.startswith(sys.argv[4]), premise.__file__  # the checkout's package, not this tree's
premise.time_pass = getattr(premise, "time_pass", None) or premise._time_pass
premise.check_contexts = getattr(premise, "check_contexts", None) or (lambda *a: None)
bench = types.ModuleType("drafting_bench")
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), bench.__dict__)
from specdecode.models.target import Target
bench.run_drafting_bench(Target.load("smollm2-135m"), "default", [1, 2, 4, 8, 16], [128, 512], 7, int(sys.argv[3]),
                         sys.argv[2], "run")
"""


def run(build: str, checkout: Path, out: Path, repeats: int) -> list[dict]:
    if build == "pool":
        command = [sys.executable, "-m", "specdecode.cli", "bench", "drafting", "--repeats", str(repeats)]
        command += ["--out", str(out), "--name", "run"]
        env = os.environ
    else:
        command = [sys.executable, "-c", BEFORE, str(BENCH), str(out), str(repeats), str(checkout)]
        env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run(command, check=True, env=env, cwd=checkout if build == "before" else None, capture_output=True)
    return json.loads((out / "run.json").read_text())["runs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a checkout of the commit before the pool")
    parser.add_argument("--processes", type=int, default=3, help="processes per build, alternating")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="drafting_pool_ab")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for process in range(args.processes):
            for build in ("before", "pool"):
                for row in run(build, args.checkout.resolve(), Path(tmp), args.repeats):
                    runs.append({**row, "build": build, "process": process})
                print(f"[drafting_pool_ab] {build} process {process} done", flush=True)
    lines = ["| cached tokens | requests | before: round ms (per process) | pool: round ms (per process) |",
             "|---:|---:|---|---|"]  # fmt: skip
    for context in sorted({r["context"] for r in runs}):
        for requests in sorted({r["requests"] for r in runs}):
            cells = {}
            for build in ("before", "pool"):
                ms = [
                    r["round_ms"]
                    for r in runs
                    if (r["build"], r["context"], r["requests"]) == (build, context, requests)
                ]
                cells[build] = f"{statistics.median(ms):.2f} ({' / '.join(f'{m:.2f}' for m in ms)})"
            lines.append(f"| {context} | {requests} | {cells['before']} | {cells['pool']} |")
    table = (
        "A drafting round of the shipped DSpark (7 drafts a request) for R requests, each right after a one-position "
        f"target pass (`bench drafting`, medians of {args.repeats} repetitions a process); the two builds in "
        f"alternating processes, {args.processes} each; medians over processes, then each process's.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    write_results(args.name, args.out, "smollm2-135m", runs, table)
    print(table)


if __name__ == "__main__":
    main()
