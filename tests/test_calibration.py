"""STS calibration: the measures (ECE, its floor, AUROC), the sequential fit, and recording real decoding rounds."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.drafters.checkpoint import load_drafter, read_config, save_drafter
from specdecode.drafters.dspark import BlockDrafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.evaluation import calibration_report
from specdecode.evaluation.calibration_report import mix_pool, record_rounds, unseen_prompts, write_calibration
from specdecode.sampling import SamplingParams
from specdecode.training.calibration import (
    RoundRecorder,
    Rounds,
    auroc,
    calibrated_ece_floor,
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


def test_ece_floor_is_the_sampling_noise_of_a_calibrated_predictor():
    g = torch.Generator().manual_seed(0)
    small, large = (torch.rand(n, generator=g, dtype=torch.float64) * 0.6 for n in (500, 50_000))
    assert 0.01 < calibrated_ece_floor(small) < 0.08  # a few hundred rounds: percent-level noise
    assert calibrated_ece_floor(large) < 0.25 * calibrated_ece_floor(small)  # ~1/sqrt(n)
    labels = torch.bernoulli(large, generator=g)
    assert expected_calibration_error(large, labels) < 3 * calibrated_ece_floor(large)


def synthetic_rounds(n: int = 20_000, true_temperatures=(2.0, 0.5, 1.0), true_biases=(0.0, 0.0, 0.0), seed=0):
    """Logits whose real conditional survival is sigmoid(z_k / T_k + b_k): STS should find the T_k and b_k."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, len(true_temperatures), generator=g, dtype=torch.float64) * 3
    survive = torch.rand(n, len(true_temperatures), generator=g, dtype=torch.float64) < torch.sigmoid(
        logits / torch.tensor(true_temperatures, dtype=torch.float64) + torch.tensor(true_biases, dtype=torch.float64)
    )
    accepted = torch.cumprod(survive.double(), 1).sum(1)  # drafts accepted until the first failure
    return Rounds(logits, accepted)


def test_sequential_fit_recovers_the_temperatures():
    fit_half, report_half = synthetic_rounds().split()
    fit = fit_sequential_temperatures(fit_half, bias_grid=torch.zeros(1, dtype=torch.float64))  # the paper's STS
    # ECE of a binned product pins T_k only loosely (a flat minimum), hence the tolerance
    assert fit.temperatures == pytest.approx([2.0, 0.5, 1.0], rel=0.3)
    assert fit.temperatures[0] > 1.5 and fit.temperatures[1] < 0.8
    report = per_position_report(report_half, fit.temperatures)
    assert report[0]["ece_after"] < 0.02 < report[0]["ece_before"]
    assert report[1]["ece_after"] < report[1]["ece_before"]
    assert all(0.7 < r["auroc"] <= 1.0 for r in report)


def test_a_bias_mends_what_no_temperature_can():
    """Logits below 0 that overstate survival (shifted by -1): temperature-only STS stays off, the bias fits."""
    fit_half, report_half = synthetic_rounds(true_temperatures=(1.0, 1.0), true_biases=(-1.0, 0.5)).split()
    paper = fit_sequential_temperatures(fit_half, bias_grid=torch.zeros(1, dtype=torch.float64))
    # a bias every 0.1 instead of every 0.02 (BIAS_GRID): the same search, a fifth of its ~30 s
    ours = fit_sequential_temperatures(fit_half, bias_grid=torch.linspace(-2, 2, 41, dtype=torch.float64))
    assert ours.biases[0] == pytest.approx(-1.0, abs=0.35)
    assert ours.temperatures[0] == pytest.approx(1.0, rel=0.3)
    for k in range(2):
        with_bias = per_position_report(report_half, ours.temperatures, ours.biases)[k]["ece_after"]
        without = per_position_report(report_half, paper.temperatures)[k]["ece_after"]
        assert with_bias < 0.02 and with_bias < without


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
    # kept as plain floats: a small tensor per round, alive between the passes' large transient ones, fragmented
    # the heap of a 600-prompt recording to 23 GB
    assert all(type(x) is float for row in recorder.logits for x in row)


