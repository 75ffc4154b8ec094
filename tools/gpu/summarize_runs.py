"""Summarize the drafter runs of a GPU session (tools/gpu/train_h200.sh) into docs/results/h200_training.*.

Each run folder holds what came back from the GPU: `metrics.jsonl` (one line per step, held-out evaluations
marked "eval") and the drafter's `config.json` (its recipe: data, batch, steps). The table gives, per run, the
trainer's supervised tokens per second on the GPU and the last held-out evaluation (simulated accepted length
per round, the target's own token included, greedy and at T = 1); the plot, the held-out curves against steps.

    python tools/gpu/summarize_runs.py RUN_DIR [RUN_DIR ...] --out docs/results
"""

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from specdecode.evaluation.results import write_results  # noqa: E402
from specdecode.training.trainer import read_metrics  # noqa: E402


def summary(run: Path) -> dict:
    steps, evals = read_metrics(run)
    config = json.loads((run / "config.json").read_text())
    recipe, training = config["recipe"], config["recipe"]["training"]
    init = recipe.get("init") or {}  # a continued run: its steps count on from the init's
    offset = init.get("recipe", {}).get("final_metrics", {}).get("step", 0)
    return {
        "run": run.name,
        "drafter": config["kind"],
        "anchors": config["architecture"].get("num_anchors"),
        "init_steps": offset,
        "train_conversations": recipe["train_conversations"],
        "train_supervised_tokens": recipe["train_supervised_tokens"],
        "batch": training["micro_batch_size"],
        "planned_steps": training["max_steps"],
        "steps": steps[-1]["step"],
        "steps_label": f"{offset}+" * bool(offset) + f"{steps[-1]['step']}/{training['max_steps']}",
        "epochs": round(steps[-1]["step"] * training["micro_batch_size"] / recipe["train_conversations"], 2),
        "training_s": round(steps[-1]["elapsed"], 1),
        "supervised_tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in steps[10:]), 0),
        "accepted_length_t0": round(evals[-1]["simulated_accept_length_greedy"], 3),
        "accepted_length_t1": round(evals[-1]["simulated_accept_length"], 3),
        "acc_pos_1": round(evals[-1]["acc_pos_1"], 3),
        "curve": [
            (offset + x["step"], x["simulated_accept_length_greedy"], x["simulated_accept_length"]) for x in evals
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--note", default="", help="how the runs shared the GPU, printed under the table")
    args = parser.parse_args()
    runs = [summary(Path(r)) for r in args.runs]
    rows = [
        f"| {r['run']} | {r['drafter']} | {r['train_conversations']} | {r['train_supervised_tokens'] / 1e6:.2f}M | "
        f"{r['batch']} | {r['anchors']} | {r['steps_label']} | {r['epochs']} | {r['training_s']} | "
        f"{r['supervised_tokens_per_s']:.0f} | {r['accepted_length_t0']:.2f} | {r['accepted_length_t1']:.2f} |"
        for r in runs
    ]
    table = (
        "Drafters trained on one NVIDIA H200 from the committed regenerated data (online target features, one "
        "right-padded bfloat16 target pass per batch, bfloat16 autocast). Held-out: the last evaluation on 32 "
        "held-out conversations, simulated accepted length per round (target's token included). Anchors: blocks "
        "trained per sequence. Steps: run/planned, after the steps of the run a continued one started from. "
        "Supervised tokens/s: the batches' answer tokens, whatever the anchors.\n\n"
        "| run | kind | train conversations | supervised tokens | batch | anchors | steps | epochs | seconds | "
        "supervised tokens/s | held-out T=0 | held-out T=1 |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        + "\n".join(rows)
        + (f"\n\n{args.note}\n" if args.note else "\n")
    )
    out = Path(args.out)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, column, title in ((axes[0], 1, "greedy (T = 0)"), (axes[1], 2, "T = 1")):
        for r in runs:
            ax.plot([c[0] for c in r["curve"]], [c[column] for c in r["curve"]], marker=".", label=r["run"])
        ax.set_title(f"held-out simulated accepted length, {title}")
        ax.set_xlabel("optimizer step (batch of 32 conversations)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "h200_training.png", dpi=110)
    write_results(
        "h200_training", str(out), "smollm2-135m", runs, table + "\n![curves](h200_training.png)\n",
        trained_on="one NVIDIA H200 (torch 2.11.0+cu130), lent for one session in stops 39 and 40; written on a CPU",
    )  # fmt: skip
    print(table)


if __name__ == "__main__":
    main()
