"""The shipped default drafter and `specdecode export`."""

import torch

from specdecode.drafters import build_drafter
from specdecode.drafters.base import Drafter
from specdecode.drafters.checkpoint import load_drafter, save_drafter
from specdecode.drafters.shipped import export_drafter, shipped_drafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.sampling import SamplingParams
from tests.conftest import tiny_target
from tests.test_dspark import make_model


def test_export_casts_weights_and_still_loads(tmp_path):
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    save_drafter(tmp_path / "fp32", "dspark", model, model.config.to_dict(), target)
    out = export_drafter(tmp_path / "fp32", tmp_path / "bf16")
    assert (out / "model.safetensors").stat().st_size < 0.6 * (tmp_path / "fp32" / "model.safetensors").stat().st_size
    loaded = load_drafter(out, target)
    assert loaded.model.fc.weight.dtype == torch.float32  # cast back to the target's dtype on load
    assert torch.equal(loaded.model.fc.weight, model.fc.weight.bfloat16().float())


def test_default_falls_back_to_suffix_decoding_without_a_shipped_drafter():
    assert shipped_drafter("tiny") is None
    assert isinstance(build_drafter("default", tiny_target()), SuffixDrafter)


def test_shipped_drafter_serves_the_default_target_losslessly(smollm2):
    assert shipped_drafter(smollm2.name) is not None
    drafter = build_drafter("default", smollm2)
    assert drafter.name == "suffix+dspark" and drafter.model.config.calibration_temperatures
    prompt = smollm2.encode("What is 12 times 7? Answer briefly.")
    params = SamplingParams()
    reference = SpeculativeDecoder(smollm2, Drafter(), 0).generate(prompt, params, max_new_tokens=48)[0]
    got = SpeculativeDecoder(smollm2, drafter, 7).generate(prompt, params, max_new_tokens=48)[0]
    assert got.token_ids == reference.token_ids
    assert got.stats.mean_accepted_length > 1.0