def test_calibration_refuses_a_drafter_without_confidences(tmp_path):
    target = tiny_target(vocab_size=24)
    model = make_model(target, markov_rank=0)  # DFlash: no confidence head
    save_drafter(tmp_path / "d", "dflash", model, model.config.to_dict(), target)
    with pytest.raises(SpecDecodeError, match="without a confidence head"):
        record_rounds(target, str(tmp_path / "d"), [[{"role": "user", "content": "t3 t4"}]], SamplingParams(), 4)


def test_recorded_rounds_resume_by_prompt_not_by_position(tmp_path, monkeypatch):
    """Another --prompts count builds another list (the mix is not prefix-stable): cached rounds are matched by
    the prompt's text, so a prompt is decoded once and never stands in for another."""
    monkeypatch.setattr(calibration_report, "cache_dir", lambda *_: tmp_path)  # not the kernels' cache: no rebuild
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    save_drafter(tmp_path / "d", "dspark", model, model.config.to_dict(), target)
    monkeypatch.setattr(target, "encode_chat", lambda messages: [int(t[1:]) for t in messages[0]["content"].split()])
    decoded = []
    generate = SpeculativeDecoder.generate
    monkeypatch.setattr(
        SpeculativeDecoder, "generate", lambda self, ids, *a, **k: decoded.append(ids) or generate(self, ids, *a, **k)
    )
    a, b, c = ([{"role": "user", "content": text}] for text in ("t3 t4", "t5 t6 t7", "t8 t9"))
    first = record_rounds(target, str(tmp_path / "d"), [a, b], SamplingParams(), 12)
    assert decoded == [[3, 4], [5, 6, 7]]
    alone = record_rounds(target, str(tmp_path / "d"), [b], SamplingParams(), 12)
    again = record_rounds(target, str(tmp_path / "d"), [c, b], SamplingParams(), 12)
    assert decoded == [[3, 4], [5, 6, 7], [8, 9]]  # only the new prompt was decoded
    # b's rounds come from b (the second prompt of the first list), whatever position b takes now
    rounds_a = len(first.accepted) - len(alone.accepted)
    assert torch.equal(alone.accepted, first.accepted[rounds_a:])
    assert torch.equal(again.accepted[-len(alone.accepted) :], alone.accepted)
    # a prompt with no room left for an answer in the context gives no rounds, and no error
    long = [{"role": "user", "content": " ".join(["t3"] * (target.max_context - 4))}]
    with_long = record_rounds(target, str(tmp_path / "d"), [long, b], SamplingParams(), 12)
    assert torch.equal(with_long.accepted, alone.accepted) and len(decoded) == 3


def test_a_rounds_log_cut_short_by_a_kill_resumes(tmp_path, monkeypatch):
    """A kill mid-line left a torn last line that raised a JSONDecodeError at every resume; it is redone, and the
    log stays one record a line."""
    monkeypatch.setattr(calibration_report, "cache_dir", lambda *_: tmp_path)
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    save_drafter(tmp_path / "d", "dspark", model, model.config.to_dict(), target)
    monkeypatch.setattr(target, "encode_chat", lambda messages: [int(t[1:]) for t in messages[0]["content"].split()])
    a, b = ([{"role": "user", "content": text}] for text in ("t3 t4", "t5 t6 t7"))
    first = record_rounds(target, str(tmp_path / "d"), [a, b], SamplingParams(), 12)
    (log,) = tmp_path.glob("rounds-*.jsonl")
    lines = log.read_text().splitlines()
    log.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])
    again = record_rounds(target, str(tmp_path / "d"), [a, b], SamplingParams(), 12)
    assert torch.equal(again.accepted, first.accepted)
    assert torch.allclose(again.logits, first.logits, rtol=0, atol=0, equal_nan=True)  # NaN: positions not drafted
    assert [json.loads(line)["prompt"] for line in log.read_text().splitlines()] == [
        json.loads(x)["prompt"] for x in lines
    ]


