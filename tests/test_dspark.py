"""The DSpark/DFlash drafter: training and inference compute the same thing, and decoding stays lossless."""

import copy
import dataclasses
import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode.drafters import context_pool
from specdecode.drafters.base import Drafter, TargetFeatures
from specdecode.drafters.checkpoint import load_drafter, save_drafter
from specdecode.drafters.dspark import BlockDrafter, DSparkConfig, DSparkModel, _context_and_mask, _pool_slots
from specdecode.drafters.layers import freeze_norms
from specdecode.drafters.vocab import draft_index
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.models.linear import (
    EIGHT_BIT_INPUTS,
    FrozenLinear,
    cpu_kernels_available,
    freeze_linears,
    native_bfloat16,
)
from specdecode.sampling import SamplingParams
from specdecode.training.block_losses import block_attention_mask, sample_anchors, teacher, training_losses
from specdecode.training.data import Example
from specdecode.training.features import FeatureBatch, OfflineFeatures, write_feature_cache
from specdecode.training.run import run_training
from specdecode.training.trainer import TrainConfig
from tests.conftest import needs_q8_rows, tiny_target
from tests.test_lossless import exact_two_token_distribution
from tests.test_verify import chi_square_pvalue

LAYERS = [-1, 0]


REDUCED = torch.tensor([2, 3, 5, 6, 7, 9, 11])  # a draft vocabulary of 7 of the tiny targets' tokens


def make_model(
    target, markov_rank=8, head="vanilla", seed=0, fill_in=False, qk_norm=True, draft_ids=None
) -> DSparkModel:
    """A tiny random DSpark/DFlash drafter; with `draft_ids`, a reduced draft vocabulary and its own LM head."""
    c = target.config
    config = DSparkConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        target_layer_ids=LAYERS,
        num_layers=2,
        block_size=4,
        markov_rank=markov_rank,
        markov_head_type=head,
        confidence_head=markov_rank > 0,
        num_anchors=6,
        sample_from_anchor=not fill_in,
        qk_norm=qk_norm,
        draft_vocab_size=0 if draft_ids is None else len(draft_ids),
    )
    torch.manual_seed(seed)
    model = DSparkModel(config, target.model.get_input_embeddings(), target.model.get_output_embeddings(), draft_ids)
    if model.markov is not None:  # random, not zero, so the sequential stage really acts in these tests
        torch.nn.init.normal_(model.markov.w2.weight, std=0.5)
    return model


def features_of(target, ids: torch.Tensor):
    target.set_capture_layers(LAYERS)
    target.reset()
    out = target.forward(ids, logits=False)
    target.reset()
    return TargetFeatures(out.layer_hidden.clone(), out.last_hidden.clone())  # clones: usable by autograd


def test_anchors_and_mask():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    anchors, valid = sample_anchors(loss_mask, 5, torch.Generator().manual_seed(0))
    assert anchors[valid].tolist() == [1, 2, 3]  # next token supervised
    mask = block_attention_mask(torch.tensor([[2, 5]]), torch.ones(1, 8, dtype=torch.bool), block=2)
    assert mask.shape == (1, 1, 4, 8 + 4)
    assert mask[0, 0, 0, :8].tolist() == [True, True] + [False] * 6  # context strictly before anchor 2
    assert mask[0, 0, 3, 8:].tolist() == [False, False, True, True]  # its own block only


