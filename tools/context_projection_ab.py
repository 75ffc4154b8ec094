"""A drafting round of the shipped DSpark drafter in two variants of how it keeps its context, in one process:
each round right after its own one-position target pass (as `specdecode bench drafting` times them), the two
variants alternating repetition by repetition.

- `--compare projection` (stop 56): the pending target features projected and stored by one C++ call
  (`BlockKernels.project`) against the Python glue it replaced (`BlockKernels.context_kv`, then a tensor copy per
  layer into the pool);
- `--compare pool-dtype` (stop 69): the context pool in the dtype the library picks (`BlockKernels.cache_dtype`:
  bfloat16 where the linears take 8-bit inputs and the CPU reads bfloat16 natively) against float32.

    python tools/context_projection_ab.py --repeats 60 --name context_projection_ab
    python tools/context_projection_ab.py --compare pool-dtype --contexts 128,512,1024 --name context_pool_dtype_ab
"""

import argparse
import statistics

import torch

from specdecode.drafters import build_drafter
from specdecode.drafters.base import TargetFeatures
from specdecode.drafters.context_pool import ContextPool
from specdecode.drafters.shipped import shipped_drafter
from specdecode.evaluation.drafting_bench import timed_round
from specdecode.evaluation.premise import paired_ratio
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target


def float32_pool(drafter) -> None:
    c = drafter.config
    drafter.pool = ContextPool(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)


def python_glue(drafter) -> None:
    drafter.kernels.project = lambda *args: False  # the fallback: context_kv, then the copies


COMPARISONS = {  # the library's way, then the other: (label, how a drafter is made to take it)
    "projection": (("one C++ call", None), ("Python glue", python_glue)),
    "pool-dtype": (("default pool", None), ("float32 pool", float32_pool)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=list(COMPARISONS), default="projection")
    parser.add_argument("--contexts", type=lambda s: [int(c) for c in s.split(",")], default="128,512")
    parser.add_argument("--requests", type=lambda s: [int(r) for r in s.split(",")], default="1,4")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="context_projection_ab")
    args = parser.parse_args()
    target = Target.load()
    drafters = {}
    for variant, change in COMPARISONS[args.compare]:
        drafters[variant] = build_drafter(str(shipped_drafter(target.name)), target)
        if change is not None:
            change(drafters[variant])
    variants = list(drafters)
    target.set_capture_layers(drafters[variants[0]].target_layer_ids)
    generator = torch.Generator().manual_seed(0)
    runs, lines = [], []
    with ForeignLoad() as load:
        for context in args.contexts:
            ids = torch.randint(100, target.vocab_size, (context + 1,), generator=generator).tolist()
            target.reset()
            out = target.forward(torch.tensor(ids[:context]), logits=False)
            features = TargetFeatures(out.layer_hidden, out.last_hidden)
            for r in args.requests:
                rounds = {v: [] for v in variants}
                passes = {v: [] for v in variants}
                for repetition in range(args.repeats + 2):  # two warm-up repetitions
                    for v, drafter in drafters.items():
                        round_ms, t1 = timed_round(target, drafter, ids, features, r, 7, generator)
                        if repetition >= 2:
                            rounds[v].append(round_ms)
                            passes[v].append(t1)
                for v in variants:
                    row = {"context": context, "requests": r, "variant": v,
                           "round_ms": round(statistics.median(rounds[v]), 3),
                           "t1_ms": round(statistics.median(passes[v]), 3),
                           "round_over_t1": round(paired_ratio(rounds[v], passes[v]), 3),
                           "repeats": args.repeats}  # fmt: skip
                    runs.append(row)
                    if v == variants[1]:
                        row["round_vs_library"] = round(statistics.median(
                            b / a for a, b in zip(rounds[variants[0]], rounds[v], strict=True)), 3)  # fmt: skip
                    ratio = f"{row['round_vs_library']:.3f}" if v == variants[1] else "1"
                    lines.append(f"| {context} | {r} | {v} | {row['round_ms']:.2f} | {row['t1_ms']:.2f} | "
                                 f"{row['round_over_t1']:.3f} | {ratio} |")  # fmt: skip
    table = (
        "A drafting round of the shipped DSpark (7 drafts a request) for R requests in their second round, right "
        "after a one-position target pass; medians of "
        f"{args.repeats} repetitions, the variants alternating. Cores used by other processes: at most "
        f"{load.cores:.2f}.\n\n| context | requests | {args.compare} | round ms | t(1) ms | round / t(1) | "
        f"round / {variants[0]}'s (paired) |\n|---:|---:|---|---:|---:|---:|---:|\n" + "\n".join(lines) + "\n"
    )
    write_results(args.name, args.out, target.name, runs, table, foreign_load_cores_max=round(load.cores, 3))
    print(table)


if __name__ == "__main__":
    main()
