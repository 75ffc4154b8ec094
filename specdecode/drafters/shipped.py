"""The drafters shipped inside the package: one small trained drafter per registry target.

`--drafter default` (the default of `generate`, `demo` and `serve`) means suffix decoding combined with the
target's shipped drafter when there is one (`drafters/hybrid.py`), and suffix decoding alone otherwise.
Shipped weights are stored in bfloat16 to halve their size; they are cast to the target's dtype when loaded,
so inference runs exactly as trained up to that rounding.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.drafters.checkpoint import read_config
from specdecode.errors import SpecDecodeError

SHIPPED_DIR = Path(__file__).parent / "shipped"
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shipped_drafter(target_name: str) -> Path | None:
    """The folder of the drafter shipped for `target_name`, if the package has one."""
    folder = SHIPPED_DIR / target_name
    return folder if (folder / "config.json").is_file() else None


def export_dtype(name: str) -> torch.dtype:
    if name not in EXPORT_DTYPES:
        raise SpecDecodeError(f"unknown export dtype '{name}'; choose one of {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def cast(weights: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """`weights` with the floating-point tensors cast to `dtype` (index buffers untouched)."""
    to = export_dtype(dtype)
    return {k: (v.to(to) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}


def cast_weights(source: str | Path, dtype: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with the floating-point ones cast to `dtype` (index buffers untouched)."""
    export_dtype(dtype)  # before reading anything
    return cast(load_file(str(Path(source) / "model.safetensors")), dtype)


def write_export(source: str | Path, destination: str | Path, weights: dict[str, torch.Tensor], config: dict) -> Path:
    """Replace the folder `destination` with `weights` and `config.json`; never the source checkpoint."""
    out = Path(destination)
    if out.resolve() == Path(source).resolve():
        raise SpecDecodeError("export needs a destination other than the source checkpoint")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def export_drafter(source: str | Path, destination: str | Path, dtype: str = "bfloat16") -> Path:
    """Copy a drafter checkpoint with its floating-point weights cast to `dtype` (index buffers untouched)."""
    config = read_config(source)
    weights = cast_weights(source, dtype)
    config["exported"] = {"from": str(source), "dtype": dtype}
    return write_export(source, destination, weights, config)
