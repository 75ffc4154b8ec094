"""`specdecode bench training`: regeneration tokens/s (batched vs one at a time) and trainer tokens/s.

Regeneration: math and code prompts (about one in five with a second turn) answered at batch size 1 and at
larger batches (at least two prompts per row, so a batch stays full), in fresh folders, each batch size with
prefix reuse (`engine/batch.py`) and without, alternating `repeats` times (medians, and the median of each
repeat's ratio). Training: a few steps of the real trainer on those answers: the trainer as issue #15 found it
(offline features, the target's whole vocabulary, float32) beside today's (the reduced draft vocabulary,
bfloat16 products, offline and online features); tokens/s counts supervised tokens (what the drafter learns
from), as the trainer logs them.
"""

import statistics
import tempfile
from pathlib import Path

from specdecode.evaluation.results import write_results
from specdecode.machine import measure_quietly
from specdecode.models.target import Target
from specdecode.training.features import OfflineFeatures, OnlineFeatures, write_feature_cache
from specdecode.training.prompts import build_prompt_mix
from specdecode.training.recipes import DEFAULT_DRAFT_VOCAB, build_block_drafter, default_layer_ids
from specdecode.training.regenerate import RegenerationReport, RegenerationSettings, read_records, regenerate
from specdecode.training.run import load_examples
from specdecode.training.trainer import TrainConfig, read_metrics, train


def run_training_throughput(
    target: Target,
    out_dir: str,
    prompts: int = 32,
    max_new_tokens: int = 96,
    batch_sizes=(1, 16, 64),
    steps: int = 6,
    repeats: int = 1,
) -> dict:
    conversations = build_prompt_mix(max(prompts, 2 * max(batch_sizes)), seed=123, mix={"math": 0.5, "code": 0.5})
    runs, foreign = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for batch_size in batch_sizes:
            asked = conversations[: max(prompts, 2 * batch_size)]
            timed: dict[bool, list] = {True: [], False: []}  # prefix reuse -> reports, one per repeat
            folders: dict[bool, str] = {}  # prefix reuse -> the first repeat's answers
            for repeat in range(repeats):
                for reuse in (True, False):
                    settings = RegenerationSettings(
                        max_new_tokens=max_new_tokens, batch_size=batch_size, seed=1, prefix_caching=reuse
                    )
                    folder = Path(tmp) / f"regen-b{batch_size}-{'reuse' if reuse else 'whole'}-{repeat}"
                    (report, answers), cores = measure_quietly(
                        lambda s=settings, f=folder, c=asked: _regenerate_afresh(target, c, f, s)
                    )
                    foreign.append(cores)
                    timed[reuse].append(report)
                    folders.setdefault(reuse, answers)
            same = sorted(read_records(folders[True]), key=_id) == sorted(read_records(folders[False]), key=_id)
            ratios = [a.tokens_per_s / b.tokens_per_s for a, b in zip(timed[True], timed[False], strict=True)]
            paired = {"vs_whole_prefill": round(statistics.median(ratios), 3), "same_answers": same}
            for reuse, reports in timed.items():
                runs.append(
                    {
                        "stage": "regenerate",
                        "batch_size": batch_size,
                        "prefix_caching": reuse,
                        "conversations": len(asked),
                        "new_tokens": reports[0].new_tokens,
                        "seconds": round(statistics.median(r.seconds for r in reports), 2),
                        "tokens_per_s": round(statistics.median(r.tokens_per_s for r in reports), 2),
                        "tokens_per_s_repeats": [round(r.tokens_per_s, 2) for r in reports],
                        **(paired if reuse else {}),
                    }
                )
        data = folders[True]
        examples = load_examples(target, str(data), max_length=1024)
        layers = default_layer_ids(target.num_layers)
        cache = Path(tmp) / "cache"
        write_feature_cache(target, layers, examples, cache)
        variants = [
            ("offline", 0, "float32"),
            ("offline", DEFAULT_DRAFT_VOCAB, "float32"),
            ("offline", DEFAULT_DRAFT_VOCAB, "bfloat16"),
            ("online", DEFAULT_DRAFT_VOCAB, "bfloat16"),
        ]
        for mode, vocab, precision in variants:
            features = OnlineFeatures(target, layers) if mode == "online" else OfflineFeatures(cache, layers)
            model = build_block_drafter("dspark", target, examples=examples, draft_vocab_size=vocab)
            config = TrainConfig(
                max_steps=steps, micro_batch_size=4, save_every=10**9, eval_every=10**9, precision=precision
            )
            run_dir = Path(tmp) / f"train-{mode}-{vocab}-{precision}"
            _, cores = measure_quietly(
                lambda m=model, f=features, d=run_dir, c=config: train(m, examples, examples[:4], f, c, d)
            )
            foreign.append(cores)
            speeds = [x["tokens_per_s"] for x in read_metrics(run_dir)[0] if x["step"] > 1]  # step 1 warms up
            runs.append(
                {
                    "stage": "train",
                    "drafter": "dspark",
                    "features": mode,
                    "draft_vocab_size": vocab or target.vocab_size,
                    "precision": precision,
                    "micro_batch_size": 4,
                    "steps": steps,
                    "tokens_per_s": round(statistics.median(speeds), 2),
                }
            )
    table = _table(runs)
    write_results(
        "training_throughput", out_dir, target.name, runs, table, foreign_load_cores_max=round(max(foreign), 3)
    )
    print(table)
    return {"runs": runs}


def _regenerate_afresh(
    target: Target, conversations: list, parent: Path, settings: RegenerationSettings
) -> tuple[RegenerationReport, str]:
    """`regenerate` into a new folder under `parent` (and that folder): a try measured again (another process's
    load) answers every prompt again, where the folder it finished would only be resumed."""
    parent.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(dir=parent)
    return regenerate(target, conversations, folder, settings), folder


def _id(record: dict) -> str:
    return record["id"]


def _table(runs: list[dict]) -> str:
    lines = ["| stage | setting | tokens/s | vs whole prefill |", "|---|---|---:|---:|"]
    for r in runs:
        ratio = ""
        if r["stage"] == "regenerate":
            setting = f"batch {r['batch_size']}, " + ("prefix reuse" if r["prefix_caching"] else "whole prefill")
            ratio = f"{r['vs_whole_prefill']:.2f}x" if r["prefix_caching"] else ""
            ratio += "" if r.get("same_answers", True) else " (other answers!)"
        else:
            setting = f"{r['features']} features, draft vocabulary {r.get('draft_vocab_size', 'full')}"
            setting += f", {r.get('precision', 'float32')}"
        lines.append(f"| {r['stage']} | {setting} | {r['tokens_per_s']:.1f} | {ratio} |")
    return (
        "Regeneration: new tokens per second (medians of the repeats; with prefix reuse and with every prompt "
        "prefilled whole, alternating, and the median of each repeat's ratio). Training: supervised tokens per "
        "second of the DSpark trainer (median over steps after the first).\n\n" + "\n".join(lines)
    )
