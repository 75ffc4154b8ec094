"""Suffix decoding and the hybrid proposer: the index counts exactly, proposals follow the evidence, and
decoding with either stays lossless (exact at temperature 0, the target's distribution at temperature 1)."""

import copy
import math
import random
import time
from collections import Counter

import pytest
import torch

from specdecode.drafters import hybrid as hybrid_module
from specdecode.drafters.base import EMPTY_PROPOSAL, Proposal
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.hybrid import HybridDrafter, RoundCosts, round_costs
from specdecode.drafters.suffix import (
    AcceptanceTable,
    GlobalSuffixIndex,
    SuffixAutomaton,
    SuffixDrafter,
    SuffixSettings,
)
from specdecode.drafters.yields import DraftYield
from specdecode.engine import decode as decode_module
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.sampling import SamplingParams
from tests.conftest import tiny_llama, tiny_target
from tests.test_batch import _normal_greedy, _tiny_dspark
from tests.test_lossless import exact_two_token_distribution
from tests.test_verify import chi_square_pvalue

GREEDY = SamplingParams()
# rounds with and without the model cost alike: choices follow the expectations alone
EQUAL_COSTS = RoundCosts.flat(1.0, 1.0)


def flat_passes(tokens: int) -> float:
    """A verify pass over any number of tokens costs one step: the suffix's draft length follows its
    expectations alone, not a noisy timing of a tiny target on a shared machine."""
    return 1.0


