"""The training's simulated accepted length against decoding: the visit-weighted expectation, and the check on
the real target with the shipped drafter."""

import torch

from specdecode.drafters import build_drafter
from specdecode.drafters.checkpoint import load_model
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.evaluation.sim_check import check_prompt, expected_rounds, uniform_accepted_length
from specdecode.sampling import SamplingParams
from specdecode.training.features import OnlineFeatures


def greedy_walk(survival: torch.Tensor) -> int:
    """Rounds of a greedy decode over 0/1 outcomes, by hand: from anchor i, keep drafts while they survive."""
    i, rounds, n = 0, 0, len(survival)
    while i < n:
        kept = int(survival[i].long().cumprod(0).sum())
        i, rounds = i + 1 + kept, rounds + 1
    return rounds


def test_expected_rounds_is_the_greedy_walk_on_certain_outcomes():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        survival = (torch.rand(40, 5, generator=g) < 0.6).double()
        assert expected_rounds(survival) == greedy_walk(survival)
    assert expected_rounds(torch.ones(10, 3)) == 3  # 4 tokens a round: rounds at 0, 4, 8
    assert expected_rounds(torch.zeros(10, 3)) == 10


def test_expected_rounds_matches_the_closed_form_far_from_the_end():
    """With the same survival a at every draft, a round commits 1 + a + ... + a^G tokens on average."""
    a, g = 0.6, 4
    per_round = sum(a**k for k in range(g + 1))
    n = 4000
    survival = torch.full((n, g), a, dtype=torch.float64)
    assert abs(n / expected_rounds(survival) - per_round) < 0.01
    assert abs(uniform_accepted_length(survival) - per_round) < 1e-9


def test_the_uniform_mean_overstates_uneven_drafts():
    """Half the positions accept everything, half nothing: decoding crosses the easy half in few rounds."""
    survival = torch.cat([torch.ones(50, 7), torch.zeros(50, 7)])
    assert uniform_accepted_length(survival) == 4.5
    assert expected_rounds(survival) == 7 + 44  # 8 tokens a round up to 56, then one a round: 1.96 a round


def test_decoding_reaches_what_training_simulates_on_the_same_text(smollm2):
    """The shipped drafter decodes a prompt greedily; the training's simulation over that text, weighted as
    decoding visits positions, predicts the rounds it took (training and decoding compute the same drafts, up to
    the last bits of their different kernels)."""
    path = shipped_drafter(smollm2.name)
    _, model = load_model(path, smollm2)
    model.eval()
    decoder = SpeculativeDecoder(smollm2, build_drafter(str(path), smollm2), draft_length=model.config.draft_length)
    features = OnlineFeatures(smollm2, list(model.config.target_layer_ids))
    prompt = smollm2.encode_chat(
        [{"role": "user", "content": "Write a Python function that returns the sum of a list."}]
    )
    check = check_prompt(decoder, model, features, prompt, SamplingParams(temperature=0.0), 64, seed=0)
    decoded, visited = check.tokens / check.rounds, check.tokens / check.visited_rounds
    assert check.tokens == 64 and decoded > 1.5  # the drafter really drafts here
    assert abs(decoded - visited) / visited < 0.1, (decoded, visited)
