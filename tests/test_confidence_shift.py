"""A request's confidence shift: what it learns from, where it converges, and who it leaves alone."""

import math
import random

import torch

from specdecode.drafters.base import Drafter
from specdecode.drafters.confidence_shift import RATE, ConfidenceShift
from specdecode.drafters.dspark import BlockDrafter
from specdecode.drafters.hybrid import HybridDrafter, RoundCosts
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.sampling import SamplingParams
from specdecode.training.calibration import RoundRecorder
from tests.conftest import tiny_target
from tests.test_dspark import make_model


def test_only_the_observed_drafts_move_the_shift():
    """Drafts up to the first rejected one are observed; later ones and unverified ones are not."""
    rejected_first = ConfidenceShift()
    rejected_first.learn([0.5, 0.5, 0.5], verified=3, accepted=0)  # one observation: draft 1 did not survive
    assert math.isclose(rejected_first.shift, -RATE * 0.5)
    all_kept = ConfidenceShift()
    all_kept.learn([0.5, 0.5, 0.5], verified=2, accepted=2)  # two survivals; the third was never verified
    assert all_kept.shift > 0
    nothing = ConfidenceShift()
    nothing.learn([0.9, 0.9], verified=0, accepted=0)
    assert nothing.shift == 0


def test_the_shifted_confidence_follows_the_survival_rate():
    """A drafter that says 0.8 where drafts survive 40% of the time ends up saying about 0.4; one that is right
    stays about where it was."""
    rng = random.Random(0)
    for said, survives in ((0.8, 0.4), (0.3, 0.3)):
        shift, late = ConfidenceShift(), []
        for n in range(3000):
            accepted = int(rng.random() < survives)
            if n >= 2000:
                late.append(shift.apply(torch.tensor([said])).item())
            shift.learn([said], verified=1, accepted=accepted)
        assert abs(sum(late) / len(late) - survives) < 0.05


def test_apply_adds_the_shift_to_the_logits():
    c = torch.tensor([0.2, 0.5, 0.9])
    assert ConfidenceShift().apply(c) is c
    shifted = ConfidenceShift(-1.0).apply(c)
    assert torch.allclose(torch.logit(shifted), torch.logit(c) - 1.0, atol=1e-5)


def test_a_request_learns_from_its_own_verified_rounds_only():
    """Alone, the drafter's rounds move its request's shift (greedy output unchanged); inside the hybrid, rounds
    verifying the suffix's proposal do not; a new request starts from no shift; the calibration recorder
    records the confidences unshifted."""
    target = tiny_target(vocab_size=24)
    prompt, params = [3, 4, 5, 3, 4, 5, 3, 4], SamplingParams()
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0).generate(prompt, params, 24)[0]

    drafter = BlockDrafter(make_model(target))
    learned = []
    learn = ConfidenceShift.learn
    ConfidenceShift.learn = lambda self, c, v, a: learned.append((v, a)) or learn(self, c, v, a)
    try:
        decoder = SpeculativeDecoder(target, drafter, draft_length=3, scheduler="threshold", threshold=0.0)
        out = decoder.generate(prompt, params, 24)[0]
        assert out.token_ids == normal.token_ids
        assert learned and drafter.shift.shift != 0
        rounds = len(out.stats.accepted_lengths)
        assert len(learned) in (rounds, rounds - 1)  # the last round may draft nothing (no room)
        drafter.begin(prompt, params, torch.Generator(), None)
        assert drafter.shift.shift == 0

        learned.clear()
        suffix_only = HybridDrafter(BlockDrafter(make_model(target)), costs=RoundCosts.flat(1.0, math.inf))
        suffix_only.shared.exploration.every = 10**9  # the model never drafts
        SpeculativeDecoder(target, suffix_only, draft_length=3).generate(prompt, params, 24)
        assert learned == []

        recorder = RoundRecorder(BlockDrafter(make_model(target)), gamma=3)
        SpeculativeDecoder(target, recorder, draft_length=3).generate(prompt, params, 24)
        assert recorder.inner.shift.shift == 0
    finally:
        ConfidenceShift.learn = learn