def occurrences(stream: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(stream[i : i + n] == pattern for i in range(len(stream) - n + 1))


def test_automaton_counts_every_substring_exactly():
    """On random streams over small alphabets (many repeats), built one token at a time: the state reached by
    any substring counts its occurrences, and matching finds the longest suffix that occurs."""
    rng = random.Random(0)
    for alphabet, length in ((2, 60), (3, 80), (6, 120)):
        stream = [rng.randrange(alphabet) for _ in range(length)]
        automaton = SuffixAutomaton()
        automaton.extend(stream)
        assert len(automaton) == length and len(automaton.length) <= 2 * length
        for _ in range(200):
            start = rng.randrange(length)
            pattern = stream[start : start + rng.randint(1, 8)]
            state, matched = automaton.match_suffix(pattern)
            assert matched == len(pattern)
            assert automaton.count[state] == occurrences(stream, pattern)
        query = [rng.randrange(alphabet + 1) for _ in range(12)]  # may hold a token never seen
        _, matched = automaton.match_suffix(query)
        longest = max((n for n in range(len(query) + 1) if n == 0 or occurrences(stream, query[-n:])), default=0)
        assert matched == longest


def test_continuation_is_the_most_frequent_path_with_its_frequencies():
    automaton = SuffixAutomaton()
    automaton.extend([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 1, 2])
    state, matched = automaton.match_suffix([1, 2])
    assert matched == 2
    tokens, scores = automaton.continuation(state, max_tokens=3, min_score=0.0)
    # [1, 2] was followed by 3 twice and 4 once (its last occurrence, at the end, by nothing yet)
    assert tokens == [3, 9, 1] and scores[0] == pytest.approx(2 / 3) and scores[1:] == [1.0, 1.0]
    short, _ = automaton.continuation(state, max_tokens=3, min_score=0.9)
    assert short == []  # 2/3 < 0.9: nothing is proposed


def test_drafter_copies_a_passage_and_adapts_its_length():
    passage = list(range(100, 140))
    drafter = SuffixDrafter(SuffixSettings(global_capacity=0))
    prompt = [5, 6, *passage, 7, 8]
    drafter.begin(prompt, GREEDY, torch.Generator(), None)
    assert drafter.propose(prompt, 16).length == 0  # nothing before [7, 8]: no match, no proposal
    copying = [*prompt, *passage[:3]]
    proposal = drafter.propose(copying, 16)
    # matched 3 tokens: at most max_spec_factor * 3 = 12 drafts, the passage's continuation
    assert proposal.tokens.tolist() == passage[3:15]
    longer = [*copying, *passage[3:12]]
    assert drafter.propose(longer, 16).tokens.tolist() == passage[12:28]


def confident(drafter: SuffixDrafter) -> SuffixDrafter:
    """As if many verified rounds had agreed with every kind of draft."""
    drafter.table.tries = [100.0] * len(drafter.table.tries)
    drafter.table.hits = [99.0] * len(drafter.table.hits)
    return drafter


def test_confident_proposals_run_past_the_draft_length():
    """A lookup's drafts cost no pass: past the engine's draft length it proposes on while the drafts' learned
    survival pays for the wider verify pass; with unlearned (even-odds) confidences it stops at 3 drafts, where
    the next one no longer pays (expected tokens per pass 1.5, 1.75, 1.875, 1.94 over costs 1.1, 1.15, 1.2, 1.25)."""
    passage = list(range(100, 140))
    ids = [5, 6, *passage, 7, 8, *passage[:12]]
    continuation = [*passage[12:], 7, 8, *passage]
    cost = SuffixSettings(global_capacity=0), (lambda b: 1 / (1 + 0.05 * b))  # a pass costs 5% more per token
    for drafter, expected in ((SuffixDrafter(*cost), 3), (confident(SuffixDrafter(*cost)), 32)):
        drafter.begin(ids, GREEDY, torch.Generator(), None)
        limit = drafter.proposal_limit(4)
        assert limit == 32 and drafter.proposal_limit(0) == 0  # draft length 0: normal decoding
        drafter.proposal_limit(4)
        assert drafter.propose(ids, limit).tokens.tolist() == continuation[:expected]
    doubtful = SuffixDrafter(*cost)
    doubtful.table.tries = [100.0] * len(doubtful.table.tries)  # drafts of every kind rarely survived: a plain
    doubtful.begin(ids, GREEDY, torch.Generator(), None)  # decoding step is faster than verifying any
    assert doubtful.propose(ids, doubtful.proposal_limit(4)).length == 0


def test_a_drafter_that_proposes_nothing_still_learns():
    """Where verifying even one draft at the starting (even-odds) confidence is slower than a plain step, the
    drafter proposes nothing, yet scores the continuation it would have proposed against the committed tokens:
    on text that copies its prompt it learns, and starts proposing (stop 19's cold-start trap: it never did)."""
    passage = list(range(100, 160))
    ids = [5, 6, *passage, 7, 8, *passage[:4]]
    dear = SuffixDrafter(SuffixSettings(global_capacity=0), lambda b: 1 / (1 + 0.9 * (b - 1)))  # 1 draft: 1.9x a step
    dear.begin(ids, GREEDY, torch.Generator(), None)
    dear.proposal_limit(8)
    lengths = []
    for token in passage[4:40]:  # normal decoding's rounds: one committed token each, the passage again
        lengths.append(dear.propose(ids, 32).length)
        ids = [*ids, token]
        dear.observe(ids, 0, None)
    assert lengths[0] == 0 and max(lengths) > 0


class LengthSpy(SuffixDrafter):
    """Records each proposal's length (in one list that the engine's per-request copies share)."""

    def __init__(self, settings: SuffixSettings) -> None:
        super().__init__(settings)
        self.lengths: list[int] = []

    def propose(self, ids, max_tokens):
        proposal = super().propose(ids, max_tokens)
        self.lengths.append(proposal.length)
        return proposal


def test_long_lookup_proposals_stay_lossless_in_both_engines():
    """Proposals longer than the draft length are verified like any chain: the output is normal greedy decoding,
    in the one-request decoder and in the continuous engine, and the hybrid's model keeps to the draft length."""
    target = tiny_target(vocab_size=32, seed=3)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 4]
    reference = _normal_greedy(target, prompt, 20)
    spy = confident(LengthSpy(SuffixSettings(global_capacity=0)))
    assert SpeculativeDecoder(target, spy, draft_length=2).generate(prompt, GREEDY, 20)[0].token_ids == reference
    assert max(spy.lengths) > 2
    model = _tiny_dspark(target)
    target.set_capture_layers(model.target_layer_ids)
    spy = confident(LengthSpy(SuffixSettings(global_capacity=0)))
    hybrid = HybridDrafter(model, spy, costs=EQUAL_COSTS)
    engine = ContinuousEngine(target, hybrid, EngineConfig(max_batch=2, max_len=64, draft_length=2))
    engine.start()
    try:
        got = engine.submit(prompt, GREEDY, 20).result(60)
    finally:
        engine.stop()
    assert got.token_ids == reference and max(hybrid.suffix.lengths) > 2
    assert hybrid.proposal_limit(2) == 32 and hybrid._model_tokens(32) == 2


