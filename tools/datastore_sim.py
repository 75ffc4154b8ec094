"""Would a datastore of the target's own regenerated answers (REST-style retrieval) draft what DSpark and suffix
decoding miss? Simulated on the target's greedy answers to the five benchmarks' prompts.

The datastore is a suffix array over every answer span of the shipped regenerated set (`data/regenerated`, 3.9M
tokens), reversed so that a context's end is matched one earlier token at a time; a draft continues the
longest match by the majority next token of its occurrences (stopping below 30% agreement or at 7 drafts).
Rounds are simulated as decoding visits positions (a round from position i keeps its matching drafts and the
target's token): the datastore alone, the local suffix match (the prompt and answer so far) alone, the shipped
DSpark drafter alone (its teacher-forced greedy survival on the same answers, `simulated_survival`), the oracle
that takes the best of them each round (an upper bound on any choice), and the rule "the datastore where its
match is at least L tokens long, else DSpark".

    python tools/datastore_sim.py --limit 8 --out docs/results --name datastore_sim
"""

import argparse

import numpy as np
import torch

from specdecode.drafters.base import Drafter
from specdecode.drafters.checkpoint import load_model
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.results import write_results
from specdecode.evaluation.sim_check import simulated_survival
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams
from specdecode.training.features import OnlineFeatures

BENCHMARKS = ("gsm8k", "math500", "aime25", "humaneval", "mt-bench")
DRAFTS = 7
SEPARATOR = -1  # between answers: no match crosses it


def answer_tokens(path: str) -> np.ndarray:
    """Every assistant span of the packed regenerated set, each followed by a separator."""
    data = np.load(path)
    tokens, lengths, spans, counts = (data[k] for k in ("tokens", "lengths", "spans", "span_counts"))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    owner = np.repeat(np.arange(len(lengths)), counts)
    pieces = []
    for conversation, (a, b) in zip(owner, spans, strict=True):
        pieces += [tokens[starts[conversation] + a : starts[conversation] + b].astype(np.int32), [SEPARATOR]]
    return np.concatenate(pieces).astype(np.int32)


class Datastore:
    """A suffix array of the reversed corpus, sorted on each suffix's first 64 tokens (prefix doubling)."""

    def __init__(self, corpus: np.ndarray, depth: int = 64) -> None:
        self.text = corpus[::-1].copy()
        n = len(self.text)
        rank, k = self.text.astype(np.int64) + 2, 1
        while k <= depth:
            second = np.zeros(n, np.int64)
            second[: n - k] = rank[k:]
            order = np.lexsort((second, rank))
            changed = np.ones(n, np.int64)
            changed[1:] = (rank[order][1:] != rank[order][:-1]) | (second[order][1:] != second[order][:-1])
            rank = np.empty(n, np.int64)
            rank[order] = np.cumsum(changed)
            k *= 2
        self.order, self.first = order, self.text[order]

    def draft(self, context: list[int], longest: int = 32) -> tuple[list[int], int]:
        """The drafts after the longest match of the context's end, and that match's length."""
        text, order, n = self.text, self.order, len(self.text)
        lo, hi = np.searchsorted(self.first, context[-1]), np.searchsorted(self.first, context[-1], "right")
        if lo == hi:
            return [], 0
        matched = 1
        for d in range(1, min(longest, len(context))):
            column = text[np.minimum(order[lo:hi] + d, n - 1)]
            a, b = np.searchsorted(column, context[-1 - d]), np.searchsorted(column, context[-1 - d], "right")
            if a == b:
                break
            lo, hi, matched = lo + a, lo + b, matched + 1
        alive, drafts = order[lo:hi][:2000], []
        for j in range(1, DRAFTS + 1):  # the continuation runs backwards in the reversed text
            alive = alive[alive - j >= 0]
            if not len(alive):
                break
            following = text[alive - j]
            values, counts = np.unique(following, return_counts=True)
            best = counts.argmax()
            if values[best] == SEPARATOR or counts[best] < 0.3 * len(alive):
                break
            drafts.append(int(values[best]))
            alive = alive[following == values[best]]
        return drafts, matched


