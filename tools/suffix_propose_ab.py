"""The suffix drafter's `propose` with the stop-56 scan (the cost curve read once per drafter, the scan of draft
lengths stopped where no longer proposal can pay more, cells found by bisection) against the full scan it
replaced (the curve read at every draft, every length scanned, cells by counting bounds), in one process: the
benchmarks' reference answers fed token by token after their prompts, a proposal at every position, the two
alternating by pass over all texts. Also checks that both propose the same drafts.

    python tools/suffix_propose_ab.py --name suffix_propose_ab
"""

import argparse
import statistics
import time

import torch

from specdecode.drafters.suffix import AcceptanceTable, SuffixDrafter, expected_accepted
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.sps import profile_target
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams


def full_scan(self: SuffixDrafter, confidences: list[float], cap: int) -> tuple[int, float]:
    """`_paying_length` before stop 56: every length, the curve read at each."""
    if self.steps_per_s is None or not confidences:
        keep = min(cap, len(confidences))
        return keep, 1 + expected_accepted(confidences[:keep])
    plain = self.steps_per_s(1)
    keep, best, survived, path = 0, 1.0, 0.0, 1.0
    for n, confidence in enumerate(confidences, 1):
        path *= float(confidence)
        survived += path
        rate = (1 + survived) * self.steps_per_s(n + 1) / plain
        if rate > best:
            keep, best = n, rate
    return keep, best


def counted_cell(self: AcceptanceTable, matched: int, score: float) -> int:
    """`AcceptanceTable.cell` before stop 56: the bounds counted one by one."""
    length = sum(matched > bound for bound in self.LENGTHS)
    return length * (len(self.SCORES) + 1) + sum(score >= bound for bound in self.SCORES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4, help="texts per benchmark")
    parser.add_argument("--passes", type=int, default=4, help="passes over all texts per variant")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="suffix_propose_ab")
    args = parser.parse_args()
    target = Target.load()
    curve = profile_target(target).steps_per_s
    texts = []
    for benchmark in ("humaneval", "gsm8k"):
        for item in load_benchmark(benchmark, args.limit):
            prompt = target.encode_chat([{"role": "user", "content": item.turns[0]}])
            texts.append((prompt, target.tokenizer.encode(item.reference)[:200]))
    variants = {"stop 56": (SuffixDrafter._paying_length, AcceptanceTable.cell), "full scan": (full_scan, counted_cell)}
    seconds = {v: [] for v in variants}
    proposals = {v: [] for v in variants}
    with ForeignLoad() as load:
        for sweep in range(args.passes):
            for name, (paying_length, cell) in variants.items():
                SuffixDrafter._paying_length, AcceptanceTable.cell = paying_length, cell
                drafter = SuffixDrafter(steps_per_s=curve)
                drafter.proposal_limit(8)
                for prompt, answer in texts:
                    drafter.begin(prompt, SamplingParams(), torch.Generator(), None)
                    ids = list(prompt)
                    for token in answer:
                        start = time.perf_counter()
                        proposal = drafter.propose(ids, 32)
                        seconds[name].append(time.perf_counter() - start)
                        if sweep == 0:
                            proposals[name].append(proposal.tokens.tolist())
                        ids.append(token)
                        drafter.observe(ids, 0, None)
                    drafter.end(ids)
    SuffixDrafter._paying_length, AcceptanceTable.cell = variants["stop 56"]
    same = proposals["stop 56"] == proposals["full scan"]
    runs = [
        {"variant": name, "proposals": len(s), "median_us": round(statistics.median(s) * 1e6, 1),
         "mean_us": round(statistics.mean(s) * 1e6, 1), "same_proposals": same}
        for name, s in seconds.items()
    ]  # fmt: skip
    table = (
        f"`SuffixDrafter.propose` at every position of {len(texts)} reference answers (HumanEval, GSM8K) after their "
        f"prompts, {args.passes} passes a variant, alternating; the same drafts proposed: {same}. Cores used by "
        f"other processes: at most {load.cores:.2f}.\n\n"
        "| scan | proposals | median us | mean us |\n|---|---:|---:|---:|\n"
        + "\n".join(f"| {r['variant']} | {r['proposals']} | {r['median_us']} | {r['mean_us']} |" for r in runs)
        + "\n"
    )
    write_results(args.name, args.out, target.name, runs, table, foreign_load_cores_max=round(load.cores, 3))
    print(table)
    if not same:
        raise SystemExit("the two scans proposed different drafts")


if __name__ == "__main__":
    main()