def test_the_paying_length_is_the_best_of_every_length():
    """With a cost curve a proposal keeps the length of the most expected tokens per second among all its
    lengths: the scan may stop early (later drafts add at most their prefix's odds each, at the best gain still
    ahead), but never before a length that pays more. Curves of every shape (falling, bumpy, flat) and odds
    from certain to hopeless; the table's cells as their bounds say."""
    rng = random.Random(4)
    for trial in range(400):
        sizes = range(1, 41)
        seconds = {b: 1 + rng.random() * 0.2 * (b - 1) ** rng.choice((0.5, 1, 1.5)) for b in sizes}
        if trial % 7 == 0:
            seconds = {b: 1.0 for b in sizes}
        drafter = SuffixDrafter(steps_per_s=lambda b, seconds=seconds: 1 / seconds[b])
        odds = [rng.choice((1.0, rng.random(), rng.random() ** 4)) for _ in range(rng.randint(1, 32))]
        rates, survived, path = [], 0.0, 1.0
        for n, p in enumerate(odds, 1):
            path *= p
            survived += path
            rates.append((1 + survived) * seconds[1] / seconds[n + 1])
        keep, rate = drafter._paying_length(odds, cap=99)
        best = max(rates)
        assert (keep, rate) == ((0, 1.0) if best <= 1.0 else (rates.index(best) + 1, pytest.approx(best)))
    table = AcceptanceTable()
    for matched, score in [(1, 0.49), (2, 0.5), (3, 0.8), (4, 0.95), (5, 1.0), (16, 0.1), (17, 0.99), (40, 0.0)]:
        length = sum(matched > bound for bound in table.LENGTHS)
        assert table.cell(matched, score) == length * 4 + sum(score >= bound for bound in table.SCORES)


def test_acceptance_table_learns_from_verified_rounds():
    drafter = SuffixDrafter(SuffixSettings(global_capacity=0))
    prompt = [1, 2, 3, 4, 1, 2]
    drafter.begin(prompt, GREEDY, torch.Generator(), None)
    proposal = drafter.propose(prompt, 4)
    assert proposal.tokens.tolist() == [3, 4, 1, 2]
    before = proposal.confidences[0].item()
    cell = drafter.pending[2][0]
    for _ in range(20):  # the target never agrees with the first draft
        drafter.propose(prompt, 4)
        drafter.observe([*prompt, 9], 0, None)
    assert drafter.table.confidence(cell) < before / 4
    table = AcceptanceTable()
    assert table.cell(1, 0.1) != table.cell(40, 0.99)


@pytest.mark.parametrize("calibrated", [True, False])
def test_a_request_s_own_drafts_scale_the_shared_odds(calibrated):
    """The shared table, taught elsewhere that drafts survive 9 times in 10, meets a request whose drafts never
    survive: within a few rounds that request's odds fall far below the table's, and where a draft costs 1.3x a
    step it stops proposing; a new request starts from the table's odds again. Uncalibrated
    (`calibration_prior=inf`), the table's odds hold and the request keeps proposing."""
    settings = SuffixSettings(global_capacity=0, calibration_prior=2.0 if calibrated else math.inf)
    drafter = SuffixDrafter(settings, lambda b: 1 / (1 + 0.3 * (b - 1)))
    drafter.table.tries = [100.0] * len(drafter.table.tries)
    drafter.table.hits = [90.0] * len(drafter.table.hits)
    prompt = [1, 2, 3, 4, 1, 2]
    drafter.begin(prompt, GREEDY, torch.Generator(), None)
    drafter.proposal_limit(4)
    first = drafter.propose(prompt, 4)
    assert first.length > 0 and first.confidences[0].item() == pytest.approx(0.9)
    for _ in range(10):  # the target never agrees with the first draft
        drafter.observe([*prompt, 9], 0, None)
        drafter.propose(prompt, 4)
    assert (drafter.propose(prompt, 4).length == 0) == calibrated
    table_odds = drafter.table.confidence(drafter.pending[2][0])  # the first draft's cell, taught 10 failures
    drafter.begin(prompt, GREEDY, torch.Generator(), None)
    assert drafter.propose(prompt, 4).confidences[0].item() == pytest.approx(table_odds)


def test_global_index_serves_later_requests_and_stays_bounded():
    drafter = SuffixDrafter(SuffixSettings(global_capacity=60))
    answer = [20, 21, 22, 23, 24, 25, 26, 27]
    drafter.begin([1, 2], GREEDY, torch.Generator(), None)
    drafter.end([1, 2, *answer])  # an earlier request wrote `answer`
    other = copy.copy(drafter)  # the engine's per-request copy shares the index
    other.begin([3, 4, 20, 21, 22], GREEDY, torch.Generator(), None)
    assert other.propose([3, 4, 20, 21, 22], 4).tokens.tolist() == [23, 24, 25, 26]
    index = drafter.shared
    for i in range(20):
        index.add([50 + i] * 10)
    assert index.tokens <= 60 + 2  # two halves of at most capacity / 2 (separators included)
    assert len(index.automata) == 2
    assert isinstance(index, GlobalSuffixIndex)
    other.begin([3, 4, 20, 21, 22], GREEDY, torch.Generator(), None)
    assert other.propose([3, 4, 20, 21, 22], 4).length == 0  # `answer` was evicted, oldest first


