"""`specdecode train`: regenerated conversations -> examples -> features -> trainer -> a drafter folder.

The held-out split is fixed by a hash of each conversation id, so it never moves between runs or resumes.
The finished drafter is written to `<out>/drafter` (config.json + model.safetensors), ready for
`specdecode generate --drafter <out>/drafter`.
"""

import hashlib
import os
from dataclasses import asdict
from pathlib import Path

from specdecode.drafters.checkpoint import load_model, read_config, save_drafter
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.training.data import Example, tokenize_conversation
from specdecode.training.features import OfflineFeatures, OnlineFeatures
from specdecode.training.prompts import Conversation, check_disjoint
from specdecode.training.recipes import (
    TRAINABLE_KINDS,
    build_block_drafter,
    build_eagle3_drafter,
    check_architecture,
    recipe_layer_ids,
)
from specdecode.training.regenerate import SHARD_GLOB, read_records
from specdecode.training.trainer import TrainConfig, train

MIN_SUPERVISED_TOKENS = 8


def load_examples(target: Target, data_dir: str, max_length: int) -> list[Example]:
    """Tokenize regenerated conversations (a folder of shards, or a packed `.npz` that was checked when it
    was packed); refuse data whose prompts overlap an evaluation set."""
    if Path(data_dir).suffix == ".npz":
        from specdecode.training.artifact import load_packed

        examples = load_packed(target, data_dir, max_length)
        return [e for e in examples if int(e.loss_mask.sum()) >= MIN_SUPERVISED_TOKENS]
    check_training_data(data_dir)
    records = read_records(data_dir)
    if not records:
        raise SpecDecodeError(f"the shards in {data_dir} hold no complete conversation")
    conversations = [
        Conversation(r["id"], r.get("source", "?"), [m["content"] for m in r["messages"] if m["role"] == "user"])
        for r in records
    ]
    check_disjoint(conversations)
    examples = [tokenize_conversation(target.tokenizer, r["id"], r["messages"], max_length) for r in records]
    return [e for e in examples if int(e.loss_mask.sum()) >= MIN_SUPERVISED_TOKENS]


def is_held_out(example_id: str, fraction: float) -> bool:
    return int(hashlib.sha256(example_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


def check_training_data(data: str | Path) -> None:
    """Raise `SpecDecodeError` where `data` is neither a packed `.npz` nor a folder of regenerated shards, before
    the target loads; a folder holding packed sets names them (`--data data/regenerated` for the shipped one)."""
    path = Path(data)
    if path.suffix == ".npz" and not path.is_file():
        raise SpecDecodeError(f"no packed training set at {path}")
    if path.suffix != ".npz" and not any(path.glob(SHARD_GLOB)):
        packed = sorted(path.glob("*.npz"))
        hint = f": it holds packed sets, pass one, e.g. --data {packed[0]}" if packed else ""
        raise SpecDecodeError(
            f"no regenerated conversations in {path}{hint or '; run `specdecode data regenerate` first'}"
        )


def check_training_request(kind: str, max_conversations: int | None, architecture: dict | None = None) -> None:
    """Raise `SpecDecodeError` for a kind of drafter, a data size or an architecture that no training could take."""
    if kind not in TRAINABLE_KINDS:
        raise SpecDecodeError(f"unknown drafter kind '{kind}'; choose one of {', '.join(TRAINABLE_KINDS)}")
    if max_conversations is not None and max_conversations < 1:
        raise SpecDecodeError(f"--max-conversations must be >= 1, got {max_conversations}")
    check_architecture(kind, architecture or {})


def run_training(
    kind: str,
    target: Target,
    data_dir: str,
    out_dir: str,
    config: TrainConfig,
    features: str = "online",
    max_length: int = 1024,
    held_out: float = 0.03,
    architecture: dict | None = None,
    max_conversations: int | None = None,
    init: str | None = None,
) -> Path:
    """Train a drafter of `kind`; `max_conversations` keeps the first N training conversations (in the data's
    order) and the same held-out set, for scaling curves. `init` fine-tunes a trained drafter of that kind
    instead of a fresh one: its architecture, target layers and draft vocabulary are kept, its calibration is
    dropped (it no longer describes the weights; run `specdecode calibrate` again)."""
    check_training_request(kind, max_conversations, architecture)
    architecture = dict(architecture or {})
    layer_ids = architecture.pop("target_layer_ids", None) or recipe_layer_ids(kind, target.num_layers)
    initial = None
    if init is not None:
        initial_kind, initial = load_model(init, target)
        if initial_kind != kind:
            raise SpecDecodeError(f"--init {init} is a {initial_kind} drafter, not a {kind} one")
        layer_ids = list(initial.config.target_layer_ids)
        if kind != "eagle3":
            initial.config.clear_calibration()
    if features == "online":
        examples = load_examples(target, data_dir, max_length)
        source = OnlineFeatures(target, layer_ids)
    else:
        source = OfflineFeatures(features, layer_ids, subset=True)
        examples = source.examples()
    train_set = [e for e in examples if not is_held_out(e.id, held_out)][:max_conversations]
    eval_set = [e for e in examples if is_held_out(e.id, held_out)]
    if not train_set or not eval_set:
        raise SpecDecodeError(f"{len(examples)} usable conversations are too few to split off a held-out set")
    if initial is not None:
        model = initial
    elif kind == "eagle3":  # its draft vocabulary is counted on the training answers
        model = build_eagle3_drafter(target, train_set, target_layer_ids=layer_ids, **architecture)
    else:
        model = build_block_drafter(kind, target, target_layer_ids=layer_ids, examples=train_set, **architecture)
    final = train(model.to(target.device), train_set, eval_set, source, config, out_dir)
    if final.get("interrupted"):
        raise SpecDecodeError(f"training was interrupted; a checkpoint is in {out_dir}: run the same command to resume")
    if int(os.environ.get("RANK", "0")) != 0:
        return Path(out_dir) / "drafter"
    recipe = {
        "training": asdict(config),
        "data": str(data_dir),
        "features": features,
        "init": None if init is None else {"drafter": str(init), "recipe": read_config(init).get("recipe", {})},
        "train_conversations": len(train_set),
        "train_supervised_tokens": sum(int(e.loss_mask.sum()) for e in train_set),
        "held_out_conversations": len(eval_set),
        "max_length": max_length,
        "final_metrics": {k: v for k, v in final.items() if isinstance(v, (int, float))},  # the last step's batch
        "held_out_metrics": final.get("eval") or {},  # the last held-out evaluation
    }
    return save_drafter(Path(out_dir) / "drafter", kind, model, model.config.to_dict(), target, recipe)
