"""STS calibration: the measures (ECE, AUROC), the sequential fit, and recording real decoding rounds."""

import json

import pytest
import torch

from specdecode.drafters.checkpoint import read_config, save_drafter
from specdecode.drafters.dspark import BlockDrafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.calibration_report import record_rounds, write_temperatures
from specdecode.sampling import SamplingParams
from specdecode.training.calibration import (
    RoundRecorder,
    Rounds,
    auroc,
    cumulative_confidence,
    expected_calibration_error,
    fit_sequential_temperatures,
    per_position_report,
)
from tests.conftest import tiny_target
from tests.test_dspark import make_model


def test_ece_is_zero_when_calibrated_and_large_when_not():
    predicted = torch.tensor([0.25] * 4 + [0.75] * 4, dtype=torch.float64)
    label = torch.tensor([1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.float64)
    assert expected_calibration_error(predicted, label) == pytest.approx(0.0)
    assert expected_calibration_error(torch.full((8,), 0.95, dtype=torch.float64), label) == pytest.approx(0.45)


def test_auroc_orders_and_ties():
    label = torch.tensor([0, 0, 1, 1], dtype=torch.float64)
    assert auroc(torch.tensor([0.1, 0.2, 0.3, 0.4]), label) == pytest.approx(1.0)
    assert auroc(torch.tensor([0.4, 0.3, 0.2, 0.1]), label) == pytest.approx(0.0)
    assert auroc(torch.full((4,), 0.5), label) == pytest.approx(0.5)
    assert auroc(torch.tensor([0.1, 0.3, 0.2, 0.4]), label) == pytest.approx(0.75)


def synthetic_rounds(n: int = 20_000, true_temperatures=(2.0, 0.5, 1.0), seed: int = 0) -> Rounds:
    """Logits whose real conditional survival is sigmoid(z_k / T_k): STS should find the T_k."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, len(true_temperatures), generator=g, dtype=torch.float64) * 3
    survive = torch.rand(n, len(true_temperatures), generator=g, dtype=torch.float64) < torch.sigmoid(
        logits / torch.tensor(true_temperatures, dtype=torch.float64)
    )
    accepted = torch.cumprod(survive.double(), 1).sum(1)  # drafts accepted until the first failure
    return Rounds(logits, accepted)


def test_sequential_fit_recovers_the_temperatures():
    fit_half, report_half = synthetic_rounds().split()
    fit = fit_sequential_temperatures(fit_half)
    # ECE of a binned product pins T_k only loosely (a flat minimum), hence the tolerance
    assert fit.temperatures == pytest.approx([2.0, 0.5, 1.0], rel=0.3)
    assert fit.temperatures[0] > 1.5 and fit.temperatures[1] < 0.8
    report = per_position_report(report_half, fit.temperatures)
    assert report[0]["ece_after"] < 0.02 < report[0]["ece_before"]
    assert report[1]["ece_after"] < report[1]["ece_before"]
    assert all(0.7 < r["auroc"] <= 1.0 for r in report)


def test_labels_follow_prefix_survival_and_proposal_length():
    rounds = Rounds(
        torch.tensor([[0.0, 0.0, torch.nan], [1.0, 2.0, 3.0]], dtype=torch.float64), torch.tensor([1.0, 3.0])
    )
    labels = rounds.labels()
    assert labels[0, :2].tolist() == [1.0, 0.0] and labels[0, 2].isnan()
    assert labels[1].tolist() == [1.0, 1.0, 1.0]
    assert cumulative_confidence(rounds.logits, torch.ones(3, dtype=torch.float64))[1, 1] == pytest.approx(
        torch.sigmoid(torch.tensor(1.0)) * torch.sigmoid(torch.tensor(2.0))
    )


def test_recorder_matches_the_engine_accounting():
    target = tiny_target(vocab_size=24)
    recorder = RoundRecorder(BlockDrafter(make_model(target)), gamma=4)
    completion = SpeculativeDecoder(target, recorder, draft_length=4).generate([3, 4, 5], SamplingParams(), 30)[0]
    rounds = recorder.rounds()
    accepted = [n - 1 for n in completion.stats.accepted_lengths]  # the last round may draft nothing (no room)
    assert len(accepted) - 1 <= len(rounds.accepted) <= len(accepted)
    assert rounds.accepted.tolist() == accepted[: len(rounds.accepted)]
    assert not rounds.logits[:, 0].isnan().any()


def test_calibration_refuses_a_drafter_without_confidences(tmp_path):
    target = tiny_target(vocab_size=24)
    model = make_model(target, markov_rank=0)  # DFlash: no confidence head
    save_drafter(tmp_path / "d", "dflash", model, model.config.to_dict(), target)
    with pytest.raises(SpecDecodeError, match="without a confidence head"):
        record_rounds(target, str(tmp_path / "d"), [[{"role": "user", "content": "t3 t4"}]], SamplingParams(), 4)


def test_temperatures_are_stored_and_used(tmp_path):
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    save_drafter(tmp_path / "d", "dspark", model, model.config.to_dict(), target)
    write_temperatures(str(tmp_path / "d"), [2.0, 1.0, 1.0, 0.5], {"method": "test"})
    config = read_config(tmp_path / "d")
    assert config["architecture"]["calibration_temperatures"] == [2.0, 1.0, 1.0, 0.5]
    assert json.loads((tmp_path / "d" / "config.json").read_text())["calibration"] == {"method": "test"}
