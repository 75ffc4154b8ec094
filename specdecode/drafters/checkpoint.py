"""Drafter checkpoints: a folder with `config.json` and `model.safetensors`.

The config records the drafter kind and architecture, the target's identity (name and a fingerprint of
its config and embedding), the target layer ids with their indexing convention, the training recipe and
any calibration. A drafter only makes sense for the target whose features it learned, so loading one
against another target is refused.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.drafters.layers import freeze_norms
from specdecode.errors import SpecDecodeError
from specdecode.models.linear import DRAFTER_ROWS, freeze_linears
from specdecode.models.target import Target, first_line

FORMAT_VERSION = 1
LAYER_CONVENTION = "output_of_layer"  # see specdecode/models/target.py
LEGACY_BLOCK_DEFAULTS = {"qk_norm": False}  # what block drafters computed before a field existed


def save_drafter(
    path: str | Path, kind: str, model: torch.nn.Module, architecture: dict, target: Target, recipe: dict | None = None
) -> Path:
    """Write the trainable weights and the config; the target's frozen parts are never stored."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"))
    config = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "architecture": architecture,
        "target": {"name": target.name, "fingerprint": target.fingerprint()},
        "target_layer_ids": architecture.get("target_layer_ids", []),
        "layer_index_convention": LAYER_CONVENTION,
        "recipe": recipe or {},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


def read_config(path: str | Path) -> dict:
    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError as e:
        raise SpecDecodeError(f"{folder} is not a drafter checkpoint: no config.json") from e
    except (OSError, json.JSONDecodeError) as e:
        raise SpecDecodeError(f"drafter checkpoint {folder} has an unreadable config.json ({first_line(e)})") from e
    for key in ("kind", "architecture", "target"):
        if key not in config:
            raise SpecDecodeError(f"drafter checkpoint {folder} is broken: config.json has no '{key}'")
    if config.get("layer_index_convention", LAYER_CONVENTION) != LAYER_CONVENTION:
        raise SpecDecodeError(f"drafter checkpoint {folder} uses layer convention {config['layer_index_convention']}")
    return config


def check_target(config: dict, target: Target, path: str | Path) -> None:
    expected = config["target"].get("fingerprint")
    actual = target.fingerprint()
    if expected != actual:
        raise SpecDecodeError(
            f"drafter {path} was trained for target '{config['target'].get('name')}' (fingerprint {expected}), "
            f"not for '{target.name}' (fingerprint {actual})"
        )


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of `path/model.safetensors`, or one clear error for a truncated or foreign file."""
    file = Path(path) / "model.safetensors"
    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises several types for a truncated or foreign file
        raise SpecDecodeError(f"drafter weights {file} cannot be read ({first_line(e)})") from e


def load_state(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: str | Path) -> None:
    """Load `weights` (read from the drafter at `path`) into `model`: every tensor, of the right shape."""
    file = Path(path) / "model.safetensors"
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        raise SpecDecodeError(
            f"drafter weights {file} do not match the architecture in config.json ({first_line(e)})"
        ) from e
    if missing or unexpected:
        raise SpecDecodeError(
            f"drafter weights {file} do not match the architecture in config.json "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def load_weights(model: torch.nn.Module, path: str | Path) -> None:
    load_state(model, read_weights(path), path)


def frozen(
    model: torch.nn.Module, kind: str, target: Target, eight_bit_inputs: bool | None = None, rows: str = DRAFTER_ROWS
) -> torch.nn.Module:
    """A loaded drafter is inference-only: its linears take the target's weight dtype (bfloat16 where the
    machine chose it: half the bytes a round), GGUF `rows` (`freeze_linears`) and 8-bit inputs where the target's
    plan took 8-bit inputs (unless `eight_bit_inputs` says otherwise), and the kernels measured on this machine."""
    model = model.to(target.device).eval()
    if eight_bit_inputs is None:
        eight_bit_inputs = target.eight_bit_inputs
    freeze_linears(model, f"{kind}-drafter", dtype=target.dtype, eight_bit_inputs=eight_bit_inputs, rows=rows)
    if target.device.type == "cpu":
        freeze_norms(model)
    return model


def load_model(path: str | Path, target: Target) -> tuple[str, torch.nn.Module]:
    """The kind and the trainable model stored at `path` (float32, not frozen), refusing a checkpoint made for
    another target: what `load_drafter` serves and `specdecode train --init` fine-tunes."""
    config = read_config(path)
    check_target(config, target, path)
    kind = config["kind"]
    if kind in ("dspark", "dflash"):
        from specdecode.drafters.dspark import DSparkConfig, DSparkModel

        try:
            arch = DSparkConfig(**{**LEGACY_BLOCK_DEFAULTS, **config["architecture"]})
        except TypeError as e:
            raise SpecDecodeError(f"drafter checkpoint {path} has an invalid architecture ({first_line(e)})") from e
        try:  # with a reduced draft vocabulary: placeholder maps, replaced by the checkpoint's d2t and t2d
            model = DSparkModel(arch, target.model.get_input_embeddings(), target.output_head())
        except (IndexError, RuntimeError, SpecDecodeError) as e:
            raise SpecDecodeError(f"drafter checkpoint {path} has an invalid architecture ({first_line(e)})") from e
    elif kind == "eagle3":
        from specdecode.drafters.eagle3 import Eagle3Config, Eagle3Model

        try:
            arch = Eagle3Config(**config["architecture"])
            # placeholder vocabulary maps, replaced by the checkpoint's d2t and t2d
            model = Eagle3Model(
                arch,
                target.model.get_input_embeddings(),
                target.output_head(),
                torch.arange(arch.draft_vocab_size),
            )
        except (TypeError, IndexError, RuntimeError, SpecDecodeError) as e:
            raise SpecDecodeError(f"drafter checkpoint {path} has an invalid architecture ({first_line(e)})") from e
    else:
        raise SpecDecodeError(f"drafter checkpoint {path} has unknown kind '{kind}'")
    load_weights(model, path)
    if not model.vocab_maps_agree():
        raise SpecDecodeError(f"drafter checkpoint {path} is broken: its d2t and t2d vocabulary maps disagree")
    return kind, model


def load_drafter(path: str | Path, target: Target, eight_bit_inputs: bool | None = None):
    """Build the drafter stored at `path` for `target`, ready to draft (frozen, in the target's dtype; on 8-bit
    inputs and GGUF rows where the target takes 8-bit inputs, unless `eight_bit_inputs` says otherwise: `frozen`)."""
    kind, model = load_model(path, target)
    model = frozen(model, kind, target, eight_bit_inputs)
    if kind == "eagle3":
        from specdecode.drafters.eagle3 import Eagle3Drafter

        return Eagle3Drafter(model, fingerprint=target.fingerprint())
    from specdecode.drafters.dspark import BlockDrafter

    return BlockDrafter(model)
