"""Tree verification: the walk on hand-made trees, the tree pass (mask, positions, kept KV), and losslessness.

Temperature 0: tree decoding on the real default target is token-identical to normal greedy decoding.
Temperature 1: the first generated tokens follow the target's exact distribution (tiny target, chi-square).
"""

from collections import Counter

import pytest
import torch

from specdecode.drafters import Drafter, build_drafter
from specdecode.drafters.base import TreeProposal, TreeSettings
from specdecode.engine.decode import SpeculativeDecoder, tree_attention
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams, sample
from specdecode.verify import ChainResult, TreeResult, verify_greedy, verify_tree, verify_tree_greedy
from tests.conftest import tiny_target
from tests.test_cli_errors import assert_one_line_error, run_main
from tests.test_lossless import PROMPTS, exact_two_token_distribution
from tests.test_verify import chi_square_pvalue


def tree_from_paths(paths: list[list[int]], max_depth: int | None = None) -> TreeProposal:
    """The trie of root-to-leaf token paths (cut at `max_depth`); shared prefixes share nodes."""
    tokens, parents, node_of = [], [], {}
    for path in paths:
        parent = -1
        for token in path[:max_depth]:
            key = (parent, token)
            if key not in node_of:
                node_of[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node_of[key]
    return TreeProposal(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


# ---------------------------------------------------------------- the walk on hand-made trees
# root -> 5 (node 0) -> 6 (node 2)
#                    -> 8 (node 3) -> 9 (node 4)
#      -> 7 (node 1)
HAND_TREE = TreeProposal(tokens=torch.tensor([5, 7, 6, 8, 9]), parents=torch.tensor([-1, -1, 0, 0, 3]))


def test_verify_tree_greedy_follows_the_matching_branch():
    argmax = torch.tensor([5, 8, 1, 1, 9, 2])  # rows: root, then nodes 0..4
    assert verify_tree_greedy(argmax, HAND_TREE) == TreeResult(tokens=[5, 8, 9, 2], num_accepted=3, path=[0, 3, 4])
    argmax = torch.tensor([7, 8, 4, 1, 9, 2])  # the second root child; it has no children
    assert verify_tree_greedy(argmax, HAND_TREE) == TreeResult(tokens=[7, 4], num_accepted=1, path=[1])
    argmax = torch.tensor([6, 8, 1, 1, 9, 2])  # 6 is in the tree, but not a child of the root
    assert verify_tree_greedy(argmax, HAND_TREE) == TreeResult(tokens=[6], num_accepted=0, path=[])
    empty = TreeProposal(tokens=torch.empty(0, dtype=torch.long), parents=torch.empty(0, dtype=torch.long))
    assert verify_tree_greedy(torch.tensor([3]), empty) == TreeResult(tokens=[3], num_accepted=0, path=[])


def test_chain_shaped_tree_verifies_like_a_chain():
    drafts, argmax = torch.tensor([5, 6, 9]), torch.tensor([5, 6, 7, 8])
    chain = TreeProposal(tokens=drafts, parents=torch.arange(len(drafts)) - 1)
    tree = verify_tree_greedy(argmax, chain)
    assert verify_greedy(argmax, drafts) == ChainResult(tree.tokens, tree.num_accepted) == ChainResult([5, 6, 7], 2)


def test_verify_tree_with_one_hot_target_is_the_greedy_walk():
    argmax = torch.tensor([5, 8, 1, 1, 9, 2])
    one_hot = torch.nn.functional.one_hot(argmax, 12).float()
    assert verify_tree(one_hot, HAND_TREE, torch.Generator().manual_seed(0)) == verify_tree_greedy(argmax, HAND_TREE)


def test_verify_tree_emits_the_target_distribution():
    """A toy target p(next | last token): sample-and-match, then sampling the rest, gives exact p(x1) p(x2|x1)."""
    vocab = 10
    logits = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(4))
    logits[:, [5, 7, 8]] += 1.5  # the tree's tokens are likely, so its branches are often followed
    rows = logits.softmax(-1)
    root = 0
    probs = torch.stack([rows[root]] + [rows[t] for t in HAND_TREE.tokens.tolist()])  # p at root, then each node
    g, n, counts, depth_two = torch.Generator().manual_seed(1), 4000, Counter(), 0
    for _ in range(n):
        result = verify_tree(probs, HAND_TREE, g)
        tokens = result.tokens
        if len(tokens) == 1:
            tokens.append(sample(rows[tokens[0]], g))
        counts[tuple(tokens[:2])] += 1
        depth_two += result.num_accepted >= 2
    exact = {(a, b): float(rows[root, a] * rows[a, b]) for a in range(vocab) for b in range(vocab)}
    assert depth_two > n // 50  # about 2.7% of rounds accept two nodes
    assert chi_square_pvalue(counts, exact, n) > 1e-3


# ---------------------------------------------------------------- the tree pass on the real target
def prefilled(target, prompt: str) -> tuple[list[int], int]:
    ids = target.encode(prompt)
    target.reset()
    target.forward(torch.tensor(ids[:-1]), logits=False)
    return ids, len(ids) - 1


def test_tree_attention_mask_and_positions():
    mask, positions = tree_attention(HAND_TREE.parents, start=3)
    assert positions.tolist() == [[3, 4, 4, 5, 5, 6]]
    assert mask.shape == (1, 1, 6, 9) and mask[0, 0, :, :3].all()
    assert mask[0, 0, :, 3:].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1],
    ]
    with pytest.raises(SpecDecodeError, match="parents must precede"):
        tree_attention(torch.tensor([-1, 1]), start=0)


