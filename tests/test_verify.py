"""The acceptance rules: exact properties, and the output distribution equals the target's (toy model).

The toy "model" is a Markov chain over a small vocabulary: the target's next-token distribution is a
row of P, the drafter's a row of Q. Three tokens have 6^3 outcomes whose exact probabilities are known,
so a chi-square test with fixed seeds checks speculative sampling against them.
"""

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdecode import sampling
from specdecode.sampling import SAMPLE_BLOCK, SamplingParams, probabilities, sample, sample_weights
from specdecode.verify import ChainResult, block_acceptance, verify_block, verify_greedy

V = 6


def chi_square_pvalue(counts: Counter, exact: dict, n: int, min_expected: float = 5.0) -> float:
    """Goodness of fit; outcomes expected fewer than `min_expected` times are pooled into one bin."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, prob in exact.items():
        if prob * n >= min_expected:
            observed.append(counts.get(outcome, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * n
    impossible = sum(c for o, c in counts.items() if exact.get(o, 0.0) == 0.0)
    if impossible:
        return 0.0  # an outcome the target can never produce
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def markov_chain(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5


def exact_three_tokens(p: torch.Tensor) -> dict:
    return {(a, b, c): float(p[0, a] * p[a, b] * p[b, c]) for a in range(V) for b in range(V) for c in range(V)}


def speculative_markov(
    p, q, n, draft_length, sampled_drafts, seed, verifier=verify_block, support: torch.Tensor | None = None
) -> Counter:
    """Generate 3 tokens n times with chain drafts from q and verification against p. With `support`, q's
    rows are over those token ids only (a draft vocabulary) and are handed to the verifier that way."""
    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        seq = [0]
        while len(seq) < 4:
            drafts, dists, prev = [], [], seq[-1]
            for _ in range(draft_length):
                dist = q[prev] if support is None else q[prev, support]
                column = sample(dist, g) if sampled_drafts else int(dist.argmax())
                prev = column if support is None else int(support[column])
                drafts.append(prev)
                dists.append(dist)
            context = torch.tensor([seq[-1], *drafts])
            q_rows = torch.stack(dists) if sampled_drafts else None
            extra = {} if support is None else {"support": support}
            result = verifier(p[context], torch.tensor(drafts), q_rows, g, **extra)
            seq += result.tokens
        counts[tuple(seq[1:4])] += 1
    return counts


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=4, top_p=0.9),
]


@pytest.mark.parametrize("sampled_drafts", [True, False], ids=["sampled-q", "deterministic-q"])
@pytest.mark.parametrize("params", SETTINGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_chain_output_follows_target_distribution(params, sampled_drafts, sampler):
    """Speculative sampling of 3 tokens matches p exactly (chi-square), with top-k/top-p on and off, with block
    verification in one C++ call and on the ATen ops."""
    p_logits, q_logits = markov_chain(seed=1)
    p = probabilities(p_logits, params)
    q = q_logits.softmax(-1)  # the drafter need not share the target's filters
    n = 6000
    counts = speculative_markov(p, q, n, draft_length=3, sampled_drafts=sampled_drafts, seed=7)
    assert chi_square_pvalue(counts, exact_three_tokens(p), n) > 1e-3


def test_draft_vocabulary_q_follows_target_distribution(sampler):
    """q over 4 of the 6 tokens, handed over as (k, 4) with its support (the target's other tokens are never
    drafted but must still come out at p's rate, through the residual): speculative sampling matches p, in C++ and
    on the ATen ops."""
    p_logits, q_logits = markov_chain(seed=1)
    p = probabilities(p_logits, SETTINGS[0])
    support = torch.tensor([0, 2, 3, 5])
    q = torch.full((V, V), float("-inf"))
    q[:, support] = q_logits[:, support]
    n = 6000
    counts = speculative_markov(p, q.softmax(-1), n, draft_length=3, sampled_drafts=True, seed=7, support=support)
    assert chi_square_pvalue(counts, exact_three_tokens(p), n) > 1e-3


@settings(max_examples=100, deadline=None)
@given(
    p_rows=st.lists(st.lists(st.floats(0.0, 1.0), min_size=V, max_size=V), min_size=5, max_size=5),
    q_rows=st.lists(st.lists(st.floats(0.01, 1.0), min_size=3, max_size=3), min_size=4, max_size=4),
    columns=st.lists(st.integers(0, 2), min_size=0, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_draft_vocabulary_q_is_the_spread_q(p_rows, q_rows, columns, seed):
    """q over a draft vocabulary with its support gives the acceptance law and the tokens that the same q
    spread over the whole vocabulary (zeros elsewhere) gives."""
    k = len(columns)
    p = torch.tensor(p_rows, dtype=torch.float64)[: k + 1] + 1e-3
    p = p / p.sum(-1, keepdim=True)
    support = torch.tensor([1, 2, 4])
    q = torch.tensor(q_rows, dtype=torch.float64)[:k].reshape(k, 3)
    q = q / q.sum(-1, keepdim=True)
    spread = torch.zeros(k, V, dtype=torch.float64).index_copy_(1, support, q)
    tokens = support[torch.tensor(columns, dtype=torch.long)]
    weights, stops = block_acceptance(p, tokens, q, support)
    spread_weights, spread_stops = block_acceptance(p, tokens, spread)
    assert weights + stops == pytest.approx(spread_weights + spread_stops, abs=1e-12)
    generators = [torch.Generator().manual_seed(seed) for _ in range(2)]
    assert verify_block(p, tokens, q, generators[0], support) == verify_block(p, tokens, spread, generators[1])


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "deterministic-q"])
@pytest.mark.parametrize("sharpness", [0.5, 1.5, 4.0])
def test_block_verification_is_exact_and_keeps_at_least_token_verification(sharpness, sampled):
    """By enumeration, no sampling: over every chain of 3 drafts from q (3 tokens, context-dependent p and q;
    deterministic: the one chain of q's argmax, q one-hot), block verification's law of (kept drafts, next
    token), continued by p, is p's law of 4 tokens; and it keeps at least as many drafts on average as
    token-by-token verification (min(1, p/q) while kept)."""
    g = torch.Generator().manual_seed(int(sharpness * 10))
    vocab, k = 3, 3
    p_table, q_table = (
        {c: (torch.randn(vocab, generator=g, dtype=torch.float64) * sharpness).softmax(-1) for c in _contexts(vocab, k)}
        for _ in range(2)
    )
    greedy = ()
    for _ in range(k):
        greedy += (int(q_table[greedy].argmax()),)
    law = {s: 0.0 for s in itertools.product(range(vocab), repeat=k + 1)}
    kept_block = kept_token = 0.0
    for drafts in itertools.product(range(vocab), repeat=k) if sampled else [greedy]:
        chance = math.prod(float(q_table[drafts[:i]][x]) for i, x in enumerate(drafts)) if sampled else 1.0
        target = torch.stack([p_table[drafts[:i]] for i in range(k + 1)])
        draft = torch.stack([q_table[drafts[:i]] for i in range(k)]) if sampled else None
        weights, stops = block_acceptance(target, torch.tensor(drafts), draft)
        kept_block += chance * sum(t * stop for t, stop in enumerate(stops))
        ratios = [min(1.0, float(target[j, x] / (draft[j, x] if sampled else 1.0))) for j, x in enumerate(drafts)]
        kept_token += chance * sum(math.prod(ratios[: i + 1]) for i in range(k))
        for t, stop in enumerate(stops):
            if t == k:
                nxt = target[t]
            else:
                q_next = draft[t] if sampled else torch.nn.functional.one_hot(torch.tensor(drafts[t]), vocab)
                nxt = (weights[t] * target[t] - q_next).clamp_min(0)
            nxt = nxt / nxt.sum() if stop > 0 else nxt
            for s in law:
                if s[:t] == drafts[:t]:
                    rest = math.prod(float(p_table[s[:j]][s[j]]) for j in range(t + 1, k + 1))
                    law[s] += chance * stop * float(nxt[s[t]]) * rest
    for s, prob in law.items():
        assert prob == pytest.approx(math.prod(float(p_table[s[:j]][s[j]]) for j in range(k + 1)), abs=1e-12)
    assert kept_block >= kept_token - 1e-12
    if sampled:
        assert kept_block > kept_token + 1e-3  # strictly more on these chains


def _contexts(vocab: int, k: int) -> list[tuple[int, ...]]:
    return [c for n in range(k + 1) for c in itertools.product(range(vocab), repeat=n)]


def test_the_distribution_test_can_fail():
    """Negative control: a verifier that always keeps the drafts yields q's distribution, and is caught."""

    def accept_all(target_probs, drafts, draft_probs, generator):
        return ChainResult(tokens=drafts.tolist() + [sample(target_probs[-1], generator)], num_accepted=len(drafts))

    p_logits, q_logits = markov_chain(seed=1)
    p, q = probabilities(p_logits, SETTINGS[0]), q_logits.softmax(-1)
    counts = speculative_markov(p, q, 6000, 3, True, seed=7, verifier=accept_all)
    assert chi_square_pvalue(counts, exact_three_tokens(p), 6000) < 1e-6


def test_greedy_chain_is_the_greedy_sequence():
    """Temperature 0: whatever the drafts, the committed tokens are the target's argmax chain."""
    p_logits, q_logits = markov_chain(seed=2)
    greedy = SamplingParams()
    p, q = probabilities(p_logits, greedy), q_logits.softmax(-1)
    expected = [0]
    for _ in range(3):
        expected.append(int(p_logits[expected[-1]].argmax()))
    for seed in range(20):
        assert speculative_markov(p, q, 1, 3, True, seed) == Counter({tuple(expected[1:]): 1})


def test_verify_greedy_examples():
    assert verify_greedy(torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7])) == ChainResult([5, 6, 7, 8], 3)
    assert verify_greedy(torch.tensor([5, 6, 7, 8]), torch.tensor([5, 9, 7])) == ChainResult([5, 6], 1)
    assert verify_greedy(torch.tensor([5, 6, 7, 8]), torch.tensor([4, 6, 7])) == ChainResult([5], 0)
    assert verify_greedy(torch.tensor([3]), torch.tensor([], dtype=torch.long)) == ChainResult([3], 0)


