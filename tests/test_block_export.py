"""DFlash/DSpark drafters exported in vLLM's folder format and loaded back compute the same proposals;
what the formats cannot express is refused with one clear line."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specdecode.cli import main
from specdecode.drafters import build_drafter
from specdecode.drafters.base import TargetFeatures
from specdecode.drafters.block_export import export_block
from specdecode.drafters.checkpoint import read_config, save_drafter
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams
from tests.conftest import tiny_target
from tests.test_dspark import LAYERS, REDUCED, features_of, make_model

# the names vLLM's DFlashQwen3Model / Qwen3DSparkModel load (before its own q/k/v and gate/up stacking)
LAYER_KEYS = {
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
    *(f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
}
COMMON_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight"}
DSPARK_KEYS = {
    "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight",
    "confidence_head.proj.weight",
    "confidence_head.proj.bias",
}


@pytest.fixture
def target_dir(tmp_path):
    target = tiny_target(vocab_size=24)
    target.model.save_pretrained(tmp_path / "target")
    return target, tmp_path / "target"


def saved(tmp_path, target, name, **kwargs):
    model = make_model(target, **kwargs)
    kind = "dspark" if kwargs.get("markov_rank", 8) else "dflash"
    model.config.calibration_temperatures = [1.5, 0.8, 1.2, 0.9][: model.config.draft_length]
    model.config.calibration_biases = [-0.3, 0.0, 0.2, 0.1][: model.config.draft_length]
    return save_drafter(tmp_path / name, kind, model, model.config.to_dict(), target)


def proposals(drafter, target, params: SamplingParams, seed: int = 0):
    ids = torch.randint(2, 24, (14,), generator=torch.Generator().manual_seed(7))
    out = features_of(target, ids)
    result = []
    for n in (5, 9, 13):
        drafter.begin(
            ids[:n].tolist(),
            params,
            torch.Generator().manual_seed(seed),
            TargetFeatures(out.layer_hidden[: n - 1], out.last_hidden[: n - 1]),
        )
        result.append(drafter.propose(ids[:n].tolist(), 8))
    return result


@pytest.mark.parametrize(
    "fmt,draft_ids",
    [("dspark", None), ("dflash", None), ("dspark", REDUCED), ("dflash", REDUCED)],
    ids=["dspark", "dflash", "dspark-reduced-vocab", "dflash-reduced-vocab"],
)
def test_round_trip_gives_identical_proposals(tmp_path, target_dir, fmt, draft_ids):
    target, folder = target_dir
    source = saved(
        tmp_path, target, "ours", markov_rank=8 if fmt == "dspark" else 0, fill_in=fmt == "dflash", draft_ids=draft_ids
    )
    out = export_block(read_config(source), source, tmp_path / "engine", fmt, "float32", folder)
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    layer_keys = {f"layers.{i}.{k}" for i in range(2) for k in LAYER_KEYS}
    own_head = set() if draft_ids is None else {"lm_head.weight", "d2t", "t2d"}
    assert set(weights) == layer_keys | COMMON_KEYS | own_head | (DSPARK_KEYS if fmt == "dspark" else set())
    assert config["architectures"] == [{"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}[fmt]]
    # the learned mask vector is embedding row V, beyond every real token; the LM head is the target's, or the
    # drafter's own over its draft vocabulary, whose target ids are draft id + d2t (vLLM's convention)
    assert config["vocab_size"] == 25 and config["draft_vocab_size"] == (24 if draft_ids is None else len(draft_ids))
    if draft_ids is not None:
        assert weights["d2t"].dtype == torch.int64
        assert (weights["d2t"] + torch.arange(len(draft_ids))).tolist() == draft_ids.tolist()
        if fmt == "dspark":
            assert weights["markov_head.markov_w2.weight"].shape == (len(draft_ids), 8)
    assert config["dflash_config"] == {"mask_token_id": 24, "target_layer_ids": LAYERS}
    assert torch.equal(weights["embed_tokens.weight"][:24], target.model.get_input_embeddings().weight.detach())
    if fmt == "dspark":
        assert config["sample_from_anchor"] is True and config["confidence_head_with_markov"] is True
        assert weights["markov_head.markov_w1.weight"].shape == (25, 8)

    ours = build_drafter(str(source), target)
    back = build_drafter(str(out), target)  # --drafter accepts the exported folder
    assert back.config.calibration_temperatures == ours.config.calibration_temperatures
    assert back.config.calibration_biases == ours.config.calibration_biases
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for a, b in zip(proposals(ours, target, params), proposals(back, target, params), strict=True):
            assert a.tokens.tolist() == b.tokens.tolist()
            if a.confidences is not None:
                torch.testing.assert_close(a.confidences, b.confidences)


def test_what_a_format_cannot_express_is_refused(tmp_path, target_dir):
    target, folder = target_dir
    cases = [
        ("dflash", {"markov_rank": 8}, "Markov head"),
        ("dflash", {"markov_rank": 0}, "--fill-in"),
        ("dspark", {"markov_rank": 0, "fill_in": True}, "no Markov head"),
        ("dspark", {"markov_rank": 8, "head": "gated"}, "vanilla"),
        ("dspark", {"markov_rank": 8, "qk_norm": False}, "q/k norm"),
    ]
    for i, (fmt, kwargs, message) in enumerate(cases):
        source = saved(tmp_path, target, f"d{i}", **kwargs)
        with pytest.raises(SpecDecodeError, match=message):
            export_block(read_config(source), source, tmp_path / f"e{i}", fmt, "float32", folder)
        assert not (tmp_path / f"e{i}").exists()


def test_export_command_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text(json.dumps({"kind": "eagle3", "architecture": {}, "target": {}}))
    for argv, message in [
        (["export", str(tmp_path / "eagle"), str(tmp_path / "x"), "--format", "dspark"], "exports block drafters"),
        (
            ["export", str(tmp_path / "eagle"), str(tmp_path / "x"), "--format", "eagle3", "--dtype", "int3"],
            "unknown export dtype",
        ),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_import_refuses_another_target(tmp_path, target_dir):
    target, folder = target_dir
    source = saved(tmp_path, target, "ours")
    out = export_block(read_config(source), source, tmp_path / "engine", "dspark", "float32", folder)
    with pytest.raises(SpecDecodeError, match="exported for target"):
        build_drafter(str(out), tiny_target(vocab_size=24, seed=3))
    config = json.loads((out / "config.json").read_text())
    del config["specdecode"]  # a foreign folder: no fingerprint, so the shapes are checked
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="vocabulary"):
        build_drafter(str(out), tiny_target(vocab_size=30))
