"""The five-benchmark mix decoded by several speculative decoders, each against normal decoding of the same prompt
just before, the decoders interleaved prompt by prompt (shared by the A/B tools that compare decoders on it)."""

import statistics

from specdecode.drafters import Drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

BENCHMARKS = ("gsm8k", "math500", "aime25", "humaneval", "mt-bench")


def decode_mix(
    target: Target, decoders: dict, temperatures: list[float], limit: int, max_new_tokens: int
) -> tuple[dict[tuple, list[tuple[float, float]]], float]:
    """{(temperature, *key, benchmark): [(speedup over normal decoding, mean accepted length) per prompt]} for
    every decoder of `decoders` ({key tuple: SpeculativeDecoder}), and the cores other processes used meanwhile.
    Every drafter forgets earlier outputs before each prompt; every greedy output is checked against normal
    decoding."""
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    items = [(b, item) for b in BENCHMARKS for item in load_benchmark(b, limit)]
    cells: dict[tuple, list[tuple[float, float]]] = {}
    with ForeignLoad() as load:
        for temperature in temperatures:
            params = SamplingParams(temperature=temperature)
            for benchmark, item in items:
                ids = target.encode_chat([{"role": "user", "content": item.turns[0]}])
                base = normal.generate(ids, params, max_new_tokens, seed=0)[0]
                for key, decoder in decoders.items():
                    decoder.drafter.forget()  # the prompt was decoded before, at another temperature
                    got = decoder.generate(ids, params, max_new_tokens, seed=0)[0]
                    if params.greedy and got.token_ids != base.token_ids:
                        raise SystemExit(f"{key} on {benchmark}/{item.id}: the output differs from normal decoding")
                    accepted = statistics.mean(got.stats.accepted_lengths)
                    speedup = got.stats.tokens_per_s / base.stats.tokens_per_s
                    cells.setdefault((temperature, *key, benchmark), []).append((speedup, accepted))
    return cells, load.cores


def summary(cells: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, float], float, float]:
    """Per benchmark the median speedup, their mean, and the mean accepted length, of {benchmark: cells}."""
    per_benchmark = {b: round(statistics.median(c[0] for c in cs), 3) for b, cs in cells.items()}
    accepted = statistics.mean(c[1] for cs in cells.values() for c in cs)
    return per_benchmark, statistics.mean(per_benchmark.values()), accepted
