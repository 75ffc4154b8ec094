"""A sampled step's own work, p = softmax(z / t) over SmolLM2's 49,152 tokens and one token drawn from it, on the
C++ kernels of csrc/sampling.cpp (stop 56) against the ATen ops they replaced (the division, ATen's softmax and
`sample`'s two-level CDF); at `--temperature 0` a greedy step's, each row's argmax (stop 64); with `--block` a
sampled round's verification, p over R rows (in C++ on both paths) and block verification of R - 1 drafts drawn
from a random q over a draft vocabulary of 8,192 tokens, in one C++ call or in ATen steps (stop 65). In one
process: R rows of logits from a target pass over R positions right before each measurement (as in decoding,
where the pass has just filled the caches), the two paths alternating.

    python tools/sampling_ab.py --name sampling_ab
    python tools/sampling_ab.py --temperature 0 --rows 1,8,16,64 --name greedy_ab
    python tools/sampling_ab.py --block --rows 2,4,8 --name block_verify_ab
"""

import argparse
import statistics
import time

import torch

from specdecode import sampling, verify
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target

PATHS = ("C++ kernels", "ATen ops")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default="1,4,16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--block", action="store_true", help="block verification of R - 1 sampled drafts")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="sampling_ab")
    args = parser.parse_args()
    if args.block and min(args.rows) < 2:
        parser.error("--block verifies R - 1 drafts: every --rows must be at least 2")
    target = Target.load()
    generator = torch.Generator().manual_seed(0)
    context = 128
    target.reset()
    target.forward(torch.randint(100, target.vocab_size, (context,), generator=generator), logits=False)
    params = sampling.SamplingParams(temperature=args.temperature)
    kernels, cpp_takes = sampling.cpu_kernels_available, verify.cpp_takes
    runs, lines = [], []
    with ForeignLoad() as load:
        for rows in args.rows:
            ids = torch.randint(100, target.vocab_size, (rows,), generator=generator)
            if args.block:  # R - 1 drafts drawn from a random q over a draft vocabulary
                support = torch.randperm(target.vocab_size, generator=generator)[:8192].sort().values
                q = (torch.randn(rows - 1, len(support), generator=generator) * 3).softmax(-1)
                drafts = support[torch.multinomial(q, 1, generator=generator)[:, 0]]
            ms = {path: [] for path in PATHS}
            for repetition in range(args.repeats + 5):
                for path in PATHS:
                    logits = target.forward(ids).logits
                    target.rollback(context)
                    if args.block:  # only the verification's own path swapped
                        verify.cpp_takes = cpp_takes if path == PATHS[0] else lambda values: False
                    else:
                        sampling.cpu_kernels_available = kernels if path == PATHS[0] else lambda: False
                    start = time.perf_counter()
                    if params.greedy:  # greedy decoding and verification read the argmax alone
                        sampling.greedy_tokens(logits)
                    elif args.block:
                        verify.verify_block(sampling.probabilities(logits, params), drafts, q, generator, support)
                    else:
                        for row in sampling.probabilities(logits, params):
                            sampling.sample(row, generator)
                    if repetition >= 5:
                        ms[path].append((time.perf_counter() - start) * 1000)
                    sampling.cpu_kernels_available, verify.cpp_takes = kernels, cpp_takes
            for path in PATHS:
                median = statistics.median(ms[path])
                runs.append({"rows": rows, "path": path, "ms": round(median, 4), "repeats": args.repeats,
                             "temperature": args.temperature})  # fmt: skip
                lines.append(f"| {rows} | {path} | {median:.3f} | {median / rows:.3f} |")
    work = (
        "The argmax of R rows of logits (T = 0)"
        if params.greedy
        else f"p over R rows of logits (T = {args.temperature:g}) and block verification of R - 1 drafts"
        if args.block
        else f"p over R rows of logits (T = {args.temperature:g}) and a token drawn from each"
    )
    table = (
        f"{work}, right after a target pass over R positions; medians of {args.repeats} repetitions, the paths "
        f"alternating. Cores used by other processes: at most {load.cores:.2f}.\n\n"
        "| rows | path | ms | ms a row |\n|---:|---|---:|---:|\n" + "\n".join(lines) + "\n"
    )
    write_results(args.name, args.out, target.name, runs, table, foreign_load_cores_max=round(load.cores, 3))
    print(table)


if __name__ == "__main__":
    main()
