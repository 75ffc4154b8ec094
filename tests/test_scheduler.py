"""Algorithm 1 (prefix scheduler), its static modes, and the SPS(B) cost table."""

import time

import pytest
import torch

from specdecode import machine
from specdecode.engine.scheduler import prefix_survival, schedule, schedule_prefix, schedule_threshold
from specdecode.errors import SpecDecodeError
from specdecode.models.sps import StepCostTable, load_or_profile, profile_steps
from specdecode.verify import verify_block


def table(values: dict[int, float]):
    return lambda b: values[b]


def test_prefix_survival_is_the_cumulative_product():
    assert prefix_survival(torch.tensor([0.9, 0.5, 0.2])).tolist() == pytest.approx([0.9, 0.45, 0.09])


def test_flat_cost_verifies_every_useful_draft():
    # a memory-bound pass: SPS does not fall with B, so every pair with a > 0 raises tau * SPS
    survivals = [torch.tensor([0.9, 0.5]), torch.tensor([0.3, 0.1, 0.05])]
    assert schedule_prefix(survivals, lambda b: 10.0) == [2, 3]


def test_admission_follows_decreasing_survival_across_requests():
    # SPS falls 10% per extra token: only pairs with a > ~0.1 * tau pay for themselves
    sps = table({b: 1.0 / (1 + 0.1 * (b - 2)) for b in range(2, 10)})
    survivals = [torch.tensor([0.95, 0.9, 0.2]), torch.tensor([0.6, 0.1, 0.01])]
    assert schedule_prefix(survivals, sps) == [2, 1]


def test_expensive_pass_verifies_nothing():
    assert schedule_prefix([torch.tensor([0.8, 0.6])], table({1: 1.0, 2: 0.5, 3: 0.45})) == [0]


def appendix_a_first_token_distribution(early_stop: bool, trials: int = 40_000) -> torch.Tensor:
    """The paper's Appendix A: one request, gamma = 2, a_1 = 0.8, SPS(1, 2, 3) = (1.0, 0.5, 0.45),
    target p = (0.7, 0.3), draft q = (0.5, 0.5). The second confidence depends on the sampled x_1 (as
    through the Markov head): high after token 0, low after token 1. Returns the frequencies of the
    first committed token."""
    p, q = torch.tensor([0.7, 0.3]), torch.tensor([0.5, 0.5])
    second_confidence = {0: 0.9, 1: 0.1}
    sps = table({1: 1.0, 2: 0.5, 3: 0.45})
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(2)
    for _ in range(trials):
        x1 = int(torch.multinomial(q, 1, generator=generator))
        confidences = torch.tensor([0.8, second_confidence[x1]])
        (length,) = schedule_prefix([prefix_survival(confidences)], sps, early_stop=early_stop)
        drafts = torch.tensor([x1, 0])[:length]
        target_probs = torch.stack([p, p, p])[: length + 1]
        result = verify_block(target_probs, drafts, torch.stack([q, q])[:length], generator)
        counts[result.tokens[0]] += 1
    return counts / trials


def test_appendix_a_early_stop_keeps_the_target_distribution():
    freq = appendix_a_first_token_distribution(early_stop=True)
    assert freq[0].item() == pytest.approx(0.7, abs=0.01)


def test_appendix_a_global_search_shifts_the_distribution():
    # theta(0) = 1.0, theta(1) = 1.8 * 0.5 = 0.9 (no gain: the early stop ends here), theta(2) = (1.8 + a_2) * 0.45
    # exceeds 1.0 only when x_1 = 0 (a_2 = 0.72): x_1 = 0 is then always verified and accepted -> (0.85, 0.15)
    freq = appendix_a_first_token_distribution(early_stop=False)
    assert freq[0].item() == pytest.approx(0.85, abs=0.01)


def test_threshold_truncates_at_first_low_confidence():
    assert schedule_threshold([torch.tensor([0.9, 0.4, 0.9]), torch.tensor([0.8, 0.7])], 0.5) == [1, 2]


def test_schedule_modes_and_errors():
    conf = [torch.tensor([0.9, 0.8, 0.1])]
    assert schedule("fixed", [None, None], [7, 2]) == [7, 2]
    assert schedule("threshold", conf, [3], threshold=0.5) == [2]
    assert schedule("prefix", conf, [3], steps_per_s=lambda b: 1.0) == [3]
    with pytest.raises(SpecDecodeError, match="confidence head"):
        schedule("prefix", [None], [7], steps_per_s=lambda b: 1.0)
    with pytest.raises(SpecDecodeError, match="SPS"):
        schedule("prefix", conf, [3])
    with pytest.raises(SpecDecodeError, match="unknown scheduler"):
        schedule("global", conf, [3])