@pytest.mark.parametrize(
    "head,markov_rank,fill_in,draft_ids",
    [
        ("vanilla", 8, False, None),
        ("gated", 8, False, None),
        ("rnn", 8, False, None),
        ("vanilla", 0, True, None),
        ("vanilla", 8, False, REDUCED),
    ],
    ids=["vanilla", "gated", "rnn", "dflash-fill-in", "reduced-vocab"],
)
def test_training_matches_inference(head, markov_rank, fill_in, draft_ids):
    """The block logits of the masked training pass equal what the drafter computes at inference."""
    target = tiny_target(vocab_size=24)
    model = make_model(target, markov_rank=markov_rank, head=head, fill_in=fill_in, draft_ids=draft_ids)
    ids = torch.randint(2, 24, (12,), generator=torch.Generator().manual_seed(1))
    out = features_of(target, ids)
    anchor = 7
    g = model.config.block_size
    # training path with one anchor
    positions = torch.arange(anchor, anchor + g)[None]
    inputs = torch.cat([model.embed(ids[anchor : anchor + 1]), model.mask_input((g - 1,))])[None]
    kv = model.context_kv(model.context(out.layer_hidden[None]), torch.arange(12)[None])
    mask = block_attention_mask(torch.tensor([[anchor]]), torch.ones(1, 12, dtype=torch.bool), g)
    h = model.prediction_states(model.backbone(inputs, positions, kv, mask)[0])
    assert h.shape[0] == model.config.draft_length == g - fill_in
    _, _, expected = model.sequential(
        h, model.draft_logits(h), ids[anchor], choose=lambda x: model.to_target(x.argmax(-1))
    )
    # inference path: the committed sequence is ids[:anchor + 1], features known for ids[:anchor]
    drafter = BlockDrafter(model)
    drafter.begin(
        ids[: anchor + 1].tolist(),
        SamplingParams(),
        torch.Generator(),
        TargetFeatures(out.layer_hidden[:anchor], out.last_hidden[:anchor]),
    )
    proposal = drafter.propose(ids[: anchor + 1].tolist(), g)
    assert proposal.tokens.tolist() == expected.tolist()
    if draft_ids is not None:
        assert set(expected.tolist()) <= set(draft_ids.tolist())


def test_batched_proposals_equal_single_ones():
    """The continuous engine drafts for all requests in one call: contexts of different lengths are padded and
    masked, so each request gets the block it would get alone (and nothing for a zero budget)."""
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    ids = torch.randint(2, 24, (3, 14), generator=torch.Generator().manual_seed(3))
    committed = [ids[0, :5].tolist(), ids[1, :12].tolist(), ids[2, :9].tolist()]
    drafters, prototype = [], BlockDrafter(model)
    for row, seq in zip(ids, committed, strict=True):
        out = features_of(target, row)
        drafter = copy.copy(prototype)  # a request each, as the engines make them
        n = len(seq) - 1
        drafter.begin(
            seq, SamplingParams(), torch.Generator(), TargetFeatures(out.layer_hidden[:n], out.last_hidden[:n])
        )
        drafters.append(drafter)
    budgets = [4, 2, 0]
    batched = BlockDrafter.propose_batch(drafters, committed, budgets)
    for drafter, seq, budget, got in zip(drafters, committed, budgets, batched, strict=True):
        alone = drafter.propose(seq, budget)
        assert got.length == budget
        assert got.tokens.tolist() == alone.tokens.tolist()
        if budget:
            torch.testing.assert_close(got.confidences, alone.confidences)