def local_draft(context: list[int]) -> tuple[list[int], int]:
    """Suffix decoding over the context itself: what followed the longest earlier match of its end."""
    c = np.array(context)
    best, at = 0, -1
    for p in np.nonzero(c[:-1] == c[-1])[0][::-1]:
        m = 1
        while m < 32 and p - m >= 0 and c[p - m] == c[len(c) - 1 - m]:
            m += 1
        if m > best:
            best, at = m, p
    return ([int(x) for x in c[at + 1 : at + 1 + DRAFTS]] if best >= 2 else []), best


def kept(drafts: list[int], answer: list[int], i: int) -> int:
    k = 0
    while k < len(drafts) and i + k < len(answer) and drafts[k] == answer[i + k]:
        k += 1
    return k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/regenerated/smollm2-135m.npz")
    parser.add_argument("--limit", type=int, default=8, help="prompts per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="datastore_sim")
    args = parser.parse_args()
    target = Target.load()
    corpus = answer_tokens(args.data)
    store = Datastore(corpus)
    _, model = load_model(str(shipped_drafter(target.name)), target)
    model.eval()
    features = OnlineFeatures(target, list(model.config.target_layer_ids))
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    items = []  # (benchmark, prompt, answer, per position the drafts DSpark keeps, datastore, local)
    for benchmark in BENCHMARKS:
        for item in load_benchmark(benchmark, args.limit):
            prompt = target.encode_chat([{"role": "user", "content": item.turns[0]}])
            answer = normal.generate(prompt, SamplingParams(), args.max_new_tokens, seed=0)[0].token_ids
            survival = simulated_survival(model, features, prompt, answer, 0.0)
            dspark = survival.cumprod(-1).sum(-1).round().int().tolist()
            lookups = [(store.draft(prompt + answer[:i]), local_draft(prompt + answer[:i])) for i in range(len(answer))]
            items.append((benchmark, answer, dspark, lookups))

    policies = {  # drafts kept at position i: (i, answer, DSpark's, the datastore's lookup, the local one)
        "datastore alone": lambda i, a, ds, store, local: kept(store[0], a, i),
        "local suffix alone": lambda i, a, ds, store, local: kept(local[0], a, i),
        "dspark alone": lambda i, a, ds, store, local: ds,
        "best of dspark and local suffix (oracle)": lambda i, a, ds, store, local: max(ds, kept(local[0], a, i)),
        "best of all three (oracle)": lambda i, a, ds, store, local: max(
            ds, kept(local[0], a, i), kept(store[0], a, i)
        ),
        **{
            f"datastore where its match >= {n}, else dspark": lambda i, a, ds, store, local, n=n: (
                kept(store[0], a, i) if store[1] >= n and len(store[0]) >= 2 else ds
            )
            for n in (4, 8)
        },
    }
    runs, lines = [], []
    for label, policy in policies.items():
        per_benchmark: dict[str, list[float]] = {}
        tokens = rounds = 0
        for benchmark, answer, dspark, lookups in items:
            i = got = steps = 0
            while i < len(answer):
                k = policy(i, answer, dspark[i], *lookups[i])
                got, steps, i = got + k + 1, steps + 1, i + k + 1
            per_benchmark.setdefault(benchmark, []).append(got / steps)
            tokens, rounds = tokens + got, rounds + steps
        means = {b: round(float(np.mean(v)), 3) for b, v in per_benchmark.items()}
        runs.append({"policy": label, "accepted_length": round(tokens / rounds, 3), "per_benchmark": means})
        lines.append(f"| {label} | {tokens / rounds:.2f} | " + " | ".join(f"{means[b]:.2f}" for b in BENCHMARKS) + " |")
    table = (
        f"Accepted length per round (counting the target's token), simulated on the greedy answers to {args.limit} "
        f"prompts a benchmark ({args.max_new_tokens} tokens); datastore: {len(corpus):,} answer tokens.\n\n"
        "| drafts from | accepted | " + " | ".join(BENCHMARKS) + " |\n|---|---:|" + "---:|" * len(BENCHMARKS) + "\n"
        + "\n".join(lines) + "\n"
    )  # fmt: skip
    write_results(args.name, args.out, target.name, runs, table, data=args.data, datastore_tokens=len(corpus))
    print(table)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
