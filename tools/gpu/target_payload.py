"""Carry a converted registry target to a machine that cannot install it: the GGUF's own rows, not float32.

A GPU machine lent for a training run reaches no package registry, and what may travel there is far smaller than
the converted float32 folder (514 MB for SmolLM2-135M). The GGUF rows the CPU runner already keeps
(`gguf-rows.cache`, models/gguf_rows.py) rebuild every linear exactly, so the folder travels as those rows,
the few tensors they do not cover, the config and the tokenizer (~96 MB), and is rebuilt there bit for bit:
every tensor's sha256 is checked against the original's.

    python tools/gpu/target_payload.py pack smollm2-135m OUT.tar      # here
    python tools/gpu/target_payload.py unpack OUT.tar                  # there, into $XDG_CACHE_HOME/specdecode
"""

import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save, save_file

from specdecode.models.gguf_rows import BLOCK_BYTES, CACHE_FILE, SOURCE_MARKER, dequantize
from specdecode.models.registry import converted_dir

WEIGHTS = "model.safetensors"
MANIFEST = "payload.json"


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def inputs_of(rows: torch.Tensor) -> int:
    """The input width of a linear from the width of its Q4_1 or Q8_0 rows (the two never share a width here)."""
    (inputs,) = {rows.shape[1] // size * 32 for size in BLOCK_BYTES.values() if rows.shape[1] % size == 0}
    return inputs


def pack(name: str, out: Path) -> None:
    folder = converted_dir(name)
    weights, rows = load_file(str(folder / WEIGHTS)), load_file(str(folder / CACHE_FILE))
    tied = {"model.embed_tokens.weight": "lm_head.weight"} if "lm_head.weight" not in weights else {}
    covered = set(rows) | set(tied)
    manifest = {"name": name, "digests": {n: digest(t) for n, t in weights.items()}, "tied": tied}
    with tarfile.open(out, "w") as tar:
        for path in sorted(folder.iterdir()):
            if path.name not in (WEIGHTS, CACHE_FILE) and path.is_file():
                tar.add(path, arcname=path.name)
        for arcname, data in (
            ("rows.safetensors", save(rows)),
            ("rest.safetensors", save({n: t for n, t in weights.items() if n not in covered})),
            (MANIFEST, json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(arcname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB for {len(weights)} tensors")


def unpack(archive: Path) -> None:
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    manifest = json.loads(members.pop(MANIFEST))
    rows, rest = load(members.pop("rows.safetensors")), load(members.pop("rest.safetensors"))
    weights = {**rest, **{n: dequantize(r, inputs_of(r)) for n, r in rows.items()}}
    for name, source in manifest["tied"].items():
        weights[name] = weights.pop(source)
    wrong = [n for n, d in manifest["digests"].items() if n not in weights or digest(weights[n]) != d]
    if wrong or len(weights) != len(manifest["digests"]):
        sys.exit(f"rebuilt weights differ from the original: {wrong[:5]}")
    folder = converted_dir(manifest["name"])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / WEIGHTS), metadata={"format": "pt"})
    for arcname in sorted(members, key=lambda n: n == SOURCE_MARKER):  # the marker that says "converted" last
        (folder / arcname).write_bytes(members[arcname])
    print(f"{folder}: {len(weights)} tensors rebuilt, every sha256 equal to the original's")


if __name__ == "__main__":
    {"pack": lambda: pack(sys.argv[2], Path(sys.argv[3])), "unpack": lambda: unpack(Path(sys.argv[2]))}[sys.argv[1]]()