def test_chain_shaped_tree_pass_equals_the_causal_pass(smollm2_fp32):
    ids, start = prefilled(smollm2_fp32, "Name a color.")
    tokens = torch.tensor([ids[-1], 791, 1345, 28, 2051])
    causal = smollm2_fp32.forward(tokens).logits
    smollm2_fp32.rollback(start)
    mask, positions = tree_attention(torch.arange(4) - 1, start)
    tree = smollm2_fp32.forward(tokens, position_ids=positions, attention_mask=mask).logits
    torch.testing.assert_close(tree, causal, atol=1e-4, rtol=1e-4)


def test_tree_pass_nodes_equal_causal_passes_and_keep_path_leaves_a_normal_cache(smollm2_fp32):
    """Every node's logits are those of a causal pass over its root-to-node path; after `keep_path` the cache
    is the one a causal pass over the accepted path builds."""
    smollm2_fp32.set_capture_layers([3])
    ids, start = prefilled(smollm2_fp32, "Name a color.")
    tree = tree_from_paths([[791, 1345, 28], [791, 2051], [418, 28, 1345]])  # nodes: 791 1345 28 2051 418 28 1345
    mask, positions = tree_attention(tree.parents, start)
    nodes = torch.cat([torch.tensor(ids[-1:]), tree.tokens])
    out = smollm2_fp32.forward(nodes, position_ids=positions, attention_mask=mask)
    smollm2_fp32.keep_path(start, [0, 5, 6, 7])  # root, 418, 28, 1345
    assert smollm2_fp32.cache_length == start + 4
    end = start + 4
    kept = smollm2_fp32.kv.keys[:, 0, :, :end].clone(), smollm2_fp32.kv.values[:, 0, :, :end].clone()
    for rows, path in (([0, 5, 6, 7], [418, 28, 1345]), ([0, 1, 2, 3], [791, 1345, 28]), ([0, 1, 4], [791, 2051])):
        smollm2_fp32.rollback(start)
        causal = smollm2_fp32.forward(torch.tensor(ids[-1:] + path))
        torch.testing.assert_close(out.logits[rows], causal.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.layer_hidden[rows], causal.layer_hidden, atol=1e-4, rtol=1e-4)
    smollm2_fp32.rollback(start)
    smollm2_fp32.forward(torch.tensor(ids[-1:] + [418, 28, 1345]))
    torch.testing.assert_close(kept[0], smollm2_fp32.kv.keys[:, 0, :, :end], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kept[1], smollm2_fp32.kv.values[:, 0, :, :end], atol=1e-4, rtol=1e-4)
    smollm2_fp32.set_capture_layers([])


# ---------------------------------------------------------------- losslessness of the engine
class ReferenceTreeDrafter(Drafter):
    """Test-only: trees that mix a known greedy continuation with wrong branches, in a shape that changes every
    round (the true path is cut at depth 0..4, wrong siblings at several depths, a wrong branch that then
    carries the true tokens)."""

    name = "reference-tree"

    def __init__(self, references: list[list[int]], vocab_size: int) -> None:
        self.references = references  # prompt + greedy completion
        self.vocab_size = vocab_size
        self.round = 0
        self.kept_rows: list[tuple[int, int]] = []  # (num_accepted, feature rows) per round

    def wrong(self, token: int, j: int) -> int:
        return (token + 1 + j) % self.vocab_size

    def propose_tree(self, ids: list[int], settings: TreeSettings, max_depth: int) -> TreeProposal:
        reference = next((r for r in self.references if r[: len(ids)] == ids), ids)
        true = reference[len(ids) : len(ids) + 5] + [0] * 5  # padding only past the reference's end
        cut = self.round % 5
        self.round += 1
        paths = [
            [self.wrong(true[0], 0), true[1], true[2]],
            true[:cut] + [self.wrong(true[cut], 1), true[cut + 1]],
            [true[0], self.wrong(true[1], 2), true[2]],
            [self.wrong(true[0], 3)],
            true[: cut + 1] if cut % 2 else [],
        ]
        return tree_from_paths(paths, max_depth)

    def observe(self, ids, num_accepted, features) -> None:
        self.kept_rows.append((num_accepted, features.last_hidden.shape[0]))


