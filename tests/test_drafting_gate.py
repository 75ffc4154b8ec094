"""The drafting gate: a step drafts only where the measured costs and the requests' recent yield say it pays."""

import pytest

from specdecode.drafters.dspark import BlockDrafter
from specdecode.drafters.yields import EXPLORE_EVERY, MAX_EXPLORE_EVERY, PRIOR_ROUNDS, WINDOW, DraftYield, Exploration
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.engine.drafting_gate import (
    DraftingGate,
    profile_drafting,
)
from specdecode.training.recipes import build_block_drafter
from tests.conftest import tiny_target
from tests.test_batch import _normal_greedy, _run


def compute_bound(b: int) -> float:
    """A verify pass whose cost grows with every token (many rows on a CPU)."""
    return 0.01 * b


def flat(b: int) -> float:
    """A memory-bound pass: the same cost for any number of tokens."""
    return 0.01


def test_gate_drafts_where_it_pays_and_explores_where_it_does_not():
    paying = DraftingGate(flat, lambda r: 0.001)
    paying.stepped(True)
    assert paying.choose([DraftYield(kept=2.0, verified=4.0) for _ in range(4)]) == [True] * 4
    # (4 + 8) tokens for 11 ms against 4 for 10 ms

    costly = DraftingGate(compute_bound, lambda r: 0.005 * r)
    costly.stepped(True)
    low = [DraftYield(kept=0.3, verified=2.0) for _ in range(3)] + [DraftYield(kept=0.3, verified=2.0, rounds=5)]
    steps = []
    for _ in range(8 * EXPLORE_EVERY):
        steps.append(costly.choose(low))
        for request_yield, drafted in zip(low, steps[-1], strict=True):
            if drafted:
                costly.observe(request_yield, verified=2, kept=0)
        costly.stepped(any(steps[-1]))
    # 5.2 tokens for 140 ms against 4 for 40 ms: only the exploring steps draft, one request at a time (the one
    # that drafted least: the last has 5 rounds behind it), and each try that does not pay doubles the wait (16,
    # 32, then 64 steps without drafting)
    drafting = [i for i, step in enumerate(steps) if any(step)]
    assert drafting == [EXPLORE_EVERY, 3 * EXPLORE_EVERY + 1, 7 * EXPLORE_EVERY + 2]
    assert [steps[i] for i in drafting] == [
        [True, False, False, False],
        [False, True, False, False],
        [False, False, True, False],
    ]
    assert costly.choose([]) == []  # nothing to draft for


def test_exploration_backs_off_until_a_round_pays_on_its_merits():
    exploration = Exploration(without=0)
    waits = []
    for _ in range(5):
        while not exploration.due():
            exploration.skipped()
        waits.append(exploration.without)
        exploration.ran(tried=True)
    assert waits == [EXPLORE_EVERY, 2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, MAX_EXPLORE_EVERY, MAX_EXPLORE_EVERY]
    exploration.ran(tried=False)  # chosen on its merits: tried again soon after it stops paying
    assert exploration.every == EXPLORE_EVERY and not exploration.due()


def test_gate_picks_the_requests_whose_drafts_pay():
    """A memory-bound pass: drafting costs 1 ms a request, so only the request that keeps a whole draft a step
    pays for its drafting (5 tokens for 11 ms; all four: 5.9 for 14 ms; none: 4 for 10 ms)."""
    gate = DraftingGate(flat, lambda r: 0.001 * r)
    gate.stepped(True)
    yields = [DraftYield(kept=k, verified=2.0) for k in (0.3, 0.3, 1.0, 0.3)]
    assert gate.choose(yields) == [False, False, True, False]