@pytest.mark.parametrize("loop", [True, False], ids=["cpp-loop", "python"])
def test_requests_share_one_context_pool_and_give_back_their_slots(monkeypatch, loop):
    """The copies of one drafter keep their contexts in one pool, a slot each, read in place by a batched
    round: requests that join while others draft (the pool's slots and capacity doubling under them) get the
    blocks they would get alone; an ended request's slot, or a dropped copy's, goes to the next request; a
    copy of a drafter that holds a slot takes its own; drafters of different pools cannot share a batch."""
    monkeypatch.setattr(context_pool, "MIN_CAPACITY", 8)  # contexts of 5-14 tokens outgrow it
    target = tiny_target(vocab_size=24)
    prototype = loop_drafter(target) if loop else BlockDrafter(make_model(target))
    ids = torch.randint(2, 24, (3, 16), generator=torch.Generator().manual_seed(7))
    outs = [features_of(target, row) for row in ids]

    def begun(drafter: BlockDrafter, r: int, n: int) -> BlockDrafter:
        d = copy.copy(drafter)
        features = TargetFeatures(outs[r].layer_hidden[: n - 1], None)
        d.begin(ids[r, :n].tolist(), SamplingParams(), torch.Generator(), features)
        return d

    def alone(r: int, n: int) -> list[int]:  # a fresh drafter of the same model, holding request r alone
        d = begun(BlockDrafter(prototype.model), r, n)
        d.kernels = prototype.kernels
        return d.propose(ids[r, :n].tolist(), 4).tokens.tolist()

    a = begun(prototype, 0, 5)
    assert a.propose(ids[0, :5].tolist(), 4).tokens.tolist() == alone(0, 5) and a.pool.cache.slots == 1
    b, c = begun(prototype, 1, 12), begun(prototype, 2, 9)
    a.observe(ids[0, :7].tolist(), 1, TargetFeatures(outs[0].layer_hidden[4:6], None))
    got = BlockDrafter.propose_batch(
        [a, b, c], [ids[0, :7].tolist(), ids[1, :12].tolist(), ids[2, :9].tolist()], [4] * 3
    )
    assert [p.tokens.tolist() for p in got] == [alone(0, 7), alone(1, 12), alone(2, 9)]
    assert (
        [a.slot, b.slot, c.slot] == [0, 1, 2]
        and a.pool.cache.slots == 3
        and a.pool.cache.capacity >= b.length + b.config.block_size > 8
    )
    a.end(ids[0].tolist())
    d = begun(prototype, 0, 5)
    del b
    e = begun(prototype, 1, 5)
    assert (d.slot, e.slot) == (0, 1) and begun(c, 2, 5).slot not in (0, 1, c.slot)
    with pytest.raises(SpecDecodeError, match="copies of one drafter"):
        other = begun(BlockDrafter(prototype.model), 0, 5)
        BlockDrafter.propose_batch([c, other], [ids[2, :9].tolist(), ids[0, :5].tolist()], [4, 4])


def test_bench_drafting_times_rounds_after_target_passes(tmp_path):
    """`bench drafting` on a tiny saved DSpark drafter: a row per context and number of requests, each with its
    round paired against the one-position target pass before it, in the shared results shape."""
    from specdecode.evaluation.drafting_bench import run_drafting_bench

    target = tiny_target(vocab_size=160)  # the bench draws token ids from 100 up
    model = make_model(target)
    save_drafter(tmp_path / "d", "dspark", model, model.config.to_dict(), target)
    run_drafting_bench(target, str(tmp_path / "d"), [1, 3], [6, 20], draft_length=3, repeats=2, out_dir=str(tmp_path))
    data = json.loads((tmp_path / "drafting.json").read_text())
    assert [(r["context"], r["requests"]) for r in data["runs"]] == [(6, 1), (6, 3), (20, 1), (20, 3)]
    for r in data["runs"]:
        low, high = r["round_ms_range"]
        assert 0 < low <= r["round_ms"] <= high and r["t1_ms"] > 0 and r["round_over_t1"] > 0
        assert r["per_request_ms"] == pytest.approx(r["round_ms"] / r["requests"], abs=1e-3)
    assert "| 20 | 3 |" in (tmp_path / "drafting.md").read_text()


