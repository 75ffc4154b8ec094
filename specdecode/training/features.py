"""Target features for drafter training: computed on the fly, or written once to disk and memory-mapped.

A drafter learns from the target's hidden states: the outputs of a few decoder layers (concatenated) and
the final-normed last hidden state, at every position of a training sequence. Online mode runs the target
for every batch (no disk; a target forward per example per epoch). Offline mode pays that forward once:
the features go to float16 shards on disk, and training reads them back through memory maps, so a
multi-epoch run costs only the drafter's own compute. Both serve the same `FeatureBatch`.
"""

import json
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.training.data import Example

if TYPE_CHECKING:
    from specdecode.models.target import Target

INDEX = "index.json"
SHARD_FIELDS = ("layer_hidden", "last_hidden", "input_ids", "loss_mask")
DEFAULT_SHARD_TOKENS = 1 << 18  # ~1.2 GB per shard for SmolLM2-135M with three captured layers


@dataclass
class FeatureBatch:
    """A batch of examples, right-padded to the longest, with the target's features at every position."""

    input_ids: torch.Tensor  # (B, T) long, 0 at padding
    loss_mask: torch.Tensor  # (B, T) bool, False at padding
    attention_mask: torch.Tensor  # (B, T) bool, False at padding
    layer_hidden: torch.Tensor  # (B, T, n_layers * H) float32: captured layer outputs, in layer-id order
    last_hidden: torch.Tensor  # (B, T, H) float32: after the final norm

    def to(self, device: torch.device | str) -> "FeatureBatch":
        return FeatureBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(examples: list[Example], layer_hidden: list[torch.Tensor], last_hidden: list[torch.Tensor]) -> FeatureBatch:
    """Right-pad per-example features (T_i, ...) into one float32 batch; the one place batches are built."""
    b, t = len(examples), max(len(e.input_ids) for e in examples)
    device = last_hidden[0].device
    batch = FeatureBatch(
        input_ids=torch.zeros(b, t, dtype=torch.long, device=device),
        loss_mask=torch.zeros(b, t, dtype=torch.bool, device=device),
        attention_mask=torch.zeros(b, t, dtype=torch.bool, device=device),
        layer_hidden=torch.zeros(b, t, layer_hidden[0].shape[-1], device=device),
        last_hidden=torch.zeros(b, t, last_hidden[0].shape[-1], device=device),
    )
    for i, (example, layers, last) in enumerate(zip(examples, layer_hidden, last_hidden, strict=True)):
        n = len(example.input_ids)
        batch.input_ids[i, :n] = example.input_ids
        batch.loss_mask[i, :n] = example.loss_mask
        batch.attention_mask[i, :n] = True
        batch.layer_hidden[i, :n] = layers
        batch.last_hidden[i, :n] = last
    return batch


class OnlineFeatures:
    """Runs the target on every batch, one sequence at a time (a padded batched pass differs in the last bits)."""

    def __init__(self, target: "Target", layer_ids: list[int]) -> None:
        if not layer_ids:
            raise SpecDecodeError("a drafter needs at least one target layer id to learn from")
        self.target = target
        self.layer_ids = list(layer_ids)
        target.set_capture_layers(self.layer_ids)

    def batch(self, examples: list[Example]) -> FeatureBatch:
        if self.target.capture_layers != self.layer_ids:  # someone else used the target in between
            self.target.set_capture_layers(self.layer_ids)
        passes = [self.target.features(example.input_ids) for example in examples]
        # built outside inference mode, so the drafter's autograd may save these tensors for backward
        return collate(examples, [p.layer_hidden for p in passes], [p.last_hidden for p in passes])


# ---------------------------------------------------------------------------- offline cache


def estimate_cache_bytes(examples: list[Example], n_layers: int, hidden: int, dtype=np.float16) -> int:
    """Bytes the cache of `examples` takes: n_layers + 1 hidden rows per token, plus int32 ids and a mask byte."""
    tokens = sum(len(e.input_ids) for e in examples)
    return tokens * ((n_layers + 1) * hidden * np.dtype(dtype).itemsize + 4 + 1)