def test_gate_prices_the_pass_by_its_tokens():
    """A pass of 10 ms plus 5 ms a token (the rows' tokens packed): the request keeping both of its 2 drafts
    pays for them (6 tokens for 41 ms against 4 for 30 ms), and one keeping 0.3 of 2 would not (6.3 for 52 ms)."""
    gate = DraftingGate(lambda b: 0.01 + 0.005 * b, lambda r: 0.001 * r)
    gate.stepped(True)
    yields = [DraftYield(kept=k, verified=2.0) for k in (0.3, 0.3, 2.0, 0.3)]
    assert gate.choose(yields) == [False, False, True, False]


def test_yield_means_count_every_drafting_round_then_a_long_window():
    gate = DraftingGate(flat, lambda r: 0.0)
    request = gate.new_request()  # kept 1, verified 1: the prior, worth PRIOR_ROUNDS rounds
    rounds = [(3, 2)] * 10 + [(3, 0)] * 4  # a run of misses moves the mean only as much as its share
    for verified, kept in rounds:
        gate.observe(request, verified=verified, kept=kept)
    assert request.kept == pytest.approx((PRIOR_ROUNDS + 20) / (PRIOR_ROUNDS + 14))
    assert request.verified == pytest.approx((PRIOR_ROUNDS + 42) / (PRIOR_ROUNDS + 14))
    later = gate.new_request()  # a new request starts from the engine's mean
    assert later.kept == pytest.approx(request.kept)
    for _ in range(20 * WINDOW):  # past WINDOW rounds the mean forgets: it follows a change of yield
        gate.observe(later, verified=3, kept=2)
    assert abs(later.kept - 2) < 0.01 and abs(later.verified - 3) < 0.01


def test_gated_engine_skips_drafting_that_cannot_pay_and_stays_lossless():
    """Drafting priced far above a verify pass: the engine decodes mostly without drafts, and its greedy
    output is still normal decoding's."""
    target = tiny_target(vocab_size=32, seed=3)
    drafter = BlockDrafter(build_block_drafter("dspark", target, num_layers=1, block_size=4, target_layer_ids=[0]))
    target.set_capture_layers(drafter.target_layer_ids)
    prompts = [[3, 4, 5, 6, 7, 8, 9][:n] for n in (2, 7, 4)]
    references = [_normal_greedy(target, p, 40) for p in prompts]
    config = EngineConfig(max_batch=3, max_len=64, draft_length=4, scheduler="prefix")
    engine = ContinuousEngine(target, drafter, config, lambda b: 1 / compute_bound(b), draft_s=lambda r: 1.0)
    assert [c.token_ids for c in _run(engine, prompts, 40)] == references
    steps = engine.metrics.verify_rows.collect()[0].samples
    passes = next(s.value for s in steps if s.name.endswith("_count"))
    assert engine.metrics.steps_without_drafting >= passes - passes // EXPLORE_EVERY - 2  # only exploring
    assert engine.metrics.steps_without_drafting > 0


def test_the_gate_prices_a_hybrid_at_its_model(monkeypatch, tmp_path):
    """Timed whole, a hybrid that finds its model too costly times its suffix lookups alone (microseconds);
    the gate must price a drafting step at the model's batched pass, which the hybrid may run in it."""
    from specdecode.drafters.hybrid import HybridDrafter, RoundCosts
    from specdecode.models import sps

    target = tiny_target(vocab_size=32, seed=3)
    model = BlockDrafter(build_block_drafter("dspark", target, num_layers=1, block_size=4, target_layer_ids=[0]))
    hybrid = HybridDrafter(model, costs=RoundCosts.flat(0.01, 1.0))  # a model round priced at 100 light ones
    monkeypatch.setattr(sps, "measurement_file", lambda kind, key: tmp_path / f"{abs(hash(str(key)))}.json")
    batches = []
    propose_batch = BlockDrafter.propose_batch.__func__
    monkeypatch.setattr(
        BlockDrafter,
        "propose_batch",
        classmethod(lambda cls, ds, *a: batches.append(len(ds)) or propose_batch(cls, ds, *a)),
    )
    table = profile_drafting(target, hybrid, max_requests=4, draft_length=4, context=16, reps=1)
    assert table.tokens == [1, 2, 4] and {1, 2, 4} <= set(batches)