def test_cost_table_interpolates_and_extrapolates():
    t = StepCostTable(tokens=[1, 2, 4], seconds=[0.010, 0.012, 0.020], key={})
    assert t.step_seconds(2) == pytest.approx(0.012)
    assert t.step_seconds(3) == pytest.approx(0.016)
    assert t.step_seconds(6) == pytest.approx(0.028)
    assert t.steps_per_s(1) == pytest.approx(100.0)
    with pytest.raises(SpecDecodeError):
        t.step_seconds(0)


def foreign_load_reporting(cores: list[float]):
    """A stand-in for `ForeignLoad` whose measurements report `cores` in turn, then a quiet machine."""

    class FakeLoad:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.cores = cores.pop(0) if cores else 0.0

    return FakeLoad


def test_profile_is_cached_per_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(machine, "ForeignLoad", foreign_load_reporting([]))  # quiet: no sweep is measured again
    calls = []

    def run_pass(b: int) -> None:
        calls.append(b)

    first = load_or_profile("fake costs", {"target": "fake"}, run_pass, sizes=(1, 2), reps=2)
    assert len(calls) == 5 and first.tokens == [1, 2]  # warm-up + 2 reps x 2 sizes
    assert "measuring fake costs on this machine" in capsys.readouterr().err  # a first run says what it waits for
    again = load_or_profile("fake costs", {"target": "fake"}, run_pass, sizes=(1, 2), reps=2)
    assert len(calls) == 5 and again.seconds == first.seconds and not capsys.readouterr().err
    with pytest.raises(SpecDecodeError):
        profile_steps(run_pass, sizes=(2, 1))


def test_profile_measures_again_a_sweep_while_others_were_busy(monkeypatch):
    """A sweep during which other processes used the cores (here: the first two, made 100x slower) is not
    kept: a cost table measured under load would mislead the scheduler until the kernels change."""
    busy_sweeps = [2.0, 2.0]  # foreign cores reported for the first sweeps; then a quiet machine
    seconds = {"per_token": 1e-3}
    calls = []

    def run_pass(b: int) -> None:
        calls.append(b)
        slow = 100 if busy_sweeps and len(calls) > 1 else 1  # the warm-up pass is call 1
        time.sleep(seconds["per_token"] * b * slow / 10)

    monkeypatch.setattr(machine, "ForeignLoad", foreign_load_reporting(busy_sweeps))
    measured = profile_steps(run_pass, sizes=(1, 2), reps=3)
    assert len(calls) == 1 + 2 * (2 + 3)  # warm-up, two busy sweeps measured again, three quiet ones
    assert measured[1] < 0.01  # no 100x sweep in the medians (quiet: 0.2 ms per pass of 2 tokens)


def test_cost_ratios_are_the_ones_most_sweeps_measured():
    """Decisions read a cost table as ratios. When the machine drifts between sweeps, each column's own median can
    come from another sweep: here two of three sweeps measured the second column at 2.2x the first, yet the
    columns' medians (2 and 3) say 1.5x; `ratio_medians` keeps 2.2x at the reference column's median."""
    sweeps = [[1.0, 2.2], [2.0, 3.0], [3.0, 6.6]]
    reference, second = machine.ratio_medians(sweeps)
    assert reference == 2.0 and second == pytest.approx(4.4)
    assert machine.ratio_medians(sweeps, reference=1) == pytest.approx([3.0 / 2.2, 3.0])  # 1 / 2.2 of column 1's 3
    assert machine.ratio_medians([[0.0, 1.0], [0.0, 3.0], [0.0, 2.0]]) == [0.0, 2.0]  # no ratio to a 0 s pass


def test_replay_counts_tokens_and_costs():
    from specdecode.evaluation.scheduler_bench import replay
    from specdecode.training.calibration import Rounds

    rounds = Rounds(torch.zeros(2, 3, dtype=torch.float64), torch.tensor([0.0, 3.0]))
    confidences = torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]], dtype=torch.float64)
    costs = StepCostTable(tokens=[1, 16], seconds=[0.01, 0.01], key={})

    def fixed(n):
        return lambda s, c: [n] * len(s)

    full = replay(rounds, confidences, fixed(3), 2, costs, draft_s=0.01, trials=400)  # one drafting call for both
    # each request yields 1 + accepted (0 or 3, equally likely): 2 requests -> 2 + 3 on average
    assert full["tokens_per_step"] == pytest.approx(5.0, abs=0.3)
    assert full["verify_tokens"] == 8
    assert full["tokens_per_s"] == pytest.approx(full["tokens_per_step"] / 0.02)
    none_verified = replay(rounds, confidences, fixed(0), 2, costs, draft_s=0.01, trials=10)
    assert none_verified["tokens_per_s"] == pytest.approx(2 / 0.02)  # drafted, then verified nothing
    normal = replay(rounds, confidences, fixed(0), 2, costs, draft_s=0.005, trials=10, drafting=False)
    assert normal["tokens_per_step"] == 2 and normal["tokens_per_s"] == pytest.approx(200.0)  # no drafting cost