def test_hybrid_lets_the_suffix_win_on_copies_and_the_model_elsewhere():
    """Tiny target and an untrained DSpark drafter: on a prompt that repeats, the suffix proposes; the round
    statistics say who proposed, and the output is normal greedy decoding."""
    target = tiny_target(vocab_size=32, seed=3)
    model = _tiny_dspark(target)
    target.set_capture_layers(model.target_layer_ids)
    hybrid = HybridDrafter(model, SuffixDrafter(SuffixSettings(global_capacity=0)), costs=EQUAL_COSTS)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5, 6, 7, 8, 9, 10, 3, 4]
    reference = _normal_greedy(target, prompt, 30)
    got = SpeculativeDecoder(target, hybrid, draft_length=4).generate(prompt, GREEDY, max_new_tokens=30)[0]
    assert got.token_ids == reference
    assert got.stats.proposers.get("suffix", 0) >= 1 and sum(got.stats.proposers.values()) >= 2
    assert hybrid.name == "suffix+dspark" and hybrid.has_confidences


class Silent(SuffixDrafter):
    """A suffix drafter that never finds anything."""

    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        return EMPTY_PROPOSAL


def test_hybrid_tries_a_model_that_does_not_pay_less_and_less_often(monkeypatch):
    """Model rounds priced at 100x a light round (and a suffix that finds nothing): the model drafts only when
    due a try, and each try that leaves it not paying doubles the wait (16, 32, 64 rounds without it); the
    output stays normal decoding."""
    target = tiny_target(vocab_size=32, seed=3)
    model = _tiny_dspark(target)
    target.set_capture_layers(model.target_layer_ids)
    hybrid = HybridDrafter(model, Silent(), costs=RoundCosts.flat(0.01, 1.0))
    rounds, model_rounds = [0], []
    observe, propose_batch = HybridDrafter.observe, type(model).propose_batch
    monkeypatch.setattr(HybridDrafter, "observe", lambda self, *a: rounds.append(rounds[-1] + 1) or observe(self, *a))
    monkeypatch.setattr(
        type(model),
        "propose_batch",
        classmethod(lambda cls, *a: model_rounds.append(rounds[-1]) or propose_batch.__func__(cls, *a)),
    )
    prompt = [3, 4, 5, 6]
    got = SpeculativeDecoder(target, hybrid, draft_length=4).generate(prompt, GREEDY, max_new_tokens=160)[0]
    assert got.token_ids == _normal_greedy(target, prompt, 160)
    assert rounds[-1] > 115 and model_rounds[:3] == [16, 49, 114]


def test_hybrid_prices_a_model_round_at_the_drafts_the_scheduler_verifies(monkeypatch):
    """A model round costs its drafting and a pass over the root and the drafts verified, so the same yield
    pays where the scheduler verifies two drafts and not where it verifies four (passes over up to three
    positions cheap, longer ones 10x dearer). What the engine verifies reaches the hybrid (`scheduled`) and is
    what its yields learn; a draft counts as kept only if it was verified."""
    target = tiny_target(vocab_size=32, seed=3)
    model = _tiny_dspark(target)
    target.set_capture_layers(model.target_layer_ids)
    hybrid = HybridDrafter(model, Silent(), costs=RoundCosts((0.01,) * 3 + (0.1,) * 5, drafting=0.001))
    hybrid.model_yield = DraftYield(kept=0.5, verified=2)
    assert hybrid._wants_model(0.0)  # 1.5 tokens in 11 ms against 1 in 10 ms
    hybrid.model_yield = DraftYield(kept=0.5, verified=4)
    assert not hybrid._wants_model(0.0)  # 1.5 tokens in 101 ms

    learned = []
    update = DraftYield.update
    monkeypatch.setattr(DraftYield, "update", lambda self, v, k: learned.append((v, k)) or update(self, v, k))
    prompt = [3, 4, 5, 6]
    for scheduler, verified in (("fixed", 3), ("prefix", 1)):
        if scheduler == "prefix":  # the scheduler keeps one draft of each proposal
            monkeypatch.setattr(decode_module, "schedule", lambda kind, confidences, lengths, *a: [1] * len(lengths))
        learned.clear()
        hybrid = HybridDrafter(model, Silent(), costs=EQUAL_COSTS)  # the model wins every round
        decoder = SpeculativeDecoder(target, hybrid, draft_length=3, scheduler=scheduler)
        got = decoder.generate(prompt, GREEDY, max_new_tokens=24)[0]
        assert got.token_ids == _normal_greedy(target, prompt, 24)
        counts = Counter(v for v, _ in learned)  # the last rounds may draft fewer: the output's end is near
        assert counts.most_common(1)[0][0] == verified and max(counts) == verified
        assert all(k <= v for v, k in learned)


