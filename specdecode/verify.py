"""Lossless acceptance of a chain (Leviathan et al. 2023; Chen et al. 2023) or a tree of draft tokens.

Pure functions of tensors: they never know how the drafts were made. The target gives p at the k+1
positions of one verify pass (p[i] is the distribution of the token after draft i-1); the drafter gives
k tokens and either their draft distributions q or nothing (deterministic proposals, q one-hot). A tree
pass has one row per node: row 0 is the root (the last committed token), row i + 1 is node i.

A chain is a tree whose node i has parent i - 1, so greedy chain and tree verification are one walk.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.drafters.base import TreeProposal
from specdecode.sampling import sample


@dataclass
class ChainResult:
    """`tokens` are the accepted drafts followed by the target's own token (resampled or bonus)."""

    tokens: list[int]
    num_accepted: int


@dataclass
class TreeResult(ChainResult):
    """`path` holds the accepted node indices, root to leaf; `tokens` are their tokens plus the target's."""

    path: list[int]


def _walk(tokens: list[int], parents: list[int], target_token: Callable[[int], int]) -> tuple[list[int], int]:
    """From the root, ask the target for its token at the current row and move to the child carrying it.

    Returns the accepted path and the target's token after it. Of siblings carrying the same token, the
    first is followed.
    """
    child = {}
    for i, (parent, token) in enumerate(zip(parents, tokens, strict=True)):
        child.setdefault((parent, token), i)
    path, node = [], -1
    while True:
        x = target_token(node + 1)
        if (node, x) not in child:
            return path, x
        node = child[(node, x)]
        path.append(node)


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> ChainResult:
    """Temperature 0: keep drafts while they equal the target's argmax, then add the target's token."""
    drafts = draft_tokens.tolist()
    path, x = _walk(drafts, list(range(-1, len(drafts) - 1)), target_argmax.tolist().__getitem__)
    return ChainResult(tokens=drafts[: len(path)] + [x], num_accepted=len(path))


def verify_tree_greedy(target_argmax: torch.Tensor, tree: TreeProposal) -> TreeResult:
    """Temperature 0: the longest root-to-node path whose every token is the target's argmax at its parent.

    target_argmax (N+1,): row 0 for the root, row i + 1 for node i. Every accepted token is exactly what
    normal greedy decoding emits after the tokens before it, so the output is normal greedy decoding.
    """
    return _tree_result(tree, *_walk(tree.tokens.tolist(), tree.parents.tolist(), target_argmax.tolist().__getitem__))


def verify_tree(target_probs: torch.Tensor, tree: TreeProposal, generator: torch.Generator | None = None) -> TreeResult:
    """Sample-and-match for deterministic proposals: at the current node draw x from the target's p; if a
    child carries x move to it, else stop and emit x.

    target_probs (N+1, V), rows as in `verify_tree_greedy`. Why it is lossless: every emitted token is a
    draw from p given exactly the tokens before it, as in normal sampling; the pass only computed p for
    several possible prefixes ahead of time, and the tree decides how many of those draws one pass can
    serve, never their values. For a chain this is the one-hot-q case of `verify_chain` (keep x with
    probability p(x), else draw from p without x) with the randomness spent differently; across siblings
    it accepts with probability sum of p over the children, as EAGLE's recursive rejection with q = 1 does.
    """
    return _tree_result(
        tree, *_walk(tree.tokens.tolist(), tree.parents.tolist(), lambda row: sample(target_probs[row], generator))
    )


def _tree_result(tree: TreeProposal, path: list[int], target_token: int) -> TreeResult:
    tokens = tree.tokens.tolist()
    return TreeResult(tokens=[tokens[i] for i in path] + [target_token], num_accepted=len(path), path=path)


def verify_chain(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> ChainResult:
    """Speculative sampling: the committed tokens are distributed exactly as sampling from p.

    target_probs (k+1, V); draft_tokens (k,); draft_probs (k, V) or None for one-hot q.
    """
    drafts = draft_tokens.tolist()
    for i, x in enumerate(drafts):
        p = target_probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator))
        if u * q_x < float(p[x]):  # u < min(1, p(x)/q(x)): keep the draft token
            continue
        # rejected: sample from norm(max(0, p - q)); for one-hot q that is p with x removed
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0
        else:
            residual = (p - draft_probs[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # only reachable through rounding when p == q
            residual = p
        return ChainResult(tokens=drafts[:i] + [sample(residual, generator)], num_accepted=i)
    return ChainResult(tokens=drafts + [sample(target_probs[len(drafts)], generator)], num_accepted=len(drafts))
