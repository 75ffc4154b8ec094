"""The DSpark/DFlash drafter: training and inference compute the same thing, and decoding stays lossless."""

from collections import Counter

import pytest
import torch

from specdecode.drafters.base import Drafter, TargetFeatures
from specdecode.drafters.checkpoint import load_drafter, save_drafter
from specdecode.drafters.dspark import BlockDrafter, DSparkConfig, DSparkModel
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams
from specdecode.training.block_losses import block_attention_mask, sample_anchors, training_losses
from specdecode.training.features import FeatureBatch
from tests.conftest import tiny_target
from tests.test_lossless import exact_two_token_distribution
from tests.test_verify import chi_square_pvalue

LAYERS = [-1, 0]


def make_model(target, markov_rank=8, head="vanilla", seed=0, fill_in=False, qk_norm=True) -> DSparkModel:
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
    )
    torch.manual_seed(seed)
    model = DSparkModel(config, target.model.get_input_embeddings(), target.model.get_output_embeddings())
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
    "head,markov_rank,fill_in",
    [("vanilla", 8, False), ("gated", 8, False), ("rnn", 8, False), ("vanilla", 0, True)],
    ids=["vanilla", "gated", "rnn", "dflash-fill-in"],
)
def test_training_matches_inference(head, markov_rank, fill_in):
    """The block logits of the masked training pass equal what the drafter computes at inference."""
    target = tiny_target(vocab_size=24)
    model = make_model(target, markov_rank=markov_rank, head=head, fill_in=fill_in)
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
    expected, _, _ = model.sequential(h, model.lm_head(h), ids[anchor], choose=lambda x: x.argmax(-1))
    # inference path: the committed sequence is ids[:anchor + 1], features known for ids[:anchor]
    drafter = BlockDrafter(model)
    drafter.begin(
        ids[: anchor + 1].tolist(),
        SamplingParams(),
        torch.Generator(),
        TargetFeatures(out.layer_hidden[:anchor], out.last_hidden[:anchor]),
    )
    proposal = drafter.propose(ids[: anchor + 1].tolist(), g)
    assert proposal.tokens.tolist() == expected.argmax(-1).tolist()


def test_batched_proposals_equal_single_ones():
    """The continuous engine drafts for all requests in one call: contexts of different lengths are padded and
    masked, so each request gets the block it would get alone (and nothing for a zero budget)."""
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    ids = torch.randint(2, 24, (3, 14), generator=torch.Generator().manual_seed(3))
    committed = [ids[0, :5].tolist(), ids[1, :12].tolist(), ids[2, :9].tolist()]
    drafters = []
    for row, seq in zip(ids, committed, strict=True):
        out = features_of(target, row)
        drafter = BlockDrafter(model)
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


@pytest.mark.parametrize(
    "markov_rank,fill_in", [(0, False), (0, True), (8, False)], ids=["dflash", "fill-in", "dspark"]
)
def test_losses_are_finite_and_trainable(markov_rank, fill_in):
    target = tiny_target(vocab_size=24)
    model = make_model(target, markov_rank=markov_rank, fill_in=fill_in)
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


@pytest.mark.parametrize(
    "markov_rank,fill_in", [(0, False), (0, True), (8, False)], ids=["dflash", "fill-in", "dspark"]
)
def test_greedy_decoding_is_lossless(markov_rank, fill_in):
    target = tiny_target(vocab_size=24)
    drafter = BlockDrafter(make_model(target, markov_rank=markov_rank, fill_in=fill_in))
    prompt = [3, 4, 5, 6, 7]
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    reference = normal.generate(prompt, SamplingParams(), max_new_tokens=40)[0].token_ids
    got = SpeculativeDecoder(target, drafter, draft_length=4).generate(prompt, SamplingParams(), max_new_tokens=40)[0]
    assert got.token_ids == reference
    assert got.stats.position_attempts  # drafts were proposed and verified


@pytest.mark.parametrize("markov_rank", [0, 8], ids=["dflash", "dspark"])
def test_sampling_is_lossless(markov_rank):
    """DSpark samples with its Markov-corrected q, DFlash proposes argmax: both keep the target's distribution."""
    target = tiny_target(vocab_size=12)
    decoder = SpeculativeDecoder(target, BlockDrafter(make_model(target, markov_rank=markov_rank)), draft_length=3)
    params = SamplingParams(temperature=1.0)
    prompt = [3, 4, 5, 6]
    n = 3000
    completions = decoder.generate(prompt, params, max_new_tokens=2, seed=5, num_samples=n)
    counts = Counter(tuple(c.token_ids) for c in completions)
    assert chi_square_pvalue(counts, exact_two_token_distribution(target, prompt, params), n) > 1e-3


def test_checkpoint_round_trip_and_target_check(tmp_path, smollm2):
    target = tiny_target(vocab_size=24)
    model = make_model(target)
    save_drafter(tmp_path / "d", "dspark", model, model.config.to_dict(), target, recipe={"steps": 0})
    loaded = load_drafter(tmp_path / "d", target)
    assert torch.equal(loaded.model.fc.weight, model.fc.weight)
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
