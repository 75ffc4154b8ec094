"""The EAGLE-3 drafter: TTT trains what inference runs, chain and tree drafting, checkpoints, training end to end."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode.drafters.base import Drafter, TargetFeatures, TreeSettings
from specdecode.drafters.checkpoint import load_drafter, save_drafter
from specdecode.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Model
from specdecode.drafters.vocab import vocab_maps
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams
from specdecode.training.data import Example
from specdecode.training.eagle3_losses import sample_anchors, training_losses, ttt_attention_mask, ttt_unroll
from specdecode.training.features import FeatureBatch, OfflineFeatures, write_feature_cache
from specdecode.training.recipes import draft_vocabulary, target_shape
from specdecode.training.run import run_training
from specdecode.training.trainer import TrainConfig
from tests.conftest import tiny_llama, tiny_target, tiny_tokenizer

LAYERS = [-1, 0]
VOCAB = 24


def make_model(target: Target, draft_ids=None, steps: int = 4, seed: int = 0) -> Eagle3Model:
    draft_ids = torch.arange(2, VOCAB) if draft_ids is None else draft_ids  # 0 (EOS) and 1 are never drafted
    config = Eagle3Config(
        **target_shape(target.config), draft_vocab_size=len(draft_ids), target_layer_ids=LAYERS, ttt_steps=steps
    )
    torch.manual_seed(seed)
    head = target.model.get_output_embeddings()
    model = Eagle3Model(config, target.model.get_input_embeddings(), head, draft_ids)
    with torch.no_grad():  # a random, sharp head: drafts that disagree with the target
        torch.nn.init.normal_(model.lm_head.weight, std=2.0)
    return model


def features_of(target: Target, ids: torch.Tensor) -> TargetFeatures:
    target.set_capture_layers(LAYERS)
    target.reset()
    out = target.forward(ids, logits=False)
    target.reset()
    return TargetFeatures(out.layer_hidden.clone(), out.last_hidden.clone())  # clones: usable by autograd


def batch_of(target: Target, ids: torch.Tensor, prompt: int = 3) -> FeatureBatch:
    feats = [features_of(target, row) for row in ids]
    b, t = ids.shape
    return FeatureBatch(
        input_ids=ids,
        loss_mask=torch.arange(t).expand(b, t) >= prompt,
        attention_mask=torch.ones(b, t, dtype=torch.bool),
        layer_hidden=torch.stack([f.layer_hidden for f in feats]),
        last_hidden=torch.stack([f.last_hidden for f in feats]),
    )


def random_ids(shape, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_draft_vocabulary_and_maps_round_trip():
    answer = torch.tensor([0, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    examples = [Example("a", torch.tensor([5, 9, 9, 7, 7, 7, 3]), answer)]
    assert draft_vocabulary(examples, 12, 2).tolist() == [7, 9]  # 7 x3, 9 x2; 5 and 3 are not answer tokens
    assert draft_vocabulary(examples, 12, 4).tolist() == [0, 1, 7, 9]  # unseen slots: the lowest ids
    draft_ids = torch.tensor([1, 4, 5, 11])
    d2t, t2d = vocab_maps(draft_ids, 12)
    assert (torch.arange(4) + d2t).tolist() == draft_ids.tolist()
    assert t2d.nonzero().flatten().tolist() == draft_ids.tolist()


def test_shapes():
    target = tiny_target(VOCAB)
    model = make_model(target)
    c = model.config
    hidden = model.fuse(torch.randn(2, 5, len(LAYERS) * c.hidden_size))
    out, k, v = model.step(hidden, random_ids((2, 5), 0), torch.arange(5).expand(2, 5))
    assert hidden.shape == out.shape == (2, 5, c.hidden_size)
    assert k.shape == v.shape == (2, c.num_kv_heads, 5, c.head_dim)
    assert model.draft_logits(out).shape == (2, 5, c.draft_vocab_size)
    assert "embed" not in " ".join(model.state_dict()) and {"d2t", "t2d"} <= set(model.state_dict())


def test_ttt_mask_lets_step_j_see_the_context_and_its_own_chain():
    t, steps = 6, 4
    attention = torch.tensor([[True] * 5 + [False]])  # the last position is padding
    for j in range(steps):
        mask = ttt_attention_mask(j, attention)
        assert mask.shape == (1, 1, t, (j + 1) * t)
        for i in range(t):
            seen = set(mask[0, 0, i].nonzero().flatten().tolist())
            context = set(range(min(i, 4) + 1))  # step-0 keys 0..i, never the padding key 5
            assert seen == context | {s * t + i for s in range(1, j + 1)}


def started_drafter(target: Target, model: Eagle3Model, prompt: list[int]) -> Eagle3Drafter:
    """A drafter that has read the prompt's features (all but the last token's), as after prefill."""
    drafter = Eagle3Drafter(model)
    feats = features_of(target, torch.tensor(prompt))
    features = TargetFeatures(feats.layer_hidden[:-1], feats.last_hidden[:-1])
    drafter.begin(prompt, SamplingParams(), torch.Generator(), features)
    return drafter


def test_training_unroll_equals_chain_drafting():
    """Step j of the TTT unroll at index t computes draft j+1 of a round whose committed sequence ends at t+1,
    when the unroll's tokens are the drafter's own choices: same logits, not just the same argmax."""
    target = tiny_target(VOCAB)
    model = make_model(target, steps=4)
    prefix = random_ids((8,), 1)
    drafter = started_drafter(target, model, prefix.tolist())
    chain_logits, draft_logits = [], model.draft_logits

    def recording(out: torch.Tensor) -> torch.Tensor:
        chain_logits.append(draft_logits(out))
        return chain_logits[-1]

    model.draft_logits = recording
    drafts = drafter.propose(prefix.tolist(), 4).tokens
    del model.draft_logits
    ids = torch.cat([prefix, drafts])[None]
    feats = features_of(target, prefix)
    layer_hidden = torch.cat([feats.layer_hidden, torch.zeros(4, feats.layer_hidden.shape[1])])[None]
    with torch.no_grad():
        outs = ttt_unroll(model, layer_hidden, ids, torch.ones_like(ids, dtype=torch.bool), 4)
    unrolled = torch.stack([model.draft_logits(out[0, 6]) for out in outs])
    torch.testing.assert_close(unrolled, torch.cat(chain_logits), rtol=1e-4, atol=1e-4)
    assert model.draft_ids[unrolled.argmax(-1)].tolist() == drafts.tolist()


def test_losses_are_finite_and_a_tiny_batch_is_learned():
    target = tiny_target(VOCAB)
    model = make_model(target, steps=3)
    batch = batch_of(target, random_ids((2, 14), 2))
    first = training_losses(model, batch, torch.Generator())
    assert torch.isfinite(first["loss"]) and first["loss"] > 0
    assert {f"acc_pos_{k}" for k in (1, 2, 3)} <= set(first)
    assert 1.0 <= float(first["simulated_accept_length"]) <= 4.0
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(40):
        out = training_losses(model, batch, torch.Generator())
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
    assert target.model.get_input_embeddings().weight.grad is None  # the target stays frozen
    last = training_losses(model, batch, torch.Generator())
    assert last["loss"] < 0.5 * first["loss"]
    assert last["simulated_accept_length_greedy"] > first["simulated_accept_length_greedy"]


def test_greedy_chain_decoding_is_lossless():
    target = tiny_target(VOCAB)
    drafter = Eagle3Drafter(make_model(target))
    prompt = [3, 4, 5, 6, 7]
    reference = SpeculativeDecoder(target, Drafter(), 0).generate(prompt, SamplingParams(), max_new_tokens=40)
    got = SpeculativeDecoder(target, drafter, 4).generate(prompt, SamplingParams(), max_new_tokens=40)[0]
    assert got.token_ids == reference[0].token_ids
    assert got.stats.position_attempts  # drafts were proposed and verified
    one_token = SpeculativeDecoder(target, drafter, 4).generate([3], SamplingParams(), max_new_tokens=12)[0]
    normal = SpeculativeDecoder(target, Drafter(), 0).generate([3], SamplingParams(), max_new_tokens=12)[0]
    assert one_token.token_ids == normal.token_ids  # a one-token prompt: no features until the first round


@pytest.mark.parametrize("settings", [TreeSettings(), TreeSettings(5, 4, 60), TreeSettings(3, 2, 5)])
def test_tree_is_valid_and_its_best_path_is_the_chain(settings):
    target = tiny_target(VOCAB)
    model = make_model(target)
    prompt = random_ids((9,), 3).tolist()
    drafter = started_drafter(target, model, prompt)
    chain = drafter.propose(prompt, settings.steps).tokens.tolist()
    for max_depth in (settings.steps, 2):
        tree = drafter.propose_tree(prompt, settings, max_depth)
        parents = tree.parents.tolist()
        assert 1 <= tree.length <= settings.num_tokens
        assert all(p < i for i, p in enumerate(parents))  # parents precede their children
        assert int(tree.depths().max()) <= min(settings.steps, max_depth)
        assert all(model.t2d[tree.tokens])
        # the best path: from the root, always the first (most probable) child
        path, node = [], -1
        while (children := [i for i, p in enumerate(parents) if p == node]) != []:
            node = children[0]
            path.append(int(tree.tokens[node]))
        assert path and path == chain[: len(path)]
    assert drafter.propose(prompt, settings.steps).tokens.tolist() == chain  # drafting left the cache alone


def test_one_branch_tree_is_the_chain():
    target = tiny_target(VOCAB)
    prompt = random_ids((9,), 4).tolist()
    drafter = started_drafter(target, make_model(target), prompt)
    tree = drafter.propose_tree(prompt, TreeSettings(steps=5, branches=1, num_tokens=8), max_depth=5)
    assert tree.tokens.tolist() == drafter.propose(prompt, 5).tokens.tolist()
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3]
    with pytest.raises(SpecDecodeError, match=">= 1"):
        drafter.propose_tree(prompt, TreeSettings(steps=5, branches=0), max_depth=5)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    target = tiny_target(VOCAB)
    model = make_model(target, draft_ids=torch.tensor([0, 2, 3, 5, 8, 13, 21]))
    save_drafter(tmp_path / "d", "eagle3", model, model.config.to_dict(), target)
    loaded = load_drafter(tmp_path / "d", target)
    assert isinstance(loaded, Eagle3Drafter)
    assert torch.equal(loaded.model.fc.weight, model.fc.weight) and torch.equal(loaded.model.d2t, model.d2t)
    prompt = [3, 4, 5, 6]
    fresh = SpeculativeDecoder(target, Eagle3Drafter(model), 4).generate(prompt, SamplingParams(), 20)[0]
    again = SpeculativeDecoder(target, loaded, 4).generate(prompt, SamplingParams(), 20)[0]
    assert again.token_ids == fresh.token_ids and again.stats.position_accepts == fresh.stats.position_accepts

    with pytest.raises(SpecDecodeError, match="trained for target"):
        load_drafter(tmp_path / "d", tiny_target(VOCAB, seed=1))
    with pytest.raises(SpecDecodeError, match="another target"):
        SpeculativeDecoder(tiny_target(VOCAB, seed=1), loaded)
    weights = load_file(tmp_path / "d" / "model.safetensors")
    save_file({**weights, "d2t": weights["d2t"].flip(0)}, tmp_path / "d" / "model.safetensors")
    with pytest.raises(SpecDecodeError, match="is broken"):
        load_drafter(tmp_path / "d", target)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    config["architecture"]["draft_vocab_size"] = 9
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecDecodeError, match="do not match"):
        load_drafter(tmp_path / "d", target)


def test_training_end_to_end_from_a_feature_cache(tmp_path):
    """`run_training` on an offline cache holding more layers than the drafter reads, then decoding with the result."""
    target = Target(tiny_llama(VOCAB, layers=4), tiny_tokenizer(VOCAB), name="tiny4")
    g = torch.Generator().manual_seed(5)
    examples = []
    for i in range(16):
        n = int(torch.randint(10, 16, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (n,), generator=g)
        examples.append(Example(f"ex{i}", ids, torch.arange(n) >= 3))
    cache = write_feature_cache(target, [-1, 0, 1, 2], examples, tmp_path / "cache")
    subset = OfflineFeatures(cache, [2, -1], subset=True).batch(examples[:2]).layer_hidden
    full = OfflineFeatures(cache).batch(examples[:2]).layer_hidden
    h = target.config.hidden_size
    assert torch.equal(subset, torch.cat([full[..., 3 * h :], full[..., :h]], dim=-1))

    config = TrainConfig(lr=1e-2, micro_batch_size=2, max_steps=3, save_every=3, eval_every=3, eval_examples=4)
    architecture = {"draft_vocab_size": 16, "ttt_steps": 3, "target_layer_ids": [-1, 1, 2]}
    path = run_training("eagle3", target, "unused", tmp_path / "run", config, str(cache), 64, 0.25, architecture)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["eval"] and "simulated_accept_length" in records[-1]
    drafter = load_drafter(path, target)
    assert drafter.config.target_layer_ids == [-1, 1, 2] and drafter.config.draft_vocab_size == 16
    prompt = examples[0].input_ids[:5].tolist()
    reference = SpeculativeDecoder(target, Drafter(), 0).generate(prompt, SamplingParams(), 16)[0].token_ids
    assert SpeculativeDecoder(target, drafter, 3).generate(prompt, SamplingParams(), 16)[0].token_ids == reference


def test_anchored_unroll_equals_the_full_unroll_at_the_anchors():
    """Unrolling only sampled indices past step 0 computes exactly what the full unroll computes there."""
    target = tiny_target(VOCAB)
    model = make_model(target, steps=3)
    batch = batch_of(target, random_ids((2, 12), 4))
    valid = batch.attention_mask.clone()
    anchors, ok = sample_anchors(valid, 5, torch.Generator().manual_seed(0))
    assert ok.all() and anchors.shape == (2, 5)
    with torch.no_grad():
        full = ttt_unroll(model, batch.layer_hidden, batch.input_ids, batch.attention_mask, 3)
        anchored = ttt_unroll(model, batch.layer_hidden, batch.input_ids, batch.attention_mask, 3, anchors)
    for f, a in zip(full, anchored, strict=True):
        torch.testing.assert_close(a, f.gather(1, anchors[..., None].expand(-1, -1, f.shape[-1])), rtol=1e-5, atol=1e-5)
    few = torch.zeros(1, 12, dtype=torch.bool)
    few[0, [3, 7]] = True
    anchors, ok = sample_anchors(few, 4, torch.Generator())
    assert ok.sum() == 2 and set(anchors[ok].tolist()) == {3, 7}


def test_tree_decoding_with_eagle3_is_lossless():
    """EAGLE-3's own trees through the engine: token-identical at T=0, the target's distribution at T=1."""
    from collections import Counter

    from tests.test_lossless import exact_two_token_distribution
    from tests.test_verify import chi_square_pvalue

    target = tiny_target(VOCAB)
    decoder = SpeculativeDecoder(target, Eagle3Drafter(make_model(target)), 4, tree=TreeSettings(3, 3, 6))
    prompt = [3, 4, 5, 6, 7]
    reference = SpeculativeDecoder(target, Drafter(), 0).generate(prompt, SamplingParams(), max_new_tokens=40)
    got = decoder.generate(prompt, SamplingParams(), max_new_tokens=40)[0]
    assert got.token_ids == reference[0].token_ids and got.stats.position_attempts
    params, n = SamplingParams(temperature=1.0), 3000
    completions = decoder.generate(prompt, params, max_new_tokens=2, seed=11, num_samples=n)
    counts = Counter(tuple(c.token_ids) for c in completions)
    assert chi_square_pvalue(counts, exact_two_token_distribution(target, prompt, params), n) > 1e-3


def test_engine_export_has_the_names_and_layer_ids_engines_read(tmp_path):
    """`specdecode export --format eagle3`: the LlamaForCausalLMEagle3 folder vLLM/SGLang load. Same tensors,
    the layer's under self_attn./mlp., no embedding, captured layers named by input-of-layer (ours + 1)."""
    from specdecode.drafters.eagle3_export import REQUIRED, export_eagle3

    target = tiny_target(VOCAB)
    target.model.save_pretrained(tmp_path / "target")
    model = make_model(target, draft_ids=torch.tensor([0, 2, 3, 5, 8, 13, 21]))
    save_drafter(tmp_path / "d", "eagle3", model, model.config.to_dict(), target)
    out = export_eagle3(tmp_path / "d", tmp_path / "engine", target_dir=tmp_path / "target")
    weights = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert set(REQUIRED) <= set(weights) and not any("embed" in k for k in weights)
    renamed = [("q_proj", "self_attn.q_proj"), ("o_proj", "self_attn.o_proj"), ("gate_proj", "mlp.gate_proj")]
    for ours, theirs in renamed:
        assert torch.equal(weights[f"midlayer.{theirs}.weight"], getattr(model.midlayer, ours).weight)
    assert torch.equal(weights["midlayer.hidden_norm.weight"], model.midlayer.hidden_norm.weight)
    assert len(weights) == len(model.state_dict())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 7
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in LAYERS]
    assert config["max_position_embeddings"] == target.config.max_position_embeddings
    ours = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**ours, "kind": "dspark"}))
    with pytest.raises(SpecDecodeError, match="exports EAGLE-3 drafters"):
        export_eagle3(tmp_path / "d", tmp_path / "again", target_dir=tmp_path / "target")
