"""`specdecode bench baselines`: tokens/s of the training-free drafters against normal decoding.

Two prompt groups: `repeat` (answers that copy their input with a change, where prompt lookup should
shine) and `chat` (fresh text, where it has little to find), measured side by side (`side_by_side.py`).
"""

from specdecode.drafters import build_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.results import write_results
from specdecode.evaluation.side_by_side import group_rows, measure_side_by_side
from specdecode.models.target import Target

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
    lengths = {name: 0 if name == "none" else draft_length for name in TRAINING_FREE}
    decoders = {name: SpeculativeDecoder(target, build_drafter(name, target), n) for name, n in lengths.items()}
    groups = {group: list(prompts) for group, prompts in PROMPT_GROUPS.items()}
    cells, foreign = measure_side_by_side(target, decoders, groups, max_new_tokens, repeats, "baselines")
    runs = group_rows(cells, groups, lengths)
    table = _table(runs)
    write_results(
        "baselines",
        out_dir,
        target.name,
        runs,
        table,
        repeats=repeats,
        max_new_tokens=max_new_tokens,
        foreign_load_cores_median=foreign,
        draft_model="first 4 decoder layers of the target (no smaller same-tokenizer LM exists offline)",
    )
    print(table)
    return {"runs": runs}


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