def test_greedy_tree_decoding_equals_normal_greedy(smollm2):
    """Temperature 0, real target: the tree path gives exactly normal greedy decoding's tokens."""
    new_tokens = 48
    prompts = [smollm2.encode(prompt) for prompt in PROMPTS[:2]]
    normal = SpeculativeDecoder(smollm2, Drafter(), draft_length=0)
    references = [normal.generate(p, SamplingParams(), max_new_tokens=new_tokens)[0].token_ids for p in prompts]
    drafter = ReferenceTreeDrafter([p + r for p, r in zip(prompts, references, strict=True)], smollm2.vocab_size)
    decoder = SpeculativeDecoder(smollm2, drafter, tree=TreeSettings())
    for prompt_ids, reference in zip(prompts, references, strict=True):
        completion = decoder.generate(prompt_ids, SamplingParams(), max_new_tokens=new_tokens)[0]
        assert completion.token_ids == reference
        assert max(completion.stats.accepted_lengths) >= 4, "the tree path was never used beyond its first node"
        assert completion.stats.mean_accepted_length > 1.5
    assert all(rows == accepted + 1 for accepted, rows in drafter.kept_rows)


class FixedTreeDrafter(Drafter):
    """Test-only: the same tree whatever the context; some of its tokens are likely, most are wrong."""

    name = "fixed-tree"

    def __init__(self, paths: list[list[int]]) -> None:
        self.paths = paths

    def propose_tree(self, ids: list[int], settings: TreeSettings, max_depth: int) -> TreeProposal:
        return tree_from_paths(self.paths, max_depth)


def test_tree_sampling_matches_target_distribution_tiny():
    """Temperature 1, tiny target: the first two tokens follow the target's exact distribution."""
    target = tiny_target(vocab_size=12, seed=0)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    params = SamplingParams(temperature=1.0)
    exact = exact_two_token_distribution(target, prompt, params)
    likely = sorted(exact, key=exact.get, reverse=True)[:3]  # the three likeliest (x1, x2) pairs
    paths = [list(likely[0]), [7, 2], list(likely[1]), [likely[2][0], 9], [5]]
    decoder = SpeculativeDecoder(target, FixedTreeDrafter(paths), tree=TreeSettings())
    n = 3000
    # three new tokens, so the first round drafts two deep and both compared tokens can come from the tree
    completions = decoder.generate(prompt, params, max_new_tokens=3, seed=5, num_samples=n)
    counts = Counter(tuple(c.token_ids[:2]) for c in completions)
    first_round = Counter(c.stats.accepted_lengths[0] for c in completions)
    assert first_round[3] > n // 20 and first_round[2] > n // 10, first_round  # depth 2 and depth 1 were accepted
    assert chi_square_pvalue(counts, exact, n) > 1e-3


def test_tree_mode_needs_a_branching_drafter(smollm2):
    decoder = SpeculativeDecoder(smollm2, build_drafter("ngram", smollm2), tree=TreeSettings())
    with pytest.raises(SpecDecodeError, match="cannot draft trees"):
        decoder.generate(smollm2.encode("Hi"), SamplingParams(), max_new_tokens=4)


@pytest.mark.parametrize(
    "tree, expected",
    [
        ("5,4", "--tree expects STEPS,BRANCHES,TOKENS"),
        ("5,0,8", "must all be >= 1"),
        ("a,b,c", "comma-separated integers"),
    ],
)
def test_cli_rejects_bad_tree_settings(tree, expected, capfd):
    assert_one_line_error(run_main(capfd, "generate", "Hi", "--tree", tree), expected)


def test_cli_tree_with_a_chain_drafter_gives_one_line(capfd, smollm2):
    assert_one_line_error(
        run_main(capfd, "generate", "Hi", "--drafter", "ngram", "--tree", "5,4,8"), "cannot draft trees"
    )
