"""The block drafter's context pool in bfloat16 (the default where its linears take 8-bit inputs and the CPU reads
bfloat16 natively) against float32, in one process: a drafting round of the shipped DSpark for R requests in their
second round, each right after a one-position target pass at the same context, the two pools alternating round
by round. Medians and the median of the paired ratios.

    python tools/context_pool_dtype_ab.py --out docs/results --name context_pool_dtype_ab
"""

import argparse
import statistics
import time

import torch

from specdecode.drafters import build_drafter
from specdecode.drafters.base import TargetFeatures, in_second_round
from specdecode.drafters.context_pool import ContextPool
from specdecode.evaluation.premise import time_pass
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=lambda s: [int(c) for c in s.split(",")], default="128,512,1024")
    parser.add_argument("--requests", type=lambda s: [int(r) for r in s.split(",")], default="1,4")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="context_pool_dtype_ab")
    args = parser.parse_args()
    target = Target.load()
    drafters = {}
    for label in ("float32", "default"):
        drafter = build_drafter("default", target).costliest()
        if label == "float32":
            c = drafter.config
            drafter.pool = ContextPool(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32)
        drafters[label] = drafter
    default_dtype = drafters["default"].pool.dtype
    target.set_capture_layers(drafters["default"].target_layer_ids)
    generator = torch.Generator().manual_seed(0)
    runs, lines = [], []
    with ForeignLoad() as load:
        for context in args.contexts:
            ids = torch.randint(100, target.vocab_size, (context + 1,), generator=generator).tolist()
            target.reset()
            out = target.forward(torch.tensor(ids[:context]), logits=False)
            features = TargetFeatures(out.layer_hidden, out.last_hidden)
            for requests in args.requests:
                ms: dict[str, list[float]] = {label: [] for label in drafters}
                for repeat in range(args.repeats + 3):
                    for label, drafter in drafters.items():
                        states = [in_second_round(drafter, ids, features, 7, r) for r in range(requests)]
                        time_pass(target, context, 1, generator)
                        start = time.perf_counter()
                        type(drafter).propose_batch(states, [ids] * requests, [7] * requests)
                        if repeat >= 3:
                            ms[label].append((time.perf_counter() - start) * 1000)
                        for state in states:
                            state.end(ids)
                ratio = statistics.median(a / b for a, b in zip(ms["default"], ms["float32"], strict=True))
                medians = {label: round(statistics.median(v), 3) for label, v in ms.items()}
                runs.append({"context": context, "requests": requests, "round_ms": medians, "ratio": round(ratio, 3)})
                lines.append(
                    f"| {context} | {requests} | {medians['float32']:.3f} | {medians['default']:.3f} | {ratio:.3f} |"
                )
    table = (
        f"A drafting round of the shipped DSpark (7 drafts a request) right after a one-position target pass; the "
        f"default pool holds {default_dtype or 'the features dtype'}. Median ms of {args.repeats} rounds a pool, "
        f"alternating. Cores used by other processes: {load.cores:.2f}.\n\n"
        "| cached tokens | requests | float32 pool ms | default pool ms | default / float32 (paired) |\n"
        "|---:|---:|---:|---:|---:|\n" + "\n".join(lines) + "\n"
    )
    write_results(args.name, args.out, target.name, runs, table, default_pool_dtype=str(default_dtype))
    print(table)


if __name__ == "__main__":
    main()
