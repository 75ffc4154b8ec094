"""One target pass over k new positions, as the runner runs it by default, with this tree's package against a
checkout's, in alternating processes. For kernel changes: each process builds, plans and caches its own kernels
(the build is named by the sources), and the machine's memory speed moves between processes (docs/runner.md,
stop 50), so several processes each, alternating, and the medians of their medians.

    git worktree add /tmp/before ec0d530   # before the Q4_1 weights were rebuilt in one fused multiply-add
    python tools/pass_ab.py /tmp/before --processes 8 --reps 30 --name q4_1_fma_ab
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specdecode.evaluation.results import write_results

TREE = Path(__file__).resolve().parents[1]
CHILD = """
import json, statistics, sys, torch
import specdecode
assert specdecode.__file__.startswith(sys.argv[1]), specdecode.__file__  # the package under test
from specdecode.evaluation.premise import time_pass
from specdecode.models.target import Target
contexts, positions, reps = json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
target = Target.load("smollm2-135m")
generator = torch.Generator().manual_seed(0)
out = {}
for context in contexts:
    target.reset()
    target.forward(torch.randint(100, target.vocab_size, (context,), generator=generator), logits=False)
    times = {k: [] for k in positions}
    for rep in range(reps + 3):  # three warm-up sweeps
        for k in positions:
            ms = time_pass(target, context, k, generator)
            if rep >= 3:
                times[k].append(ms)
    out[str(context)] = {str(k): statistics.median(v) for k, v in times.items()}
print(json.dumps(out))
"""


def run(package: Path, contexts: list[int], positions: list[int], reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(package))
    args = [str(package), json.dumps(contexts), json.dumps(positions), str(reps)]
    command = [sys.executable, "-c", CHILD, *args]  # run in the package's tree: `-c` puts the cwd first on the path
    done = subprocess.run(command, env=env, cwd=package, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a checkout of the commit to compare against")
    parser.add_argument("--processes", type=int, default=4, help="per package")
    parser.add_argument("--contexts", default="128,512")
    parser.add_argument("--positions", default="1,2,4,8")
    parser.add_argument("--reps", type=int, default=40, help="sweeps over the positions a process")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="pass_ab")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    positions = [int(k) for k in args.positions.split(",")]
    packages = {"this tree": TREE, "checkout": args.checkout.resolve()}
    medians = {label: [] for label in packages}
    for p in range(args.processes):
        for label in packages if p % 2 == 0 else reversed(packages):
            ms = run(packages[label], contexts, positions, args.reps)
            medians[label].append(ms)
            print(f"[pass_ab] {label} process {p}: {ms}", flush=True)
    runs, lines = [], ["| context | k | checkout ms | this tree ms | ratio |", "|---:|---:|---:|---:|---:|"]
    for context in contexts:
        for k in positions:
            each = {label: [m[str(context)][str(k)] for m in ms] for label, ms in medians.items()}
            before, after = (statistics.median(each[label]) for label in ("checkout", "this tree"))
            runs.append({"context": context, "k": k, "checkout_ms": each["checkout"], "tree_ms": each["this tree"]})
            lines.append(f"| {context} | {k} | {before:.2f} | {after:.2f} | {after / before:.3f} |")
    table = "\n".join(lines) + "\n"
    write_results(args.name, args.out, "smollm2-135m", runs, table, processes=args.processes, reps=args.reps)
    print(table)


if __name__ == "__main__":
    main()
