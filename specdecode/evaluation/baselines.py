"""`specdecode bench baselines`: tokens/s of the training-free drafters against normal decoding.

Two prompt groups: `repeat` (answers that copy their input with a change, where prompt lookup should
shine) and `chat` (fresh text, where it has little to find). Variants are interleaved prompt by prompt
and repeat by repeat; each cell is a median; measurements disturbed by other processes are re-run.
"""

import statistics

from tqdm import tqdm

from specdecode.drafters import build_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.engine.stats import DecodeStats
from specdecode.evaluation.load import measure_quietly
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

TRAINING_FREE = ("none", "ngram", "draft-model")

PROMPT_GROUPS = {
    "repeat": (
        "Repeat this code exactly, but rename the function to add_numbers:\n\n"
        "def add(a, b):\n    result = a + b\n    print('the sum is', result)\n    return result\n",
        "Copy the following list, keeping every line, and add a sixth line 'six: 6':\n\n"
        "one: 1\ntwo: 2\nthree: 3\nfour: 4\nfive: 5\n",
        "Rewrite this function with the variable `total` renamed to `acc`, changing nothing else:\n\n"
        "def sum_list(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total\n",
    ),
    "chat": (
        "Write a short story about a robot who learns to paint.",
        "Explain in a few sentences what a hash table is and why lookups are fast.",
        "Give three tips for staying focused while studying.",
    ),
}


def run_baselines(target: Target, draft_length: int, max_new_tokens: int, repeats: int, out_dir: str) -> dict:
    decoders = {
        name: SpeculativeDecoder(target, build_drafter(name, target), 0 if name == "none" else draft_length)
        for name in TRAINING_FREE
    }
    params = SamplingParams()
    cells: dict[tuple[str, str, int], list] = {}  # (drafter, group, prompt index) -> completions
    foreign = []
    jobs = [(g, i, p) for g, prompts in PROMPT_GROUPS.items() for i, p in enumerate(prompts)]
    for group, i, prompt in tqdm(jobs * repeats, desc="baselines", unit="prompt"):
        ids = target.encode(prompt)
        for name, decoder in decoders.items():
            completion, cores = measure_quietly(lambda d=decoder, x=ids: d.generate(x, params, max_new_tokens)[0])
            cells.setdefault((name, group, i), []).append(completion)
            foreign.append(cores)

    runs = []
    for group, prompts in PROMPT_GROUPS.items():
        normal_wall = _group_wall(cells, "none", group, len(prompts))
        for name in TRAINING_FREE:
            completions = [cells[(name, group, i)] for i in range(len(prompts))]
            new_tokens = sum(c[0].stats.new_tokens for c in completions)
            wall = _group_wall(cells, name, group, len(prompts))
            pooled = DecodeStats()
            for c in completions:
                pooled.merge(c[0].stats)
            runs.append(
                {
                    "drafter": name,
                    "checkpoint": None,
                    "benchmark": group,
                    "temperature": 0.0,
                    "draft_length": 0 if name == "none" else draft_length,
                    "tree": None,
                    "prompts": len(prompts),
                    "new_tokens": new_tokens,
                    "mean_accepted_length": round(pooled.mean_accepted_length, 3),
                    "per_position_acceptance": [round(a, 3) for a in pooled.per_position_acceptance],
                    "tokens_per_s": round(new_tokens / wall, 2),
                    "speedup": round(normal_wall / wall, 3),
                    "identical_to_normal_at_t0": all(
                        c.token_ids == cells[("none", group, i)][0].token_ids
                        for i in range(len(prompts))
                        for c in cells[(name, group, i)]
                    ),
                    "draft_s_share": round(pooled.draft_s / pooled.wall_s, 3),
                }
            )
    table = _table(runs)
    write_results(
        "baselines",
        out_dir,
        target.name,
        runs,
        table,
        repeats=repeats,
        max_new_tokens=max_new_tokens,
        foreign_load_cores_median=round(statistics.median(foreign), 3),
        draft_model="first 4 decoder layers of the target (no smaller same-tokenizer LM exists offline)",
    )
    print(table)
    return {"runs": runs}


def _group_wall(cells, name: str, group: str, n_prompts: int) -> float:
    """Sum over prompts of the median wall time across repeats."""
    return sum(statistics.median(c.stats.wall_s for c in cells[(name, group, i)]) for i in range(n_prompts))


def _table(runs: list[dict]) -> str:
    lines = [
        "Temperature 0; tokens/s = new tokens / summed median wall time (prefill included); speedup against "
        "normal decoding in the same run.\n",
        "| prompts | drafter | tokens/s | speedup | mean accepted length | identical at T=0 |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['benchmark']} | {r['drafter']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{r['mean_accepted_length']:.2f} | {'yes' if r['identical_to_normal_at_t0'] else 'NO'} |"
        )
    return "\n".join(lines)