def test_rejected_token_is_never_resampled_for_deterministic_drafts():
    """With one-hot q the residual is p without the rejected token: it can never come back."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    g = torch.Generator().manual_seed(0)
    outcomes = Counter()
    for _ in range(2000):
        result = verify_block(p, torch.tensor([1]), None, g)
        outcomes[tuple(result.tokens[:1]) if result.num_accepted == 0 else ("kept",)] += 1
    assert set(outcomes) == {("kept",), (0,)}
    assert abs(outcomes[("kept",)] / 2000 - 0.5) < 0.05


distributions = st.lists(st.floats(0.0, 1.0), min_size=V, max_size=V).filter(lambda xs: sum(xs) > 1e-3)


@settings(max_examples=200, deadline=None)
@given(
    p_rows=st.lists(distributions, min_size=1, max_size=5),
    q_rows=st.lists(distributions, min_size=4, max_size=4),
    drafts=st.lists(st.integers(0, V - 1), min_size=0, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_chain_invariants(p_rows, q_rows, drafts, seed):
    """Any p, q and drafts: 1..k+1 tokens, drafts kept as a prefix, every committed token has p > 0."""
    k = min(len(drafts), len(p_rows) - 1)
    p = torch.tensor(p_rows[: k + 1])
    p = p / p.sum(-1, keepdim=True)
    q = torch.tensor(q_rows[:k]).reshape(k, V)
    q = q / q.sum(-1, keepdim=True)
    tokens = torch.tensor(drafts[:k], dtype=torch.long)
    for draft_probs in (q, None):
        result = verify_block(p, tokens, draft_probs, torch.Generator().manual_seed(seed))
        assert 0 <= result.num_accepted <= k
        assert len(result.tokens) == result.num_accepted + 1
        assert result.tokens[: result.num_accepted] == tokens[: result.num_accepted].tolist()
        assert all(p[i, t] > 0 for i, t in enumerate(result.tokens))


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.lists(st.floats(-5, 5), min_size=V, max_size=V), min_size=1, max_size=5),
    drafts=st.lists(st.integers(0, V - 1), min_size=0, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampling_rule_reduces_to_greedy_rule(logits, drafts, seed):
    """At temperature 0 p is one-hot, and min(1, p/q) + residual gives exactly the greedy match rule."""
    logits = torch.tensor(logits)
    k = min(len(drafts), len(logits) - 1)
    tokens = torch.tensor(drafts[:k], dtype=torch.long)
    p = probabilities(logits[: k + 1], SamplingParams())
    q = torch.full((k, V), 1.0 / V)
    g = torch.Generator().manual_seed(seed)
    assert verify_block(p, tokens, q, g) == verify_greedy(logits[: k + 1].argmax(-1), tokens)


def test_sampling_params_shape_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    top2 = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and abs(float(top2.sum()) - 1) < 1e-6
    nucleus = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert int((nucleus > 0).sum()) == 1  # the top token alone holds more than half the mass
    assert torch.equal(probabilities(logits, SamplingParams()), torch.tensor([[1.0, 0, 0, 0]]))


@pytest.mark.parametrize("vocab", [5, 49152, 1000 + 3])
def test_a_plain_temperature_shapes_p_in_one_cpp_pass(vocab):
    """At a plain temperature, p is the C++ softmax of z / t (csrc/sampling.cpp): ATen's up to the
    exponential's rounding, summing to 1, and each row the same alone as among other rows (threads take rows)."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    logits[0, :3] = -1e4  # entries whose exponential underflows to 0
    logits[1, 1] = -math.inf  # a masked token
    for temperature in (0.3, 1.0, 1.7):
        p = probabilities(logits, SamplingParams(temperature=temperature))
        torch.testing.assert_close(p, (logits / temperature).softmax(-1), rtol=2e-5, atol=1e-9)
        assert (p[0, :3] == 0).all() and p[1, 1] == 0 and sample(p[1], torch.Generator().manual_seed(1)) != 1
        torch.testing.assert_close(p.sum(-1), torch.ones(6), rtol=0, atol=1e-6)
        assert torch.equal(probabilities(logits[2:3], SamplingParams(temperature=temperature)), p[2:3])


