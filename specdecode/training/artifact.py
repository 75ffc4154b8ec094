"""Regenerated data as one compact, versioned file that the repository can keep.

Regeneration takes hours and caches do not survive a new machine, so the conversations the target wrote
are packed into an `.npz` of token ids (uint16 when the vocabulary fits), assistant spans (the loss mask)
and conversation / source ids, with a JSON manifest beside it: the file's sha256, the target and its
tokenizer's fingerprint, the regeneration settings and the command that packed it. `specdecode train
--data FILE.npz` reads it directly; a file whose hash or tokenizer does not match is refused.

The kept file grows without answering its conversations again: `data regenerate --skip FILE.npz` answers
only prompts whose ids the file does not hold (ids name the same prompt in any larger mix), with the
file's own sampling settings, and `data pack --base FILE.npz` writes the file's conversations and the new
folder's together.
"""

import hashlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.training.data import Example, tokenize_conversation
from specdecode.training.prompts import Conversation, check_disjoint
from specdecode.training.regenerate import read_records

FORMAT = "specdecode-regenerated/1"


def manifest_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def tokenizer_fingerprint(target: Target) -> str:
    """Token ids mean something only with the tokenizer and chat template that made them."""
    tokenizer = target.tokenizer
    text = tokenizer.backend_tokenizer.to_str() + (tokenizer.chat_template or "")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pack(
    target: Target, data_dir: str | Path, out: str | Path, max_length: int = 1024, base: str | Path | None = None
) -> dict:
    """Tokenize every regenerated conversation in `data_dir` into `out` (.npz) and its manifest (.json), after
    the conversations of the packed file `base` when given (those of `data_dir` it already holds are skipped)."""
    records = read_records(data_dir)
    settings_file = Path(data_dir) / "settings.json"
    settings = json.loads(settings_file.read_text()) if settings_file.exists() else None
    earlier: dict[str, np.ndarray] = {}
    if base is not None:
        base_manifest, earlier = _read_checked(target, base)
        _check_same_sampling(base, base_manifest, settings)
        if base_manifest["max_length"] != max_length:
            raise SpecDecodeError(
                f"{base} was packed with --max-length {base_manifest['max_length']}, not {max_length}"
            )
        known = set(earlier["ids"].tolist())
        records = [r for r in records if r["id"] not in known]
    if not records and base is None:
        raise SpecDecodeError(f"no regenerated conversations in {data_dir}")
    turns = [[m["content"] for m in r["messages"] if m["role"] == "user"] for r in records]
    check_disjoint([Conversation(r["id"], r.get("source", "?"), t) for r, t in zip(records, turns, strict=True)])
    examples = [tokenize_conversation(target.tokenizer, r["id"], r["messages"], max_length) for r in records]
    dtype = np.uint16 if len(target.tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    spans, span_counts = [], []
    for e in examples:
        mask = torch.cat([torch.tensor([False]), e.loss_mask, torch.tensor([False])]).int()
        edges = (mask[1:] - mask[:-1]).nonzero().flatten().view(-1, 2)  # [start, end) of each assistant span
        spans.append(edges)
        span_counts.append(len(edges))
    arrays = {
        "tokens": np.concatenate([e.input_ids.numpy() for e in examples] or [np.zeros(0)]).astype(dtype),
        "lengths": np.array([len(e.input_ids) for e in examples], dtype=np.int32),
        "spans": torch.cat(spans).numpy().astype(np.int32) if spans else np.zeros((0, 2), np.int32),
        "span_counts": np.array(span_counts, dtype=np.int32),
        "ids": np.array([r["id"] for r in records], dtype=str),
        "sources": np.array([r.get("source", "?") for r in records], dtype=str),
    }
    if earlier:
        arrays = {name: np.concatenate([earlier[name], part]) for name, part in arrays.items()}
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(buffer.getvalue())
    sources: dict[str, int] = {}
    for source in arrays["sources"].tolist():
        sources[source] = sources.get(source, 0) + 1
    supervised = int((arrays["spans"][:, 1] - arrays["spans"][:, 0]).sum())
    manifest = {
        "format": FORMAT,
        "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
        "bytes": len(buffer.getvalue()),
        "target": target.name,
        "tokenizer_fingerprint": tokenizer_fingerprint(target),
        "conversations": len(arrays["ids"]),
        "tokens": len(arrays["tokens"]),
        "supervised_tokens": supervised,
        "sources": dict(sorted(sources.items())),
        "max_length": max_length,
        "regeneration_settings": settings,
        "disjoint_from_evaluation_sets": "8-gram check passed (training.prompts.check_disjoint)",
        "packed_with": " ".join(["specdecode", *sys.argv[1:]]),
    }
    manifest_path(out).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def packed_ids(target: Target, path: str | Path, settings: dict) -> set[str]:
    """The conversation ids a packed file holds, for a regeneration with sampling `settings` that grows it."""
    manifest, arrays = _read_checked(target, path)
    _check_same_sampling(path, manifest, settings)
    return set(arrays["ids"].tolist())


def packed_prompts(target: Target, path: str | Path) -> tuple[set[str], int]:
    """The conversation ids a packed file holds (checked like any read of it) and the seed of the prompt mix
    they name (a regeneration builds its mix with its own seed)."""
    manifest, arrays = _read_checked(target, path)
    return set(arrays["ids"].tolist()), int(manifest["regeneration_settings"].get("seed", 0))


def _check_same_sampling(path: str | Path, manifest: dict, settings: dict | None) -> None:
    if manifest.get("regeneration_settings") != settings:
        raise SpecDecodeError(
            f"{path} was regenerated with settings {manifest.get('regeneration_settings')}, not {settings}: "
            "one data set samples one way"
        )


def _read_checked(target: Target, path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A packed file's manifest and arrays, after checking its hash and that it was made for this tokenizer."""
    path = Path(path)
    manifest_file = manifest_path(path)
    if not manifest_file.exists():
        raise SpecDecodeError(f"{path} has no manifest {manifest_file.name} beside it; pack it again")
    manifest = json.loads(manifest_file.read_text())
    if manifest.get("format") != FORMAT:
        raise SpecDecodeError(f"{manifest_file} is not a {FORMAT} manifest")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SpecDecodeError(f"{path} does not match the sha256 in {manifest_file.name}: the file is damaged")
    if manifest["tokenizer_fingerprint"] != tokenizer_fingerprint(target):
        raise SpecDecodeError(
            f"{path} holds token ids of {manifest['target']}'s tokenizer, not {target.name}'s; "
            "regenerate the data with this target"
        )
    with np.load(io.BytesIO(data)) as arrays:
        return manifest, {name: arrays[name] for name in arrays.files}


def load_packed(target: Target, path: str | Path, max_length: int) -> list[Example]:
    """The examples of a packed file, after checking its hash and that it was made for this tokenizer."""
    _, arrays = _read_checked(target, path)
    tokens = torch.from_numpy(arrays["tokens"].astype(np.int64))
    spans = torch.from_numpy(arrays["spans"].astype(np.int64))
    examples, start, first_span = [], 0, 0
    for conversation, length, count in zip(
        arrays["ids"].tolist(), arrays["lengths"].tolist(), arrays["span_counts"].tolist(), strict=True
    ):
        mask = torch.zeros(length, dtype=torch.bool)
        for a, b in spans[first_span : first_span + count].tolist():
            mask[a:b] = True
        examples.append(Example(conversation, tokens[start : start + length][:max_length], mask[:max_length]))
        start, first_span = start + length, first_span + count
    return examples
