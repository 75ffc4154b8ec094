"""Losslessness of the whole decoding loop, on the real default target and on tiny random models.

Temperature 0: every drafter's output is token-identical to normal greedy decoding.
Temperature > 0: the distribution of the first generated tokens equals the target's, exactly computed.
"""

from collections import Counter

import pytest
import torch

from specdecode.drafters import Drafter, build_drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.sampling import SamplingParams, probabilities
from tests.conftest import tiny_llama, tiny_target
from tests.test_verify import chi_square_pvalue

PROMPTS = (
    "Repeat this code exactly, but rename the function to add_numbers:\n\n"
    "def add(a, b):\n    result = a + b\n    print('the sum is', result)\n    return result\n",
    "Write a short story about a robot who learns to paint.",
    "List the planets of the solar system with one fact about each.",
)
NEW_TOKENS = 128


@pytest.fixture(scope="module")
def greedy_references(smollm2) -> dict[str, list[int]]:
    normal = SpeculativeDecoder(smollm2, Drafter(), draft_length=0)
    return {
        prompt: normal.generate(smollm2.encode(prompt), SamplingParams(), max_new_tokens=NEW_TOKENS)[0].token_ids
        for prompt in PROMPTS
    }


def test_normal_decoding_matches_transformers_generate(smollm2_fp32):
    """Our normal decoding is plain greedy decoding: the same tokens as transformers' generate() (in float32,
    where both compute every op in the same precision; HF's bfloat16 rounds other intermediates than ours)."""
    ids = smollm2_fp32.encode(PROMPTS[1])
    normal = SpeculativeDecoder(smollm2_fp32, Drafter(), draft_length=0)
    ours = normal.generate(ids, SamplingParams(), max_new_tokens=NEW_TOKENS)[0].token_ids
    with torch.inference_mode():
        out = smollm2_fp32.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0, len(ids) :].tolist() == ours


@pytest.mark.parametrize(
    ("drafter_name", "draft_length"),
    [("ngram", 4), ("ngram", 8), ("suffix", 8), ("default", 8), ("draft-model", 4)],
)
def test_greedy_speculative_equals_normal_greedy(smollm2, greedy_references, drafter_name, draft_length):
    """Temperature 0, real target, 128 new tokens, several prompts: token-identical to normal decoding."""
    decoder = SpeculativeDecoder(smollm2, build_drafter(drafter_name, smollm2), draft_length=draft_length)
    proposed_any = False
    for prompt, reference in greedy_references.items():
        completion = decoder.generate(smollm2.encode(prompt), SamplingParams(), max_new_tokens=NEW_TOKENS)[0]
        assert completion.token_ids == reference, f"{drafter_name} diverged on {prompt[:40]!r}"
        proposed_any |= bool(completion.stats.position_attempts)
    assert proposed_any, "the drafter never proposed anything: the test would prove nothing"


def exact_two_token_distribution(target, prompt_ids, params) -> dict:
    """P(x1, x2) of normal sampling, from the target's own passes as normal decoding runs them (a prefill, then
    one-token steps: its kernels, which may round the linears' inputs where the HF forward does not), every
    possible first token one step after the prompt."""
    target.reset()
    target.forward(torch.tensor(prompt_ids[:-1]), logits=False)
    p1 = probabilities(target.forward(torch.tensor(prompt_ids[-1:])).logits[-1], params)
    support = torch.nonzero(p1).flatten()
    p2 = []
    for x1 in support.tolist():
        p2.append(probabilities(target.forward(torch.tensor([x1])).logits[-1], params))
        target.rollback(len(prompt_ids))
    p2 = torch.stack(p2)
    eos = target.eos_token_ids
    exact = {}
    for row, x1 in enumerate(support.tolist()):
        if x1 in eos:
            exact[(x1,)] = float(p1[x1])
            continue
        for x2 in torch.nonzero(p2[row]).flatten().tolist():
            exact[(x1, x2)] = float(p1[x1] * p2[row, x2])
    return exact


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)],
    ids=["no-filter", "top-k-top-p"],
)
@pytest.mark.parametrize("drafter_kind", ["draft-model", "ngram"])
def test_sampling_matches_target_distribution_tiny(params, drafter_kind, tmp_path):
    """Tiny random target, full engine: the first two tokens follow the target's exact distribution."""
    target = tiny_target(vocab_size=12, seed=0)
    if drafter_kind == "draft-model":
        tiny_llama(vocab_size=12, seed=1).save_pretrained(tmp_path)
        drafter = DraftModelDrafter(target, str(tmp_path))
    else:
        drafter = build_drafter("ngram", target)
    decoder = SpeculativeDecoder(target, drafter, draft_length=3)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]  # repeats, so the n-gram drafter proposes too
    n = 3000
    completions = decoder.generate(prompt, params, max_new_tokens=2, seed=11, num_samples=n)
    counts = Counter(tuple(c.token_ids) for c in completions)
    assert sum(bool(c.stats.position_attempts) for c in completions) > n // 2  # drafts were really verified
    assert chi_square_pvalue(counts, exact_two_token_distribution(target, prompt, params), n) > 1e-3


def test_sampling_matches_target_distribution_real(smollm2):
    """Real target, draft-model drafter with full q: the first two tokens follow normal sampling exactly, with
    the regeneration's filters (top-k and top-p; the tiny-target tests cover each filter alone)."""
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    prompt_ids = smollm2.encode("Name a color.")
    decoder = SpeculativeDecoder(smollm2, build_drafter("draft-model", smollm2), draft_length=2)
    n = 200  # the tiny-target tests above carry the statistical power; this one checks the real path
    completions = decoder.generate(prompt_ids, params, max_new_tokens=2, seed=3, num_samples=n)
    counts = Counter(tuple(c.token_ids) for c in completions)
    exact = exact_two_token_distribution(smollm2, prompt_ids, params)
    assert chi_square_pvalue(counts, exact, n) > 1e-3