@pytest.fixture(params=["c++", "aten"])
def sampler(request, monkeypatch):
    """`sample` on its C++ kernel (CPU float32 weights), or on the ATen ops it falls back to elsewhere."""
    if request.param == "aten":
        monkeypatch.setattr(sampling, "cpu_kernels_available", lambda: False)
    else:
        assert sampling.cpu_kernels_available()
    return request.param


def test_sample_follows_the_distribution_and_never_draws_a_zero(sampler):
    probs = torch.tensor([0.0, 0.45, 0.0, 0.05, 0.3, 0.2])
    generator = torch.Generator().manual_seed(7)
    n = 20000
    counts = Counter(sample(probs, generator) for _ in range(n))
    assert counts[0] == counts[2] == 0
    assert chi_square_pvalue(counts, {i: float(p) for i, p in enumerate(probs)}, n) > 0.001


def test_sampling_a_few_float_weights_follows_them_and_never_draws_a_zero():
    """A block's stopping odds are drawn from a Python list (`sample_weights`): unnormalised, zeros anywhere."""
    weights = [0.0, 0.9, 0.0, 0.1, 0.6, 0.4, 0.0]
    generator = torch.Generator().manual_seed(11)
    n = 20000
    counts = Counter(sample_weights(weights, generator) for _ in range(n))
    assert counts[0] == counts[2] == counts[6] == 0
    assert chi_square_pvalue(counts, {i: w / 2.0 for i, w in enumerate(weights)}, n) > 0.001


