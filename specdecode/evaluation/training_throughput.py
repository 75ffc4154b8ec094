"""`specdecode bench training`: regeneration tokens/s (batched vs one at a time) and trainer tokens/s.

Regeneration: single-turn prompts answered at batch size 1 and at larger batches (at least two prompts
per row, so a batch stays full), in fresh folders. Training: a few steps of the real trainer on those
answers: the trainer as issue #15 found it (offline features, the target's whole vocabulary, float32)
beside today's (the reduced draft vocabulary, bfloat16 products, offline and online features); tokens/s
counts supervised tokens (what the drafter learns from), as the trainer logs them.
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
from specdecode.training.regenerate import RegenerationSettings, regenerate
from specdecode.training.run import load_examples
from specdecode.training.trainer import TrainConfig, read_metrics, train


def run_training_throughput(
    target: Target, out_dir: str, prompts: int = 32, max_new_tokens: int = 96, batch_sizes=(1, 16, 64), steps: int = 6
) -> dict:
    conversations = build_prompt_mix(max(prompts, 2 * max(batch_sizes)), seed=123, mix={"math": 0.5, "code": 0.5})
    runs, foreign = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for batch_size in batch_sizes:
            settings = RegenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch_size, seed=1)
            folder = Path(tmp) / f"regen-b{batch_size}"
            asked = conversations[: max(prompts, 2 * batch_size)]
            report, cores = measure_quietly(lambda s=settings, f=folder, c=asked: regenerate(target, c, str(f), s))
            foreign.append(cores)
            runs.append(
                {
                    "stage": "regenerate",
                    "batch_size": batch_size,
                    "conversations": len(asked),
                    "new_tokens": report.new_tokens,
                    "seconds": round(report.seconds, 2),
                    "tokens_per_s": round(report.tokens_per_s, 2),
                }
            )
        data = Path(tmp) / f"regen-b{batch_sizes[-1]}"
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


def _table(runs: list[dict]) -> str:
    lines = ["| stage | setting | tokens/s |", "|---|---|---:|"]
    for r in runs:
        if r["stage"] == "regenerate":
            setting = f"batch {r['batch_size']}"
        else:
            setting = f"{r['features']} features, draft vocabulary {r.get('draft_vocab_size', 'full')}"
            setting += f", {r.get('precision', 'float32')}"
        lines.append(f"| {r['stage']} | {setting} | {r['tokens_per_s']:.1f} |")
    return (
        "Regeneration: new tokens per second. Training: supervised tokens per second of the DSpark trainer "
        "(median over steps after the first).\n\n" + "\n".join(lines)
    )
