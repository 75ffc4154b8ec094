"""What verifying a sampled chain costs on this machine: p over the k + 1 rows (`probabilities`, SmolLM2's 49,152
tokens), block verification of k drafts drawn from q over an 8,192-token draft vocabulary (`verify_block`), and,
in the same process, the block's stopping point drawn as since stop 55 (`sample_weights` over the odds as floats)
against as before (`sample` over them as a tensor). Medians of 300 calls each, random logits.

    python tools/verify_cost.py --out docs/results --name verify_cost
"""

import argparse
import statistics
import time

import torch

from specdecode.evaluation.results import write_results
from specdecode.sampling import SamplingParams, probabilities, sample, sample_weights
from specdecode.verify import verify_block

VOCAB, DRAFT_VOCAB, CALLS = 49_152, 8_192, 300


def median_ms(run) -> float:
    seconds = []
    for _ in range(CALLS):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def costs(k: int, support: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
    """Median ms of each step for k sampled drafts."""
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(k + 1, VOCAB, generator=generator) * 3
    q = torch.softmax(torch.randn(k, DRAFT_VOCAB, generator=generator) * 3, -1) if k else None
    drafts = support[torch.randint(0, DRAFT_VOCAB, (k,), generator=generator)]
    p = probabilities(logits, params)
    stops = [1.0 / (k + 1)] * (k + 1)
    return {
        "p_ms": median_ms(lambda: probabilities(logits, params)),
        "verify_block_ms": median_ms(lambda: verify_block(p, drafts, q, generator, support if k else None)),
        "stop_as_floats_ms": median_ms(lambda: sample_weights(stops, generator)),
        "stop_as_tensor_ms": median_ms(lambda: sample(torch.tensor(stops, dtype=torch.float64), generator)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="verify_cost")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    support = torch.sort(torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB]).values
    runs, lines = [], ["| drafts | p (ms) | verify_block (ms) | stop drawn as floats (ms) | as a tensor (ms) |"]
    lines.append("|---:|---:|---:|---:|---:|")
    for k in (0, 1, 3, 6):
        row = costs(k, support, generator)
        runs.append({"drafts": k, **{name: round(ms, 4) for name, ms in row.items()}})
        lines.append(f"| {k} | " + " | ".join(f"{ms:.3f}" for ms in row.values()) + " |")
    table = "\n".join(lines) + "\n"
    write_results(args.name, args.out, "smollm2-135m", runs, table, vocab=VOCAB, draft_vocab=DRAFT_VOCAB, calls=CALLS)
    print(table)


if __name__ == "__main__":
    main()