def test_sample_finds_weights_across_blocks_of_its_cdf(sampler):
    """Unnormalised weights over a vocabulary that is not a multiple of the CDF block: mass at a block's
    edges, in whole empty blocks and in the padded last block; zeros are never drawn."""
    weights = torch.zeros(3 * SAMPLE_BLOCK + 37)
    heavy = {0: 2.0, SAMPLE_BLOCK - 1: 1.0, SAMPLE_BLOCK: 0.5, 3 * SAMPLE_BLOCK + 36: 3.0, 3 * SAMPLE_BLOCK: 1.5}
    for index, weight in heavy.items():
        weights[index] = weight
    generator = torch.Generator().manual_seed(3)
    n = 20000
    counts = Counter(sample(weights, generator) for _ in range(n))
    assert set(counts) == set(heavy)
    total = sum(heavy.values())
    assert chi_square_pvalue(counts, {i: w / total for i, w in heavy.items()}, n) > 0.001


def test_the_cpp_sampler_draws_what_the_aten_ops_draw(monkeypatch):
    """The same uniform number picks the same token on both paths, over vocabularies of any length, sparse or
    dense, peaked or flat (their block sums add in other orders: a draw could differ only where the number
    falls within rounding of a CDF step)."""
    assert sampling.cpu_kernels_available()
    g = torch.Generator().manual_seed(5)
    cases = []
    for i in range(300):
        n = int(torch.randint(1, 3 * SAMPLE_BLOCK + 100, (), generator=g)) if i % 2 else 49152
        weights = torch.rand(n, generator=g) ** (1 + i % 12)
        if i % 3 == 0:
            weights[torch.rand(n, generator=g) < 0.95] = 0
        weights[int(torch.randint(0, n, (), generator=g))] += 0.01  # a positive total
        cases.append((weights, int(torch.randint(0, 2**31, (), generator=g))))
    drawn = [sample(w, torch.Generator().manual_seed(seed)) for w, seed in cases]
    monkeypatch.setattr(sampling, "cpu_kernels_available", lambda: False)
    assert drawn == [sample(w, torch.Generator().manual_seed(seed)) for w, seed in cases]
    assert all(w[i] > 0 for (w, _), i in zip(cases, drawn, strict=True))
    edges = torch.zeros(2 * SAMPLE_BLOCK)
    edges[1], edges[SAMPLE_BLOCK + 2] = 1.0, 0.5  # the last block ends in zeros
    assert torch.ops.specdecode.sample_index(edges, 0.0) == 1
    assert torch.ops.specdecode.sample_index(edges, math.nextafter(1.0, 0.0)) == SAMPLE_BLOCK + 2