def test_calibration_is_stored_and_used(tmp_path):
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    save_drafter(tmp_path / "raw", "dspark", model, model.config.to_dict(), target)
    save_drafter(tmp_path / "d", "dspark", model, model.config.to_dict(), target)
    temperatures, biases = [2.0, 1.0, 1.0, 0.5], [0.5, -1.0, 0.0, 0.25]
    write_calibration(str(tmp_path / "d"), temperatures, biases, {"method": "test"})
    config = read_config(tmp_path / "d")
    assert config["architecture"]["calibration_temperatures"] == temperatures
    assert config["architecture"]["calibration_biases"] == biases
    assert json.loads((tmp_path / "d" / "config.json").read_text())["calibration"] == {"method": "test"}

    logits = {}  # at T = 0 the rounds are the same whatever the confidences; only the confidences move
    for name in ("raw", "d"):
        recorder = RoundRecorder(load_drafter(str(tmp_path / name), target), gamma=4)
        SpeculativeDecoder(target, recorder, draft_length=4).generate([3, 4, 5], SamplingParams(), 20)
        logits[name] = recorder.rounds().logits
    t, b = (torch.tensor(x, dtype=torch.float64) for x in (temperatures, biases))
    expected = logits["raw"] / t + b
    torch.testing.assert_close(logits["d"], expected, rtol=1e-4, atol=1e-4, equal_nan=True)


def test_unseen_prompts_of_a_packed_file_leave_out_its_conversations(smollm2, tmp_path):
    packed = Path(__file__).resolve().parents[1] / "data" / "regenerated" / "smollm2-135m.npz"
    trained = {str(i) for i in np.load(packed)["ids"]}
    prompts = unseen_prompts(smollm2, str(packed), 20)
    id_of = {c.turns[0]: c.id for c in mix_pool(trained, 20, seed=0)}  # the pool the prompts come from
    assert len(prompts) == 20 and not {id_of[p[0]["content"]] for p in prompts} & trained
    damaged = tmp_path / packed.name  # read like any packed file: its manifest's hash is checked
    damaged.write_bytes(packed.read_bytes()[:-1] + b"x")
    (tmp_path / "smollm2-135m.json").write_text((packed.parent / "smollm2-135m.json").read_text())
    with pytest.raises(SpecDecodeError, match="damaged"):
        unseen_prompts(smollm2, str(damaged), 20)


def test_greedy_requests_use_the_greedy_map(tmp_path):
    """`calibrate --temperature 0` fits a map of its own; a greedy request takes it, a sampled one the other."""
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    for name in ("raw", "d"):
        save_drafter(tmp_path / name, "dspark", model, model.config.to_dict(), target)
    sampled, greedy = ([2.0, 1.0, 1.0, 0.5], [0.5, -1.0, 0.0, 0.25]), ([0.5, 3.0, 1.0, 2.0], [-0.5, 1.0, 0.2, 0.0])
    write_calibration(str(tmp_path / "d"), *sampled, {"method": "test"})
    write_calibration(str(tmp_path / "d"), *greedy, {"method": "test greedy"}, greedy=True)
    config = read_config(tmp_path / "d")
    assert config["architecture"]["greedy_calibration_temperatures"] == greedy[0]
    assert config["greedy_calibration"] == {"method": "test greedy"}
    for params, (t, b) in ((SamplingParams(), greedy), (SamplingParams(temperature=1.0), sampled)):
        logits = {}  # the same seed gives the same rounds whatever the confidences; only they move
        for name in ("raw", "d"):
            recorder = RoundRecorder(load_drafter(str(tmp_path / name), target), gamma=4)
            SpeculativeDecoder(target, recorder, draft_length=4).generate([3, 4, 5], params, 20, seed=1)
            logits[name] = recorder.rounds().logits
        t, b = (torch.tensor(x, dtype=torch.float64) for x in (t, b))
        torch.testing.assert_close(logits["d"], logits["raw"] / t + b, rtol=1e-4, atol=1e-4, equal_nan=True)