def test_drafting_is_timed_in_a_later_round_just_after_a_target_pass(monkeypatch, tmp_path):
    """Each timed `propose_batch` is a round after the first, as decoding meets it: every request has just
    observed a round's committed tokens, whose target features a block drafter projects in that call, and a
    target pass has just taken the caches. Timed after the prompt's features were taken in and right after
    other drafting calls, one request's DSpark round was priced at 1.4-1.7 ms where it takes 2.2 ms on a
    2-core EPYC. Here taking in a round's features costs 20 ms a request, and cold caches 20 ms a call."""
    import time

    from specdecode.drafters.base import Drafter
    from specdecode.models import sps

    caches = {"cold": True}

    class Projecting(Drafter):
        def begin(self, prompt_ids, params, generator, features) -> None:
            self.pending = features.last_hidden.shape[0]
            caches["cold"] = False

        def observe(self, ids, num_accepted, features) -> None:
            self.pending = features.last_hidden.shape[0]
            caches["cold"] = False

        @classmethod
        def propose_batch(cls, drafters, ids, max_tokens):
            time.sleep(0.02 * sum(d.pending > 0 for d in drafters) + 0.02 * caches["cold"])
            caches["cold"] = False
            for d in drafters:
                d.pending = 0
            return super().propose_batch(drafters, ids, max_tokens)

    target = tiny_target(vocab_size=32, seed=3)
    forward = target.forward

    def target_pass(*args, **kwargs):
        caches["cold"] = True
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", target_pass)
    monkeypatch.setattr(sps, "measurement_file", lambda kind, key: tmp_path / "drafting.json")  # measured here
    table = profile_drafting(target, Projecting(), max_requests=2, draft_length=4, context=16, reps=2)
    assert table.step_seconds(1) >= 0.04 and table.step_seconds(2) >= 0.06


def test_one_request_decoding_leaves_a_self_gating_drafter_alone():
    """The hybrid chooses per round between suffix, model and nothing with its own round costs; a second
    gate on top would price its free suffix rounds as model drafting."""
    from specdecode.drafters.hybrid import HybridDrafter, RoundCosts
    from specdecode.engine.decode import SpeculativeDecoder

    target = tiny_target(vocab_size=32, seed=3)
    model = BlockDrafter(build_block_drafter("dspark", target, num_layers=1, block_size=4, target_layer_ids=[0]))
    assert SpeculativeDecoder(target, model, 4, scheduler="prefix").gate is not None
    hybrid = HybridDrafter(model, costs=RoundCosts.flat(0.01, 0.012))
    assert SpeculativeDecoder(target, hybrid, 4, scheduler="prefix").gate is None


def test_the_engine_leaves_a_self_gating_drafter_alone_with_one_request():
    """With one request the engine's step is one-request decoding: the hybrid drafts (or looks up) every step
    even where the gate would refuse; with two requests in the pass the gate decides again."""
    from specdecode.drafters.hybrid import HybridDrafter, RoundCosts

    target = tiny_target(vocab_size=32, seed=3)
    model = BlockDrafter(build_block_drafter("dspark", target, num_layers=1, block_size=4, target_layer_ids=[0]))
    target.set_capture_layers(model.target_layer_ids)
    config = EngineConfig(max_batch=2, max_len=64, draft_length=4, scheduler="prefix")
    for prompts, skipped in (([[3, 4, 5]], False), ([[3, 4, 5], [6, 7, 8, 9]], True)):
        hybrid = HybridDrafter(model, costs=RoundCosts.flat(0.01, 0.012))
        engine = ContinuousEngine(target, hybrid, config, lambda b: 1 / compute_bound(b), draft_s=lambda r: 1.0)
        outputs = [c.token_ids for c in _run(engine, prompts, 24)]
        assert outputs == [_normal_greedy(target, p, 24) for p in prompts]
        assert (engine.metrics.steps_without_drafting > 0) == skipped