def test_features_left_pending_by_rounds_without_drafting_give_the_same_context():
    """Committed features are projected at the next draft: a drafter that observed four rounds without drafting
    (the gate said no) then drafts what a drafter that drafted every round drafts, and its context K/V holds
    the same values; the pending features of two requests are projected in one product."""
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    ids = torch.randint(2, 24, (2, 16), generator=torch.Generator().manual_seed(5))
    outs = [features_of(target, row) for row in ids]
    eager, lazy = ([copy.copy(prototype) for _ in ids] for prototype in (BlockDrafter(model), BlockDrafter(model)))
    for drafters in (eager, lazy):
        for d, out, row in zip(drafters, outs, ids, strict=True):
            d.begin(row[:4].tolist(), SamplingParams(), torch.Generator(), TargetFeatures(out.layer_hidden[:3], None))
    for end in (6, 7, 10, 14):  # rounds committing 2, 1, 3 and 4 tokens
        for drafters in (eager, lazy):
            for d, out, row in zip(drafters, outs, ids, strict=True):
                start = d.length + sum(len(p) for p in d.pending)
                d.observe(row[:end].tolist(), 0, TargetFeatures(out.layer_hidden[start : end - 1], None))
        BlockDrafter.propose_batch(eager, [row[:end].tolist() for row in ids], [3, 3])
    assert all(d.pending for d in lazy) and not any(d.pending for d in eager)
    got = BlockDrafter.propose_batch(lazy, [row[:14].tolist() for row in ids], [3, 3])
    want = BlockDrafter.propose_batch(eager, [row[:14].tolist() for row in ids], [3, 3])
    for a, b, d, e, out in zip(got, want, lazy, eager, outs, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and d.length == e.length == 13
        torch.testing.assert_close(a.confidences, b.confidences)
        with torch.no_grad():  # the whole context projected at once, at positions 0..12
            whole = model.context_kv(model.context(out.layer_hidden[None, :13]), torch.arange(13)[None])
        for layer, (wk, wv) in enumerate(whole):
            for r in (d, e):
                torch.testing.assert_close(r.pool.cache.keys[layer, r.slot : r.slot + 1, :, :13], wk)
                torch.testing.assert_close(r.pool.cache.values[layer, r.slot : r.slot + 1, :, :13], wv)


@pytest.mark.parametrize(
    "markov_rank,fill_in,draft_ids",
    [(0, False, None), (0, True, None), (8, False, None), (8, False, REDUCED)],
    ids=["dflash", "fill-in", "dspark", "reduced-vocab"],
)
def test_losses_are_finite_and_trainable(markov_rank, fill_in, draft_ids):
    target = tiny_target(vocab_size=24)
    model = make_model(target, markov_rank=markov_rank, fill_in=fill_in, draft_ids=draft_ids)
    ids = torch.randint(2, 24, (2, 16), generator=torch.Generator().manual_seed(2))
    feats = [features_of(target, row) for row in ids]
    batch = FeatureBatch(
        input_ids=ids,
        loss_mask=torch.arange(16).expand(2, 16) >= 4,
        attention_mask=torch.ones(2, 16, dtype=torch.bool),
        layer_hidden=torch.stack([f.layer_hidden for f in feats]),
        last_hidden=torch.stack([f.last_hidden for f in feats]),
    )
    out = training_losses(model, batch, torch.Generator().manual_seed(0))
    assert torch.isfinite(out["loss"]) and out["loss"] > 0
    out["loss"].backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0
    assert target.model.get_input_embeddings().weight.grad is None  # the target stays frozen
    assert 1.0 <= float(out["simulated_accept_length"]) <= model.config.draft_length + 1
    assert f"acc_pos_{model.config.draft_length}" in out and f"acc_pos_{model.config.draft_length + 1}" not in out
    if markov_rank:
        assert "confidence_bce" in out


def loop_drafter(target, kernel: str = "few-rows", **kwargs) -> BlockDrafter:
    """A tiny drafter frozen for inference as a loaded one is, its linears on `kernel` at every size: on the
    few-rows kernels its backbone runs in the C++ layer loop (drafters/block_kernels.py); on the 8-bit-input
    kernel over its weights rounded to Q8_0 rows."""
    model = make_model(target, **kwargs)
    freeze_linears(model, "test-drafter", kernel=kernel, eight_bit_inputs=kernel == EIGHT_BIT_INPUTS)
    freeze_norms(model)
    drafter = BlockDrafter(model)
    assert drafter.kernels is not None
    looped = kernel if kernel.startswith("few-rows") else None
    assert drafter.kernels.loop_kernel(3 * model.config.block_size) == looped
    return drafter


@pytest.mark.parametrize(
    "qk_norm,kernel,markov_rank,draft_ids",
    [
        (True, "few-rows", 8, None),
        (False, "few-rows", 8, REDUCED),
        (True, "few-rows", 0, None),
        (True, "onednn", 8, None),
        pytest.param(True, EIGHT_BIT_INPUTS, 8, None, marks=needs_q8_rows),
    ],
    ids=["head-norms", "no-head-norms-reduced-vocab", "dflash", "library-kernel", "8-bit-inputs"],
)
def test_the_cpp_kernels_draft_what_the_python_path_drafts(qk_norm, kernel, markov_rank, draft_ids):
    """The C++ layer loop over each request's context cache gives the Python backbone's states (alone, and in
    a batch of different context lengths), and with the greedy Markov chain's C++ loop the same drafts and
    confidences; the context's keys and values, projected for all layers in one product and stored by one C++
    call (the few-rows kernels) or by the Python glue (a library kernel), are the Python path's."""
    target = tiny_target(vocab_size=24)
    drafter = loop_drafter(target, kernel, qk_norm=qk_norm, markov_rank=markov_rank, draft_ids=draft_ids)
    ids = torch.randint(2, 24, (3, 14), generator=torch.Generator().manual_seed(3))
    committed = [ids[0, :5].tolist(), ids[1, :12].tolist(), ids[2, :9].tolist()]
    looped, python = [], []
    for row, seq in zip(ids, committed, strict=True):
        out = features_of(target, row)
        n = len(seq) - 1
        for group in (looped, python):
            d = copy.copy(drafter)
            d.begin(seq, SamplingParams(), torch.Generator(), TargetFeatures(out.layer_hidden[:n], None))
            group.append(d)
    for d in python:
        d.kernels = None
    # the pool holds bfloat16 where the linears take 8-bit inputs on a CPU that reads bfloat16 natively: then the
    # C++ attention multiplies in bfloat16 pairs (queries and softmax weights rounded), the Python path in
    # float32 over the same entries, and the two agree to bfloat16's precision
    assert (drafter.pool.dtype == torch.bfloat16) == (kernel == EIGHT_BIT_INPUTS and native_bfloat16())
    close = {"rtol": 1e-4, "atol": 1e-5} if drafter.pool.dtype is None else {"rtol": 2e-2, "atol": 5e-3}
    for rows in ([0], [0, 1, 2]):
        got = BlockDrafter.propose_batch([looped[r] for r in rows], [committed[r] for r in rows], [4] * len(rows))
        want = BlockDrafter.propose_batch([python[r] for r in rows], [committed[r] for r in rows], [4] * len(rows))
        for a, b in zip(got, want, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist()
            torch.testing.assert_close(a.confidences, b.confidences, **close)
    for a, b in zip(looped, python, strict=True):  # the context K/V: one fused product and the C++ norm, rotation
        for name in ("keys", "values"):
            got, want = (getattr(d.pool.cache, name)[:, d.slot, :, : d.length] for d in (a, b))
            torch.testing.assert_close(got, want, **close)
    model, g = drafter.model, drafter.config.block_size
    inputs = torch.randn(3, g, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    positions = torch.stack([torch.arange(len(s) - 1, len(s) - 1 + g) for s in committed])
    cache, slots, starts = _pool_slots(looped)
    if not kernel.startswith("few-rows"):  # the Python backbone ran, on the library kernel; the context K/V are checked
        return
    with torch.inference_mode():
        want_states = model.backbone(inputs, positions, *_context_and_mask(cache, slots, starts, g, inputs.dtype))
        got_states = drafter.kernels.backbone(inputs, positions, cache, slots, starts)
    torch.testing.assert_close(got_states, want_states, **close)


@pytest.mark.parametrize("vocab,rank", [(24, 8), (300, 64), (2100, 16)])
def test_the_cpp_markov_chain_computes_the_chain_step_by_step(vocab, rank):
    """The C++ chain against its definition, one elementwise float32 op at a time: z = base + sum_j e[j] w2[:, j]
    (each product rounded, then added, in order of j), e the Markov embedding of the previous draft's target id.
    Greedy rows: the same logits bit for bit and the first of equal maxima. Sampled rows: q = softmax(z / t) and
    the draft where q's CDF first passes u. The vocabularies cover one partial block, whole blocks with a partial
    one, and several parts of the vocabulary (the threads' shares)."""
    assert cpu_kernels_available()
    g = torch.Generator().manual_seed(vocab)
    R, G, V = 3, 5, vocab + 40
    base = torch.randn(R, G, vocab, generator=g) * 3
    w1 = torch.randn(V, rank, generator=g) * 0.3
    w2 = (torch.randn(vocab, rank, generator=g) * 0.3).to(torch.bfloat16)
    base[0, 0, 7] = base[0, 0, 9] = base[0, 0].max() + 10  # a tie: the first index wins, as torch.argmax
    w2[9] = w2[7]
    d2t = torch.randint(0, 40, (vocab,), generator=g)
    anchors = torch.randint(0, V, (R,), generator=g)
    temperatures = [0.0, 1.0, 0.7]
    uniforms = torch.rand(R, G, dtype=torch.float64, generator=g)
    blocks = torch.ops.specdecode.markov_bias_blocks(w2)
    tokens, out, embedded = torch.ops.specdecode.markov_chain(base, w1, blocks, d2t, anchors, temperatures, uniforms)
    for r, t in enumerate(temperatures):
        prev = anchors[r].item()
        for k in range(G):
            e = w1[prev]
            assert torch.equal(embedded[r, k], e)
            z = base[r, k].clone()
            for j in range(rank):
                z = z + e[j] * w2[:, j].float()
            if t == 0:
                assert torch.equal(out[r, k], z)
                draft = int(torch.argmax(z))
            else:
                q = torch.softmax(z / t, dim=0)
                torch.testing.assert_close(out[r, k], q, rtol=1e-4, atol=1e-7)
                cdf = torch.cumsum(out[r, k].double(), 0)
                draft = min(int(torch.searchsorted(cdf, uniforms[r, k] * cdf[-1], right=True)), vocab - 1)
            prev = draft + int(d2t[draft])
            assert tokens[r, k].item() == prev
    assert tokens[0, 0].item() == 7 + int(d2t[7])


def test_the_cpp_chain_serves_plain_temperatures_only():
    """Top-k and top-p shape q in `sampling.probabilities` only: such requests stay on the Python chain."""
    drafter = loop_drafter(tiny_target(vocab_size=24))
    assert drafter.kernels.chains_for([SamplingParams(), SamplingParams(temperature=0.7)])
    assert not drafter.kernels.chains_for([SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)])
    assert not drafter.kernels.chains_for([SamplingParams(temperature=1.0, top_k=5)])


@pytest.mark.parametrize(
    "markov_rank,fill_in,draft_ids,loop",
    [(0, False, None, False), (0, True, None, False), (8, False, None, False), (8, False, REDUCED, False)]
    + [(8, False, None, True)],
    ids=["dflash", "fill-in", "dspark", "reduced-vocab", "dspark-layer-loop"],
)
def test_greedy_decoding_is_lossless(markov_rank, fill_in, draft_ids, loop):
    target = tiny_target(vocab_size=24)
    kwargs = dict(markov_rank=markov_rank, fill_in=fill_in, draft_ids=draft_ids)
    drafter = loop_drafter(target, **kwargs) if loop else BlockDrafter(make_model(target, **kwargs))
    prompt = [3, 4, 5, 6, 7]
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    reference = normal.generate(prompt, SamplingParams(), max_new_tokens=40)[0].token_ids
    got = SpeculativeDecoder(target, drafter, draft_length=4).generate(prompt, SamplingParams(), max_new_tokens=40)[0]
    assert got.token_ids == reference
    assert got.stats.position_attempts  # drafts were proposed and verified


@pytest.mark.parametrize(
    "markov_rank,draft_ids,kernels",
    [(0, None, False), (8, None, False), (8, REDUCED, False), (8, None, True), (8, REDUCED, True)],
    ids=["dflash", "dspark", "dspark-reduced-vocab", "dspark-cpp-chain", "dspark-reduced-vocab-cpp-chain"],
)
def test_sampling_is_lossless(markov_rank, draft_ids, kernels):
    """DSpark samples with its Markov-corrected q, DFlash proposes argmax: both keep the target's distribution
    (with a reduced draft vocabulary too, where q is zero on the tokens it cannot propose), also when the
    chain is sampled by the C++ loop (which returns the q it drew from)."""
    target = tiny_target(vocab_size=12)
    kwargs = dict(markov_rank=markov_rank, draft_ids=draft_ids)
    drafter = loop_drafter(target, **kwargs) if kernels else BlockDrafter(make_model(target, **kwargs))
    decoder = SpeculativeDecoder(target, drafter, draft_length=3)
    params = SamplingParams(temperature=1.0)
    prompt = [3, 4, 5, 6]
    n = 1500 if draft_ids is None else 3000  # the reduced vocabulary, whose q is zero on some tokens, gets more
    completions = decoder.generate(prompt, params, max_new_tokens=2, seed=5, num_samples=n)
    counts = Counter(tuple(c.token_ids) for c in completions)
    assert chi_square_pvalue(counts, exact_two_token_distribution(target, prompt, params), n) > 1e-3


def test_checkpoint_round_trip_and_target_check(tmp_path, smollm2):
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    save_drafter(tmp_path / "d", "dspark", model, model.config.to_dict(), target, recipe={"steps": 0})
    loaded = load_drafter(tmp_path / "d", target)
    assert torch.equal(loaded.model.fc.weight, model.fc.weight)
    # a loaded drafter is inference-only: every linear runs the kernels measured on this machine, and it
    # drafts what the trained module drafts
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    assert any(isinstance(m, FrozenLinear) for m in loaded.model.layers[0].modules())
    target.set_capture_layers(LAYERS)
    out = target.forward(torch.arange(2, 14), logits=False)
    proposals = []
    for drafter in (BlockDrafter(model), loaded):
        drafter.begin([5] * 13, SamplingParams(), torch.Generator(), TargetFeatures(out.layer_hidden, out.last_hidden))
        proposals.append(drafter.propose([5] * 13, 4))
    assert proposals[0].tokens.tolist() == proposals[1].tokens.tolist()
    torch.testing.assert_close(proposals[0].confidences, proposals[1].confidences, atol=1e-5, rtol=1e-4)
    with pytest.raises(SpecDecodeError, match="trained for target"):
        load_drafter(tmp_path / "d", smollm2)
    # a checkpoint from before q/k norm existed (no key in its config) loads as it was trained: without it
    legacy = make_model(target, qk_norm=False)
    arch = legacy.config.to_dict()
    del arch["qk_norm"]
    save_drafter(tmp_path / "old", "dspark", legacy, arch, target)
    assert isinstance(load_drafter(tmp_path / "old", target).model.layers[0].q_norm, torch.nn.Identity)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(SpecDecodeError, match="cannot be read"):
        load_drafter(tmp_path / "d", target)


def test_reduced_vocabulary_teacher_counts_the_mass_off_the_draft_vocabulary():
    """The L1 distance over the draft vocabulary plus the target's mass off it is the distance between the
    full-vocabulary distributions (the drafter's q is zero off its vocabulary)."""
    target = tiny_target(vocab_size=24)
    model = make_model(target, draft_ids=REDUCED)
    hidden = torch.randn(3, 5, target.config.hidden_size)
    p, off_vocab, argmax = teacher(model, hidden)
    full = target.model.get_output_embeddings()(hidden).float().softmax(-1)
    torch.testing.assert_close(p, full[..., REDUCED])
    torch.testing.assert_close(off_vocab, 1 - full[..., REDUCED].sum(-1))
    assert torch.equal(argmax, full.argmax(-1))
    q = torch.randn(3, 5, len(REDUCED)).softmax(-1)
    spread = torch.zeros_like(full).index_copy_(-1, model.draft_ids, q)
    torch.testing.assert_close((q - p).abs().sum(-1) + off_vocab, (spread - full).abs().sum(-1))
    index, proposable = draft_index(model.t2d, torch.tensor([3, 4, 11]))
    assert index.tolist() == [1, 0, 6] and proposable.tolist() == [True, False, True]


def test_reduced_vocabulary_checkpoint_round_trip(tmp_path):
    target = tiny_target(vocab_size=24)
    model = make_model(target, draft_ids=REDUCED)
    save_drafter(tmp_path / "d", "dspark", model, model.config.to_dict(), target)
    loaded = load_drafter(tmp_path / "d", target)
    assert torch.equal(loaded.model.draft_ids, REDUCED)
    assert torch.equal(loaded.model.lm_head.weight, model.lm_head.weight)
    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    weights["d2t"] = torch.zeros_like(weights["d2t"])  # draft ids 0..6, which t2d does not mark
    save_file(weights, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match="vocabulary maps disagree"):
        load_drafter(tmp_path / "d", target)


def test_cached_teacher_statistics_give_the_same_losses(tmp_path):
    """The feature cache keeps the log-normalizer and argmax of the target's logits; with them a reduced-vocab
    drafter's losses read N rows of the head instead of V and come out the same. A cache written before these
    statistics existed gets them the next time it is written to."""
    target = tiny_target(vocab_size=24)
    g = torch.Generator().manual_seed(4)
    examples = [Example(f"ex{i}", torch.randint(2, 24, (14,), generator=g), torch.arange(14) >= 3) for i in range(3)]
    cache = write_feature_cache(target, LAYERS, examples, tmp_path / "cache")
    batch = OfflineFeatures(cache).batch(examples[:2])
    logits = target.model.get_output_embeddings()(batch.last_hidden).float()
    torch.testing.assert_close(batch.target_log_z, logits.logsumexp(-1))
    assert torch.equal(batch.target_argmax, logits.argmax(-1))

    model = make_model(target, draft_ids=REDUCED)
    uncached = dataclasses.replace(batch, target_log_z=None, target_argmax=None)
    with_cache = training_losses(model, batch, torch.Generator().manual_seed(0))
    without = training_losses(model, uncached, torch.Generator().manual_seed(0))
    for key in ("loss", "l1", "ce", "simulated_accept_length", "simulated_accept_length_greedy"):
        torch.testing.assert_close(with_cache[key], without[key])

    for path in cache.glob("*.target_*.npy"):  # an older cache
        path.unlink()
    assert OfflineFeatures(cache).batch(examples[:2]).target_log_z is None
    write_feature_cache(target, LAYERS, examples, cache)
    torch.testing.assert_close(OfflineFeatures(cache).batch(examples[:2]).target_log_z, batch.target_log_z)


def test_fine_tuning_starts_from_the_given_drafter(tmp_path):
    """`train --init`: the run starts from the drafter's weights, architecture and draft vocabulary (at lr 0 it
    writes them back unchanged), drops its calibration and refuses a drafter of another kind."""
    target = tiny_target(vocab_size=24)
    g = torch.Generator().manual_seed(6)
    examples = [Example(f"ex{i}", torch.randint(2, 24, (14,), generator=g), torch.arange(14) >= 3) for i in range(12)]
    cache = write_feature_cache(target, LAYERS, examples, tmp_path / "cache")
    model = make_model(target, draft_ids=REDUCED)
    model.config.calibration_temperatures, model.config.calibration_biases = [1.5] * 7, [0.1] * 7
    save_drafter(tmp_path / "init", "dspark", model, model.config.to_dict(), target, {"data": "first"})

    config = TrainConfig(lr=0.0, micro_batch_size=2, max_steps=2, save_every=2, eval_every=2, eval_examples=2)
    path = run_training(
        "dspark", target, "unused", tmp_path / "run", config, str(cache), 64, 0.25, init=tmp_path / "init"
    )
    tuned = load_file(str(path / "model.safetensors"))
    assert tuned.keys() == model.state_dict().keys()
    assert all(torch.equal(tuned[k], v) for k, v in model.state_dict().items())
    saved = json.loads((path / "config.json").read_text())
    assert saved["architecture"]["calibration_temperatures"] == []
    assert saved["recipe"]["init"]["recipe"] == {"data": "first"}
    assert saved["recipe"]["held_out_metrics"]["step"] == 2  # the last evaluation, beside the last step's batch
    assert "simulated_accept_length" in saved["recipe"]["held_out_metrics"]
    with pytest.raises(SpecDecodeError, match="not a dflash one"):
        run_training(
            "dflash", target, "unused", tmp_path / "run2", config, str(cache), 64, 0.25, init=tmp_path / "init"
        )
