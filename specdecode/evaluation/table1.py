"""`specdecode bench table1`: the DSpark paper's Table 1 replicated on our own target, in one command.

Paper setting: Qwen3-8B target, EAGLE-3, DFlash and DSpark retrained on the same data, chain drafting
with draft length 7, temperature 1, accepted length counting the target's own token. Here: the default
target, the three drafters trained by `specdecode train` on the same regenerated data with the same
budget (trained first when `<runs>/<kind>-<target>/drafter` is missing; training resumes), then one
interleaved `specdecode eval` over the offline benchmarks at temperature 1 and 0 (EAGLE-3 also with its
5/4/8 tree, and DSpark also under the prefix scheduler: variants the paper's Table 1 does not have). The
table puts our accepted lengths beside the paper's, both as ratios to EAGLE-3's chain.
"""

import statistics
from pathlib import Path

from specdecode.drafters.base import TreeSettings
from specdecode.evaluation.harness import run_eval
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target
from specdecode.training.recipes import DEFAULT_DRAFT_VOCAB
from specdecode.training.run import run_training
from specdecode.training.trainer import TrainConfig

KINDS = ("eagle3", "dflash", "dspark")
BENCHMARKS = ("gsm8k", "math500", "aime25", "humaneval", "mt-bench")
# DSpark paper, Table 1, Qwen3-8B rows, on the benchmarks we also run (MATH -> our MATH-500 subset), and the
# mean over all nine of the paper's benchmarks
PAPER_QWEN3_8B = {
    "eagle3": {"gsm8k": 5.30, "math500": 4.77, "aime25": 3.91, "humaneval": 4.33, "mt-bench": 2.66, "mean9": 3.80},
    "dflash": {"gsm8k": 5.33, "math500": 4.91, "aime25": 4.07, "humaneval": 4.64, "mt-bench": 3.11, "mean9": 4.07},
    "dspark": {"gsm8k": 6.17, "math500": 5.78, "aime25": 5.01, "humaneval": 5.52, "mt-bench": 3.72, "mean9": 4.81},
}
# `specdecode train`'s defaults for DFlash and DSpark (EAGLE-3's are its recipe's), the same draft vocabulary for all
BLOCK_ARCHITECTURE = {
    "num_layers": 2,
    "block_size": 7,
    "markov_rank": 64,
    "num_anchors": 32,
    "draft_vocab_size": DEFAULT_DRAFT_VOCAB,
}


def run_table1(
    target: Target,
    data_dir: str,
    features: str,
    runs_dir: str,
    out_dir: str = "docs/results",
    epochs: int = 3,
    limit: int = 3,
    max_new_tokens: int = 128,
) -> dict:
    drafters = []
    for kind in KINDS:
        run = Path(runs_dir) / f"{kind}-{target.name}"
        if not (run / "drafter" / "config.json").is_file():
            config = TrainConfig(epochs=epochs, micro_batch_size=4, save_every=40, eval_every=40)
            architecture = {} if kind == "eagle3" else dict(BLOCK_ARCHITECTURE)
            run_training(kind, target, data_dir, str(run), config, features, architecture=architecture)
        drafters.append(str(run / "drafter"))
    result = run_eval(
        target,
        drafters,
        list(BENCHMARKS),
        out_dir,
        "table1",
        limit,
        (1.0, 0.0),
        7,
        max_new_tokens,
        tree=TreeSettings(),
        scheduler="prefix",
    )
    runs = result["runs"]
    table = _table(runs) + "\n\n## Every variant, per benchmark\n\n" + result["markdown"]
    write_results("table1", out_dir, target.name, runs, table, paper_qwen3_8b=PAPER_QWEN3_8B, limit_per_benchmark=limit)
    print(table)
    return {"runs": runs}


def _ours(runs: list[dict], temperature: float) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for r in runs:
        if r["temperature"] == temperature:
            table.setdefault(r["drafter"], {})[r["benchmark"]] = r["mean_accepted_length"]
    for row in table.values():
        row["mean"] = statistics.fmean(row[b] for b in BENCHMARKS if b in row)
    return table


def _table(runs: list[dict]) -> str:
    columns = [*BENCHMARKS, "mean"]
    lines = [
        "Mean accepted length per round (target's own token included), chain drafting, draft length 7. "
        "In brackets: the ratio to EAGLE-3 in the same row group.",
        "",
        "| source | T | drafter | " + " | ".join(columns) + " |",
        "|---|---:|---|" + "---:|" * len(columns),
    ]
    for temperature in (1.0, 0.0):
        ours = _ours(runs, temperature)
        base = ours.get("eagle3")
        for drafter in ("none", "eagle3", "eagle3 tree", "dflash", "dspark"):
            row = ours.get(drafter)
            if row is None:
                continue
            cells = [
                f"{row[c]:.2f}" + (f" ({row[c] / base[c]:.2f})" if base and drafter != "none" and c in base else "")
                for c in columns
                if c in row
            ]
            label = {"none": "normal decoding", "eagle3 tree": "eagle3, tree 5/4/8"}.get(drafter, drafter)
            lines.append(f"| ours (smollm2-135m) | {temperature:g} | {label} | " + " | ".join(cells) + " |")
    base = PAPER_QWEN3_8B["eagle3"]
    for drafter in KINDS:
        row = PAPER_QWEN3_8B[drafter]
        cells = [f"{row[b]:.2f} ({row[b] / base[b]:.2f})" for b in BENCHMARKS]
        cells.append(f"{row['mean9']:.2f} ({row['mean9'] / base['mean9']:.2f}), 9 benchmarks")
        lines.append(f"| paper (Qwen3-8B) | 1 | {drafter} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
