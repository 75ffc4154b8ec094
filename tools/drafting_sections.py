"""Where one request's drafting round goes: the shipped block drafter's stages timed inside `propose_batch`.

`specdecode bench drafting` gives a round's total against t(1); this splits it. Each stage (the projection of
the last round's target features, the block's embedding, the C++ backbone, the draft head, the Markov chain,
the confidences' calibration) is wrapped with a timer, and rounds run back to back and right after a
one-position target pass (which takes the caches, as decoding does). Medians over the kept rounds; a round's
unnamed rest is the Python glue between the stages.

    python tools/drafting_sections.py --out docs/results --name drafting_sections
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specdecode.drafters import build_drafter, dspark
from specdecode.drafters.base import TargetFeatures, in_second_round
from specdecode.evaluation.premise import time_pass
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target

WARMUP = 5  # rounds not kept


def timed(owner, attribute: str, label: str, into: dict[str, float]) -> None:
    """Wrap owner.attribute so that each call adds its milliseconds to into[label]."""
    inner = getattr(owner, attribute)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        into[label] += (time.perf_counter() - start) * 1000
        return result

    setattr(owner, attribute, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--draft-length", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="drafting_sections")
    args = parser.parse_args()

    target = Target.load()
    drafter = build_drafter("default", target).costliest()
    target.set_capture_layers(drafter.target_layer_ids)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, target.vocab_size, (args.context + 1,), generator=generator).tolist()
    target.reset()
    out = target.forward(torch.tensor(ids[: args.context]), logits=False)
    features = TargetFeatures(out.layer_hidden, out.last_hidden)

    stages: dict[str, float] = defaultdict(float)  # this round's ms per stage
    model, kernels = drafter.model, drafter.kernels
    timed(type(drafter), "_project_pending", "project context", stages)
    timed(model, "embed", "embed anchors", stages)
    timed(kernels, "backbone", "backbone (C++)", stages)
    timed(model, "draft_logits", "draft head", stages)
    timed(kernels, "chain", "Markov chain (C++)", stages)
    timed(dspark, "calibrated_confidence", "calibrate confidences", stages)

    runs, rows = [], []
    with ForeignLoad() as load:
        for after_pass in (False, True):
            kept: dict[str, list[float]] = defaultdict(list)
            for round_ in range(WARMUP + args.rounds):
                states = [in_second_round(drafter, ids, features, args.draft_length, 0)]
                if after_pass:
                    time_pass(target, args.context, 1, generator)
                stages.clear()
                start = time.perf_counter()
                type(drafter).propose_batch(states, [ids], [args.draft_length])
                total = (time.perf_counter() - start) * 1000
                if round_ >= WARMUP:
                    kept["round"].append(total)
                    kept["glue"].append(total - sum(stages.values()))
                    for label, ms in stages.items():
                        kept[label].append(ms)
            when = "after a target pass" if after_pass else "back to back"
            medians = {label: round(statistics.median(v), 3) for label, v in kept.items()}
            runs.append({"when": when, "context": args.context, "draft_length": args.draft_length, **medians})
            rows += [f"| {when} | {label} | {ms:.3f} |" for label, ms in medians.items()]
    table = (
        f"One request's drafting round ({args.draft_length} drafts, {args.context} cached tokens), median ms of "
        f"{args.rounds} rounds per stage; `glue` is the round less its named stages. Cores used by other "
        f"processes: {load.cores:.2f}.\n\n| when | stage | ms |\n|---|---|---:|\n" + "\n".join(rows) + "\n"
    )
    write_results(args.name, args.out, target.name, runs, table, foreign_load_cores=round(load.cores, 3))
    print(table)


if __name__ == "__main__":
    main()
