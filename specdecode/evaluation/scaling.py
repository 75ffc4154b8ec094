"""`specdecode bench scaling`: held-out accepted length against the training tokens a drafter saw.

Each run folder is one `specdecode train` run on a different amount of data (`--max-conversations`) with the
same held-out conversations; its final held-out evaluation in `metrics.jsonl` gives the simulated accepted
length per round, greedy (T = 0) and at T = 1, counting the target's own token. Where the curve still climbs
with data, data limits the drafter; where it flattens, capacity or training compute does.
"""

import json
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.evaluation.results import write_results
from specdecode.training.trainer import read_metrics


def run_summary(run_dir: str | Path) -> dict:
    """What one finished training run learned from how much data: its recipe and last held-out evaluation."""
    run = Path(run_dir)
    try:
        config = json.loads((run / "drafter" / "config.json").read_text())
        steps, evals = read_metrics(run)
    except (OSError, json.JSONDecodeError) as e:
        raise SpecDecodeError(f"{run} is not a finished training run ({e})") from e
    recipe = config.get("recipe", {})
    if not evals or "train_supervised_tokens" not in recipe:
        raise SpecDecodeError(f"{run} has no held-out evaluation or no count of its training tokens")
    last = evals[-1]
    return {
        "run": str(run),
        "kind": config["kind"],
        "train_conversations": recipe["train_conversations"],
        "train_supervised_tokens": recipe["train_supervised_tokens"],
        "held_out_conversations": recipe["held_out_conversations"],
        "steps": last["step"],
        "accepted_length_t0": round(last["simulated_accept_length_greedy"], 3),
        "accepted_length_t1": round(last["simulated_accept_length"], 3),
        "acc_pos_1": round(last["acc_pos_1"], 3),
        "training_s": round(max((x.get("elapsed", 0.0) for x in steps), default=0.0), 1),
    }


def earlier_rows(path: str | Path, new_runs: set[str]) -> list[dict]:
    """The rows of an earlier `dspark_scaling.json` whose runs are not summarized again: run folders do not
    survive a new machine, the curve does. Each keeps the commit it was measured at."""
    try:
        doc = json.loads(Path(path).read_text())
        rows = doc["runs"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise SpecDecodeError(f"{path} is not a dspark_scaling results file ({e})") from e
    return [{**r, "measured_at": r.get("measured_at", doc["git_commit"])} for r in rows if r["run"] not in new_runs]


def run_scaling(run_dirs: list[str], out_dir: str, target_name: str, keep: str | None = None) -> dict:
    """The table and plot of `run_dirs`, plus the rows of the earlier results file `keep`."""
    runs = [run_summary(d) for d in run_dirs]
    runs += earlier_rows(keep, {r["run"] for r in runs}) if keep else []
    runs.sort(key=lambda r: r["train_supervised_tokens"])
    lines = [
        "Held-out simulated accepted length per round (target's token included), last evaluation of each run:\n",
        "| training conversations | supervised tokens | steps | accepted T=0 | accepted T=1 | position-1 accuracy | "
        "training time |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['train_conversations']}{'*' if 'measured_at' in r else ''} | {r['train_supervised_tokens']:,} | "
            f"{r['steps']} | "
            f"{r['accepted_length_t0']:.2f} | {r['accepted_length_t1']:.2f} | {r['acc_pos_1']:.3f} | "
            f"{r['training_s'] / 60:.0f} min |"
        )
    table = "\n".join(lines)
    if any("measured_at" in r for r in runs):
        table += "\n\n\\* an earlier run, carried over from the results file at the commit it was measured at."
    plot = Path(out_dir) / "dspark_scaling.png"
    plot_scaling(runs, plot)
    write_results("dspark_scaling", out_dir, target_name, runs, table + f"\n\n![scaling]({plot.name})")
    print(table)
    return {"runs": runs}


def plot_scaling(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    tokens = [r["train_supervised_tokens"] for r in runs]
    ax.plot(tokens, [r["accepted_length_t0"] for r in runs], marker="o", label="T = 0 (greedy)")
    ax.plot(tokens, [r["accepted_length_t1"] for r in runs], marker="o", label="T = 1")
    ax.set_xscale("log")
    ax.set_xlabel("supervised training tokens")
    ax.set_ylabel("held-out accepted length per round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