def test_round_costs_time_a_later_round_not_the_prompts_first_drafting(monkeypatch, tmp_path):
    """A request's first drafting call also takes in its whole prompt (DSpark projects every prompt token's
    target features), which a later round never pays: the model round is timed after a first round, here a
    drafter whose first call per request sleeps 0.3 s. Each timed round is begin -> propose -> observe ->
    propose over the measurement's prompt less the round's three committed tokens."""

    class SlowFirstCall(DraftModelDrafter):
        def begin(self, prompt_ids, params, generator, features) -> None:
            super().begin(prompt_ids, params, generator, features)
            self.calls = 0
            events.append(("begin", len(prompt_ids)))

        def propose(self, ids: list[int], max_tokens: int) -> Proposal:
            self.calls += 1
            if self.calls == 1:
                time.sleep(0.3)
            events.append(("propose", len(ids)))
            return super().propose(ids, max_tokens)

        def observe(self, ids: list[int], num_accepted: int, features) -> None:
            events.append(("observe", len(ids), num_accepted, features.last_hidden.shape[0]))
            super().observe(ids, num_accepted, features)

    monkeypatch.setattr(hybrid_module, "measurement_file", lambda kind, key: tmp_path / "costs.json")  # measured here
    events: list[tuple] = []
    target = tiny_target(vocab_size=32, seed=3)
    drafter = SlowFirstCall(target)
    forward = target.forward

    def target_pass(tokens, **kwargs):
        events.append(("pass", len(tokens)))
        return forward(tokens, **kwargs)

    monkeypatch.setattr(target, "forward", target_pass)
    costs = round_costs(target, drafter, context=16, reps=3)
    assert len(costs.passes) == 8 and 0 < costs.light() and costs.drafting < 0.3
    # a one-position pass comes first: drafting is timed after a target pass, as decoding meets it; then every
    # pass the scheduler may choose
    passes = [("pass", k) for k in range(1, 9)]
    round_events = [("begin", 13), ("propose", 13), ("observe", 16, 2, 3), ("pass", 1), ("propose", 16), *passes]
    assert events[1 : 1 + len(round_events)] == round_events  # after the prefill
    assert events[1 + len(round_events) : 1 + 2 * len(round_events)] == round_events


def test_sampled_round_costs_time_the_sampled_drafting_and_each_pass_verification(monkeypatch, tmp_path):
    """At T > 0 a round costs more than its passes: the drafter samples its chain (with its q), and each verified
    position costs p and the block verification of the drafts before it. The sampled table times exactly that
    (a sampled drafter, then after a pass over k positions one `verify_block` of its first k - 1 drafts with their
    q), under a key of its own; the hybrid prices each request's rounds with the table of its kind."""
    files = {}
    monkeypatch.setattr(
        hybrid_module,
        "measurement_file",
        lambda kind, key: files.setdefault(key.get("rounds"), tmp_path / f"{len(files)}.json"),
    )
    target = tiny_target(vocab_size=32, seed=3)
    model = _tiny_dspark(target)
    target.set_capture_layers(model.target_layer_ids)
    verified, drafted_with = [], []
    verify = hybrid_module.verify_block
    monkeypatch.setattr(
        hybrid_module,
        "verify_block",
        lambda p, tokens, q, generator, support: (
            verified.append((len(tokens), q is not None)) or verify(p, tokens, q, generator, support)
        ),
    )
    begin = type(model).begin
    monkeypatch.setattr(
        type(model), "begin", lambda self, ids, params, *a: drafted_with.append(params) or begin(self, ids, params, *a)
    )
    greedy = round_costs(target, model, context=16, reps=2)
    assert not verified and all(p.greedy for p in drafted_with)
    drafted_with.clear()
    sampled = round_costs(target, model, context=16, reps=2, sampled=True)
    assert len(files) == 2 and len(sampled.passes) == 8 and sampled.drafting > 0
    assert drafted_with and all(p.temperature == 1.0 for p in drafted_with)
    counts = [n for n, _ in verified]  # a pass over k positions verifies the first k - 1 sampled drafts, with q
    drafts = max(counts)  # all the drafter's block holds
    sweep = [min(k - 1, drafts) for k in range(1, 9)]
    assert drafts > 0 and counts[: 2 * len(sweep)] == sweep * 2 and all(q for _, q in verified)

    hybrid = HybridDrafter(model, Silent())
    hybrid.check_target(target)  # both tables measured up front, not at a first sampled request
    for params, table in ((SamplingParams(), greedy), (SamplingParams(temperature=0.7), sampled)):
        hybrid.begin([3, 4, 5], params, torch.Generator(), None)
        assert hybrid.costs == table