def write_feature_cache(
    target: "Target",
    layer_ids: list[int],
    examples: list[Example],
    cache_dir: str | Path,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    dtype=np.float16,
) -> Path:
    """Write the features of every example not yet cached; resumable, as the index only names finished shards.

    Each shard is planned from the examples' lengths, filled through memory maps (so a shard never sits in
    RAM), fsynced and renamed into place before the index that names it is replaced atomically.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    hidden = target.config.hidden_size
    mine = {"target": target.name, "layer_ids": list(layer_ids), "hidden_size": hidden, "dtype": np.dtype(dtype).name}
    index = _read_index(cache_dir) or {**mine, "examples": []}
    for key, value in mine.items():
        if index[key] != value:
            raise SpecDecodeError(
                f"{cache_dir} holds features with {key}={index[key]}, not {value}; use another cache folder"
            )

    cached = {entry["id"] for entry in index["examples"]}
    pending = []
    for example in examples:
        if example.id not in cached:
            cached.add(example.id)
            pending.append(example)
    estimate = estimate_cache_bytes(pending, len(layer_ids), hidden, dtype)
    print(
        f"feature cache {cache_dir}: {len(pending)} examples to write ({len(examples) - len(pending)} cached), "
        f"about {estimate / 2**30:.2f} GiB"
    )
    free = shutil.disk_usage(cache_dir).free
    if estimate * 1.1 > free:
        raise SpecDecodeError(
            f"the feature cache needs about {estimate * 1.1 / 2**30:.2f} GiB (estimate + 10%) but {cache_dir} "
            f"has {free / 2**30:.2f} GiB free; free space, pick another folder, or cache fewer examples"
        )

    target.set_capture_layers(list(layer_ids))
    shard = 1 + max((entry["shard"] for entry in index["examples"]), default=-1)
    bar = tqdm(total=sum(len(e.input_ids) for e in pending), desc="features", unit="tok")
    for group in _plan_shards(pending, shard_tokens):
        rows = sum(len(e.input_ids) for e in group)
        paths = {name: cache_dir / f"shard-{shard:05d}.{name}.npy" for name in SHARD_FIELDS}
        tmp = {name: path.with_name(path.name + ".tmp") for name, path in paths.items()}
        layer_rows = np.lib.format.open_memmap(tmp["layer_hidden"], "w+", dtype, (rows, len(layer_ids) * hidden))
        last_rows = np.lib.format.open_memmap(tmp["last_hidden"], "w+", dtype, (rows, hidden))
        entries, offset = [], 0
        for example in group:
            n = len(example.input_ids)
            out = target.features(example.input_ids)
            for memmap, values in ((layer_rows, out.layer_hidden), (last_rows, out.last_hidden)):
                converted = values.float().cpu().numpy().astype(dtype)
                if not np.isfinite(converted).all():
                    raise SpecDecodeError(
                        f"example {example.id}: a hidden state exceeds the {np.dtype(dtype).name} range; "
                        f"write the cache with dtype=np.float32"
                    )
                memmap[offset : offset + n] = converted
            entries.append({"id": example.id, "shard": shard, "offset": offset, "length": n})
            offset += n
            bar.update(n)
        layer_rows.flush()
        last_rows.flush()
        del layer_rows, last_rows
        ids = np.concatenate([e.input_ids.numpy().astype(np.int32) for e in group])
        mask = np.concatenate([e.loss_mask.numpy().astype(bool) for e in group])
        for name, array in (("input_ids", ids), ("loss_mask", mask)):
            with open(tmp[name], "wb") as f:
                np.save(f, array)
        for name in SHARD_FIELDS:
            fsync_path(tmp[name])
            os.replace(tmp[name], paths[name])
        index["examples"].extend(entries)
        write_text_atomically(cache_dir / INDEX, json.dumps(index))
        shard += 1
    bar.close()
    return cache_dir


class OfflineFeatures:
    """Features served from a cache written by `write_feature_cache`: memory-mapped, upcast to float32.

    With `subset`, `layer_ids` may be some of the cached layers, in any order (EAGLE-3 reads three of the
    five a DFlash/DSpark cache holds); otherwise they must be exactly the cached ones.
    """

    def __init__(self, cache_dir: str | Path, layer_ids: list[int] | None = None, subset: bool = False) -> None:
        self.cache_dir = Path(cache_dir)
        index = _read_index(self.cache_dir)
        if index is None:
            raise SpecDecodeError(f"no feature cache in {self.cache_dir} ({INDEX} missing); write one first")
        cached, wanted = index["layer_ids"], index["layer_ids"] if layer_ids is None else list(layer_ids)
        if not (set(wanted) <= set(cached) if subset else wanted == cached):
            raise SpecDecodeError(
                f"the feature cache {self.cache_dir} holds target layers {cached}, "
                f"but the drafter uses {wanted}; write a cache for these layers"
            )
        self.layer_ids: list[int] = wanted
        self.hidden_size: int = index["hidden_size"]
        h = self.hidden_size
        self._columns = None  # all columns, or those of `wanted` in its order
        if wanted != cached:
            self._columns = np.concatenate([np.arange(cached.index(i) * h, (cached.index(i) + 1) * h) for i in wanted])
        self.target_name: str = index["target"]
        self.entries = {entry["id"]: entry for entry in index["examples"]}
        self._shards: dict[int, dict[str, np.ndarray]] = {}

    def _shard(self, shard: int) -> dict[str, np.ndarray]:
        if shard not in self._shards:
            self._shards[shard] = {
                name: np.load(self.cache_dir / f"shard-{shard:05d}.{name}.npy", mmap_mode="r") for name in SHARD_FIELDS
            }
        return self._shards[shard]

    def _rows(self, example_id: str) -> tuple[dict[str, np.ndarray], slice]:
        entry = self.entries.get(example_id)
        if entry is None:
            raise SpecDecodeError(f"example {example_id} is not in the feature cache {self.cache_dir}; extend it")
        return self._shard(entry["shard"]), slice(entry["offset"], entry["offset"] + entry["length"])

    def examples(self) -> list[Example]:
        """The cached examples themselves, so training from a cache needs no tokenized data set."""
        out = []
        for example_id in self.entries:
            shard, rows = self._rows(example_id)
            ids = torch.from_numpy(shard["input_ids"][rows].astype(np.int64))
            out.append(Example(example_id, ids, torch.from_numpy(np.array(shard["loss_mask"][rows]))))
        return out

    def batch(self, examples: list[Example]) -> FeatureBatch:
        layer_hidden, last_hidden = [], []
        for example in examples:
            shard, rows = self._rows(example.id)
            if not np.array_equal(shard["input_ids"][rows], example.input_ids.numpy()):
                raise SpecDecodeError(
                    f"the feature cache {self.cache_dir} holds other tokens for example {example.id} "
                    f"(data re-tokenized?); rebuild the cache"
                )
            layers = shard["layer_hidden"][rows]
            layers = layers if self._columns is None else layers[:, self._columns]
            layer_hidden.append(torch.from_numpy(layers.astype(np.float32)))
            last_hidden.append(torch.from_numpy(shard["last_hidden"][rows].astype(np.float32)))
        return collate(examples, layer_hidden, last_hidden)


def _plan_shards(examples: list[Example], shard_tokens: int) -> list[list[Example]]:
    """Consecutive groups of at most `shard_tokens` tokens (a longer example gets a shard of its own)."""
    groups: list[list[Example]] = []
    tokens = 0
    for example in examples:
        n = len(example.input_ids)
        if not groups or tokens + n > shard_tokens:
            groups.append([])
            tokens = 0
        groups[-1].append(example)
        tokens += n
    return groups


def _read_index(cache_dir: Path) -> dict | None:
    path = cache_dir / INDEX
    return json.loads(path.read_text()) if path.exists() else None


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's (its entries') data to disk: renames are only durable after this."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomically(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a torn one, even after a crash."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)
