"""Target features for drafter training: computed on the fly, or written once to disk and memory-mapped.

A drafter learns from the target's hidden states: the outputs of a few decoder layers (concatenated) and
the final-normed last hidden state, at every position of a training sequence. Online mode runs the target
for every batch (no disk; a target forward per example per epoch). Offline mode pays that forward once:
the features go to float16 shards on disk, and training reads them back through memory maps, so a
multi-epoch run costs only the drafter's own compute. Both serve the same `FeatureBatch`.

The cache also keeps two numbers per position that the distillation teacher needs and that only the
target's whole LM head gives: the log-normalizer of its logits and their argmax (the *teacher statistics*).
With them a drafter with a reduced draft vocabulary reads only its N rows of the head in training instead
of all 49,152 (profiled: the full head was ~40% of a training step). They are computed from the cached
float16 last hidden state, the same input the teacher would read; a cache written before they existed gets
them added, shard by shard, the next time `specdecode data cache` runs on it.
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
from specdecode.paths import fsync_path, write_text_atomically
from specdecode.training.data import Example

if TYPE_CHECKING:
    from specdecode.models.target import Target

INDEX = "index.json"
SHARD_FIELDS = ("layer_hidden", "last_hidden", "input_ids", "loss_mask")
TEACHER_FIELDS = ("target_log_z", "target_argmax")  # float32 and int32 per position
TEACHER_CHUNK_ROWS = 512  # target logits are computed this many positions at a time (49k floats each)
DEFAULT_SHARD_TOKENS = 1 << 18  # ~1.2 GB per shard for SmolLM2-135M with three captured layers


@dataclass
class FeatureBatch:
    """A batch of examples, right-padded to the longest, with the target's features at every position."""

    input_ids: torch.Tensor  # (B, T) long, 0 at padding
    loss_mask: torch.Tensor  # (B, T) bool, False at padding
    attention_mask: torch.Tensor  # (B, T) bool, False at padding
    layer_hidden: torch.Tensor  # (B, T, n_layers * H) float32: captured layer outputs, in layer-id order
    last_hidden: torch.Tensor  # (B, T, H) float32: after the final norm
    target_log_z: torch.Tensor | None = None  # (B, T) float32: logsumexp of the target's logits, if cached
    target_argmax: torch.Tensor | None = None  # (B, T) long: argmax of the target's logits, if cached

    @property
    def teacher(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The cached teacher statistics (log-normalizer, argmax), or Nones."""
        return self.target_log_z, self.target_argmax

    def to(self, device: torch.device | str) -> "FeatureBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return FeatureBatch(**{k: v if v is None else v.to(device) for k, v in moved.items()})


def collate(
    examples: list[Example],
    layer_hidden: list[torch.Tensor],
    last_hidden: list[torch.Tensor],
    teacher: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> FeatureBatch:
    """Right-pad per-example features (T_i, ...) into one float32 batch; the one place batches are built.
    `teacher`: per example, the cached (log-normalizer, argmax) of the target's logits."""
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
    if teacher is not None:
        batch.target_log_z = torch.zeros(b, t, device=device)
        batch.target_argmax = torch.zeros(b, t, dtype=torch.long, device=device)
        for i, (log_z, argmax) in enumerate(teacher):
            batch.target_log_z[i, : len(log_z)], batch.target_argmax[i, : len(argmax)] = log_z, argmax
    return batch


@torch.inference_mode()
def teacher_statistics(head, last_hidden: np.ndarray, bar: tqdm | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(log-normalizer float32, argmax int32) of the target's logits at every row of `last_hidden` (N, H)."""
    log_z, argmax = [], []
    for start in range(0, len(last_hidden), TEACHER_CHUNK_ROWS):
        rows = torch.from_numpy(np.asarray(last_hidden[start : start + TEACHER_CHUNK_ROWS], dtype=np.float32))
        logits = head(rows.to(head.weight.dtype)).float()
        log_z.append(logits.logsumexp(-1).numpy())
        argmax.append(logits.argmax(-1).numpy().astype(np.int32))
        if bar is not None:
            bar.update(len(rows))
    return np.concatenate(log_z), np.concatenate(argmax)


class OnlineFeatures:
    """Runs the target on every batch. On a CPU one sequence at a time (a padded batched pass differs in the last
    bits); on an accelerator the whole batch in one right-padded pass, which a causal model's real positions
    cannot see (one pass per sequence would leave a GPU idle between small kernels)."""

    def __init__(self, target: "Target", layer_ids: list[int]) -> None:
        if not layer_ids:
            raise SpecDecodeError("a drafter needs at least one target layer id to learn from")
        self.target = target
        self.layer_ids = list(layer_ids)
        target.set_capture_layers(self.layer_ids)

    def batch(self, examples: list[Example]) -> FeatureBatch:
        if self.target.capture_layers != self.layer_ids:  # someone else used the target in between
            self.target.set_capture_layers(self.layer_ids)
        if self.target.device.type == "cpu":
            passes = [self.target.features(example.input_ids) for example in examples]
            layer_hidden, last_hidden = [p.layer_hidden for p in passes], [p.last_hidden for p in passes]
        else:
            lengths = [len(example.input_ids) for example in examples]
            ids = torch.nn.utils.rnn.pad_sequence([example.input_ids for example in examples], batch_first=True)
            out = self.target.run(ids, None, None, logits=False)
            layer_hidden = [out.layer_hidden[row, :n] for row, n in enumerate(lengths)]
            last_hidden = [out.last_hidden[row, :n] for row, n in enumerate(lengths)]
        # built outside inference mode, so the drafter's autograd may save these tensors for backward
        return collate(examples, layer_hidden, last_hidden)


# ---------------------------------------------------------------------------- offline cache


def estimate_cache_bytes(examples: list[Example], n_layers: int, hidden: int, dtype=np.float16) -> int:
    """Bytes the cache of `examples` takes: n_layers + 1 hidden rows per token, plus int32 ids and a mask byte."""
    tokens = sum(len(e.input_ids) for e in examples)
    return tokens * ((n_layers + 1) * hidden * np.dtype(dtype).itemsize + 4 + 1 + 8)


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
    RAM), fsynced and renamed into place before the index that names it is replaced atomically. Shards
    written before the teacher statistics existed get them first.
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

    add_teacher_statistics(target, cache_dir, sorted({entry["shard"] for entry in index["examples"]}))
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
        _write_teacher_statistics(target, cache_dir, shard)
        index["examples"].extend(entries)
        write_text_atomically(cache_dir / INDEX, json.dumps(index))
        shard += 1
    bar.close()
    return cache_dir


def _teacher_paths(cache_dir: Path, shard: int) -> dict[str, Path]:
    return {name: cache_dir / f"shard-{shard:05d}.{name}.npy" for name in TEACHER_FIELDS}


def _last_hidden(cache_dir: Path, shard: int) -> np.ndarray:
    return np.load(cache_dir / f"shard-{shard:05d}.last_hidden.npy", mmap_mode="r")


def _write_teacher_statistics(target: "Target", cache_dir: Path, shard: int, bar: tqdm | None = None) -> None:
    """The teacher statistics of one finished shard, from its cached last hidden states, written atomically."""
    log_z, argmax = teacher_statistics(target.output_head(), _last_hidden(cache_dir, shard), bar)
    for path, array in zip(_teacher_paths(cache_dir, shard).values(), (log_z, argmax), strict=True):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.save(f, array)
        fsync_path(tmp)
        os.replace(tmp, path)


def add_teacher_statistics(target: "Target", cache_dir: Path, shards: list[int]) -> None:
    """Give the shards of an older cache the teacher statistics they lack (resumable: a shard at a time)."""
    missing = [s for s in shards if not all(p.exists() for p in _teacher_paths(cache_dir, s).values())]
    if not missing:
        return
    with tqdm(
        total=sum(len(_last_hidden(cache_dir, s)) for s in missing), desc="teacher statistics", unit="tok"
    ) as bar:
        for shard in missing:
            _write_teacher_statistics(target, cache_dir, shard, bar)


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
            names = [*SHARD_FIELDS, *(n for n, p in _teacher_paths(self.cache_dir, shard).items() if p.exists())]
            self._shards[shard] = {
                name: np.load(self.cache_dir / f"shard-{shard:05d}.{name}.npy", mmap_mode="r") for name in names
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
        layer_hidden, last_hidden, teacher = [], [], []
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
            if all(name in shard for name in TEACHER_FIELDS):
                log_z, argmax = (torch.from_numpy(np.array(shard[name][rows])) for name in TEACHER_FIELDS)
                teacher.append((log_z, argmax.long()))
        return collate(examples, layer_hidden, last_hidden, teacher if len(teacher) == len(examples) else None)


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