def test_hybrid_in_the_continuous_engine_matches_normal_decoding():
    target = tiny_target(vocab_size=32, seed=3)
    model = _tiny_dspark(target)
    target.set_capture_layers(model.target_layer_ids)
    prompts = [[3, 4, 5, 3, 4, 5, 3], [7, 8], [9, 9, 9, 9], [3, 4, 5, 6, 3, 4]]
    references = [_normal_greedy(target, p, 12) for p in prompts]
    hybrid = HybridDrafter(model, costs=EQUAL_COSTS)
    engine = ContinuousEngine(target, hybrid, EngineConfig(max_batch=3, max_len=40, draft_length=4))
    engine.start()
    try:
        completions = [h.result(60) for h in [engine.submit(p, GREEDY, 12) for p in prompts]]
    finally:
        engine.stop()
    assert [c.token_ids for c in completions] == references
    proposers = Counter()
    for c in completions:
        proposers.update(c.stats.proposers)
    assert proposers["suffix"] >= 1 and proposers["model"] >= 1


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_sampling_matches_target_distribution(kind, tmp_path):
    """Temperature 1, tiny target: deterministic suffix drafts and sampled draft-model drafts, in one decoder,
    keep the first two tokens' exact distribution."""
    target = tiny_target(vocab_size=12, seed=0)
    suffix = SuffixDrafter(steps_per_s=flat_passes)
    if kind == "hybrid":
        tiny_llama(vocab_size=12, seed=1).save_pretrained(tmp_path)
        # both parts learn as the samples go (the suffix's confidences, the model's drafts kept per round);
        # with the model's rounds 5% dearer the lead changes hands: about 57% of rounds the suffix's, 43% the model's
        drafter = HybridDrafter(
            DraftModelDrafter(target, str(tmp_path)), suffix, model_prior=0.5, costs=RoundCosts.flat(1.0, 1.05)
        )
    else:
        drafter = suffix
    params = SamplingParams(temperature=1.0)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    n = 3000
    completions = SpeculativeDecoder(target, drafter, draft_length=3).generate(
        prompt, params, max_new_tokens=2, seed=11, num_samples=n
    )
    counts = Counter(tuple(c.token_ids) for c in completions)
    assert chi_square_pvalue(counts, exact_two_token_distribution(target, prompt, params), n) > 1e-3
    rounds = Counter()
    for c in completions:
        rounds.update(c.stats.proposers)
    if kind == "hybrid":
        assert rounds["suffix"] > n // 5 and rounds["model"] > n // 5  # one decoder, both proposers verified
    else:
        assert rounds["suffix"] > n // 4  # the suffix's drafts were really verified


def test_forget_drops_earlier_outputs_so_a_repeat_decodes_anew():
    """Benchmarks decode one prompt under several variants and temperatures: without `forget` the second
    decode copies the first's answer from the global index."""
    target = tiny_target(vocab_size=12, seed=0)
    drafter = SuffixDrafter(steps_per_s=flat_passes)
    decoder = SpeculativeDecoder(target, drafter, draft_length=8)
    prompt = [3, 4, 5, 6]
    first = decoder.generate(prompt, SamplingParams(), max_new_tokens=40)[0]
    again = decoder.generate(prompt, SamplingParams(), max_new_tokens=40)[0]
    drafter.forget()
    assert drafter.shared.tokens == 0
    fresh = decoder.generate(prompt, SamplingParams(), max_new_tokens=40)[0]
    assert first.token_ids == again.token_ids == fresh.token_ids
    assert again.stats.mean_accepted_length > fresh.stats.mean_accepted_length