@pytest.mark.parametrize("mode", ["prefix", "threshold"])
def test_scheduled_decoding_stays_lossless(mode, tmp_path, monkeypatch):
    """Verifying only a confident prefix of each DSpark block changes speed, never the output; nor does the
    drafting gate's skipping of rounds (made to alternate here, whatever the tiny target's costs say)."""
    from collections import Counter

    from specdecode.drafters.base import Drafter
    from specdecode.drafters.dspark import BlockDrafter
    from specdecode.engine.decode import SpeculativeDecoder
    from specdecode.engine.drafting_gate import DraftingGate
    from specdecode.sampling import SamplingParams
    from tests.conftest import tiny_target
    from tests.test_dspark import make_model
    from tests.test_lossless import exact_two_token_distribution
    from tests.test_verify import chi_square_pvalue

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the SPS table is profiled into a fresh cache
    monkeypatch.setattr(DraftingGate, "choose", lambda gate, yields: [gate.exploration.without >= 1] * len(yields))
    target = tiny_target(vocab_size=12)
    decoder = SpeculativeDecoder(target, BlockDrafter(make_model(target)), 4, scheduler=mode, threshold=0.3)
    prompt = [3, 4, 5, 6]
    greedy = decoder.generate(prompt, SamplingParams(), max_new_tokens=30)[0]
    reference = SpeculativeDecoder(target, Drafter(), 0).generate(prompt, SamplingParams(), max_new_tokens=30)[0]
    assert greedy.token_ids == reference.token_ids
    params = SamplingParams(temperature=1.0)
    n = 1500
    completions = decoder.generate(prompt, params, max_new_tokens=2, seed=3, num_samples=n)
    counts = Counter(tuple(c.token_ids) for c in completions)
    assert chi_square_pvalue(counts, exact_two_token_distribution(target, prompt, params), n) > 1e-3


def test_scheduler_needs_confidences():
    from specdecode.drafters.ngram import NgramDrafter
    from specdecode.engine.decode import SpeculativeDecoder
    from tests.conftest import tiny_target

    with pytest.raises(SpecDecodeError, match="confidences"):
        SpeculativeDecoder(tiny_target(), NgramDrafter(), 4, scheduler="prefix")
    with pytest.raises(SpecDecodeError, match="unknown scheduler"):
        SpeculativeDecoder(tiny_target(), NgramDrafter(), 4, scheduler="global")


def test_auto_picks_prefix_for_chains_with_confidences():
    """The command line's default: DSpark's scheduler where the drafter's chains carry confidences (not for trees,
    which it cannot schedule), `fixed` for the rest; a mode given by name is kept."""
    from specdecode.drafters.ngram import NgramDrafter
    from specdecode.engine.scheduler import AUTO, resolve_scheduler

    confident = NgramDrafter()
    confident.has_confidences = True
    assert resolve_scheduler(AUTO, confident) == "prefix"
    assert resolve_scheduler(AUTO, confident, tree=True) == "fixed"
    assert resolve_scheduler(AUTO, NgramDrafter()) == "fixed"
    assert [resolve_scheduler(m, confident) for m in ("fixed", "threshold")] == ["fixed", "threshold"]


def test_draft_seconds_are_measured_per_batch_size():
    """The replay's drafting cost is one batched call per step, measured for every R."""
    from specdecode.drafters.dspark import BlockDrafter
    from specdecode.evaluation.scheduler_bench import measure_draft_seconds
    from specdecode.sampling import SamplingParams
    from tests.conftest import tiny_target
    from tests.test_dspark import make_model

    target = tiny_target(vocab_size=24)
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    prompts = [[{"role": "user", "content": " ".join(f"t{2 + (i + j) % 20}" for j in range(5 + i))}] for i in range(3)]
    seconds = measure_draft_seconds(target, BlockDrafter(make_model(target)), prompts, SamplingParams(), (1, 4))
    assert list(seconds) == [1, 4] and all(t > 0 for t in seconds.values())