def test_cpp_block_verification_keeps_and_draws_what_the_aten_ops_do(monkeypatch):
    """`verify_block` on CPU float32 probabilities runs in one C++ call (csrc/sampling.cpp `block_verify`): with the
    same two uniform numbers it keeps the same drafts and draws the same token as the ATen steps, over one-hot and
    sampled q, q over the whole vocabulary or a draft vocabulary (its support), q zero at a draft, p zero at a draft
    and p zero at the residual's tokens, sharp and flat (they add masses in other orders: an outcome could differ
    only where a number falls within rounding of a step)."""
    assert sampling.cpu_kernels_available()
    g = torch.Generator().manual_seed(9)
    cases = []
    for i in range(600):
        vocab = int(torch.randint(2, 400, (), generator=g)) if i % 10 else 49152
        k = int(torch.randint(1, 8, (), generator=g))
        sharpness = float(torch.rand((), generator=g)) * 6
        p = (torch.randn(k + 1, vocab, generator=g) * sharpness).softmax(-1)
        if i % 7 == 0:
            p[:, : vocab // 2] = 0  # whole regions of p at zero
            p = p / p.sum(-1, keepdim=True)
        q = support = None
        drafts = torch.randint(0, vocab, (k,), generator=g)
        if i % 3:
            size = int(torch.randint(1, vocab + 1, (), generator=g))
            support = torch.randperm(vocab, generator=g)[:size].sort().values
            q = (torch.randn(k, len(support), generator=g) * sharpness).softmax(-1)
            columns = torch.multinomial(q, 1, generator=g)[:, 0]
            if i % 11 == 0:
                q[0, columns[0]] = 0  # a draft q gave no mass: w drops to 0
            drafts = support[columns]
            if i % 2:  # the same q spread over the whole vocabulary
                q, support = torch.zeros(k, vocab).index_copy_(1, support, q), None
        cases.append((p, drafts, q, support, int(torch.randint(0, 2**31, (), generator=g))))

    def results() -> list[ChainResult]:
        return [verify_block(p, d, q, torch.Generator().manual_seed(seed), s) for p, d, q, s, seed in cases]

    in_cpp = results()
    monkeypatch.setattr(sampling, "cpu_kernels_available", lambda: False)
    assert in_cpp == results()
    assert {r.num_accepted for r in in_cpp} >= set(range(7))  # every kept count from 0 to 6 happened


def test_the_cpp_argmax_picks_what_torch_argmax_picks():
    """Greedy decoding and verification read each row's argmax from the C++ pass: it must be torch's, the first
    of equal largest logits and the first NaN, over rows shorter and longer than its eight lanes."""
    assert sampling.cpu_kernels_available()
    g = torch.Generator().manual_seed(7)
    nan, inf = float("nan"), float("inf")
    with_nans = torch.randn(4, 1000, generator=g)
    with_nans[1, 997], with_nans[2, 5], with_nans[2, 900] = nan, nan, nan
    cases = [
        torch.randn(5, 49152, generator=g),
        torch.randn(2, 3, 100, generator=g),
        torch.randn(3, 7, generator=g),
        torch.randn(2, 1, generator=g),
        torch.randint(0, 3, (6, 1000), generator=g).float(),  # ties everywhere
        torch.where(torch.rand(6, 33, generator=g) < 0.5, -inf, 0.0),  # zeros among -inf
        torch.full((2, 19), -inf),
        torch.tensor([[1.0, inf, nan, inf, 0, 0, 0, 0, 0, 0, 0]]),
        with_nans,
    ]
    for logits in cases:
        assert torch.equal(sampling.greedy_tokens(logits), logits.argmax(-1)), logits
    assert torch.equal(sampling.greedy_tokens(cases[0].bfloat16()), cases[0].bfloat16().argmax(-1))  # ATen's
