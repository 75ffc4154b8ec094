"""Lossless acceptance of a chain (Leviathan et al. 2023; Chen et al. 2023; block verification, Sun et al.
2025) or a tree of draft tokens.

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
from specdecode.sampling import cpp_takes, sample, sample_weights

SAMPLED_CHAIN_RULE = "block verification"  # what decides kept drafts at T > 0 (recorded rounds depend on it)


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
    serve, never their values. For a single draft this is the one-hot-q case of `verify_block` (keep x
    with probability p(x), else draw from p without x) with the randomness spent differently; across siblings
    it accepts with probability sum of p over the children, as EAGLE's recursive rejection with q = 1 does.
    """
    return _tree_result(
        tree, *_walk(tree.tokens.tolist(), tree.parents.tolist(), lambda row: sample(target_probs[row], generator))
    )


def _tree_result(tree: TreeProposal, path: list[int], target_token: int) -> TreeResult:
    tokens = tree.tokens.tolist()
    return TreeResult(tokens=[tokens[i] for i in path] + [target_token], num_accepted=len(path), path=path)


def block_acceptance(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    support: torch.Tensor | None = None,
) -> tuple[list[float], list[float]]:
    """Block verification's weights w_0..w_k and the law of how many drafts it keeps, P(tau = 0..k).

    Sun et al. 2025 ("Block verification accelerates speculative decoding") judge the k drafts jointly:
    w_0 = 1, w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)); with r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x)),
    the block up to draft i is kept with h_i = r_i / (r_i + 1 - w_i) (h_k = w_k), and tau is the longest kept
    block (each h_i an independent coin). Token-by-token verification keeps draft i only when every earlier
    one was kept; here a later draft that the target likes more than the drafter did can rescue an earlier
    ratio below one. The expected number kept is never lower, and for k = 1 the two rules are the same.
    q one-hot (draft_probs None) is the deterministic-draft case: r_i = w_i (1 - p_{i+1}(x_{i+1})).
    `support`: see `verify_block`."""
    k = draft_tokens.numel()
    rows = torch.arange(k)
    p_x = target_probs[rows, draft_tokens].tolist()
    q_x = [1.0] * k if draft_probs is None else draft_probs[rows, _columns(draft_tokens, support)].tolist()
    weights = [1.0]
    for p, q in zip(p_x, q_x, strict=True):
        weights.append(min(1.0, weights[-1] * p / q) if q > 0 else 0.0)
    if k > 1 and draft_probs is not None:
        w = torch.tensor(weights[1:k], dtype=target_probs.dtype)[:, None]
        on_support = _on_support(target_probs[1:k], support)
        masses = (w * on_support - draft_probs[1:k]).clamp_min(0).sum(-1)
        if support is not None:  # off q's support max(0, w p - 0) = w p: w times the mass p puts there
            masses += w[:, 0] * (1 - on_support.sum(-1)).clamp_min(0)
        masses = masses.tolist()
    else:
        masses = [weights[i] * (1 - p_x[i]) for i in range(1, k)]
    keep = [1.0]  # h_0: the empty block is always kept
    for i in range(1, k):
        free = masses[i - 1] + 1 - weights[i]
        keep.append(masses[i - 1] / free if free > 0 else 1.0)  # free = 0 only where tau = i cannot happen
    if k:
        keep.append(weights[k])
    stops, later_fail = [0.0] * (k + 1), 1.0
    for t in range(k, -1, -1):
        stops[t] = keep[t] * later_fail
        later_fail *= 1 - keep[t]
    return weights, stops


def verify_block(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
    support: torch.Tensor | None = None,
) -> ChainResult:
    """Speculative sampling of a chain with block verification: the committed tokens are distributed exactly
    as sampling from p (tests/test_verify.py checks it by enumeration and by sampling).

    target_probs (k+1, V); draft_tokens (k,); draft_probs (k, V), the q each draft was drawn from, or None
    for deterministic drafts. After keeping tau drafts the next token is drawn from p_{k+1} when the whole
    block is kept, else from max(0, w_tau p_{tau+1} - q_{tau+1}) (for tau = 0: the classic residual).
    `support` (N,): the increasing target ids that the N columns of a draft vocabulary's q (k, N) stand for
    (q is zero elsewhere), so q is never spread over the target's vocabulary (7 x 49,152 zeros a round)."""
    drafts = draft_tokens.tolist()
    if not drafts:  # normal sampling (and every row of a batch that drafted nothing): no draw of tau to pay for
        return ChainResult(tokens=[sample(target_probs[0], generator)], num_accepted=0)
    if cpp_takes(target_probs) and (draft_probs is None or cpp_takes(draft_probs)):
        # the same steps in one C++ call (csrc/sampling.cpp `block_verify`), the same two uniforms in the same order
        u_tau, u_token = (float(torch.rand((), dtype=torch.float64, generator=generator)) for _ in range(2))
        tau, token = torch.ops.specdecode.block_verify(target_probs, draft_tokens, draft_probs, support, u_tau, u_token)
        return ChainResult(tokens=drafts[:tau] + [token], num_accepted=tau)
    weights, stops = block_acceptance(target_probs, draft_tokens, draft_probs, support)
    tau = sample_weights(stops, generator)
    if tau == len(drafts):
        return ChainResult(tokens=drafts + [sample(target_probs[tau], generator)], num_accepted=tau)
    p = target_probs[tau]
    residual = weights[tau] * p  # minus min(w p, q): max(0, w p - q), bit for bit
    if draft_probs is None:
        residual[drafts[tau]] = 0  # w p(x) - 1 <= 0 at the one-hot draft
    elif support is None:
        residual -= torch.minimum(residual, draft_probs[tau])
    else:
        residual.index_add_(0, support, torch.minimum(residual.index_select(0, support), draft_probs[tau]), alpha=-1)
    if float(residual.sum()) <= 0:  # only reachable through rounding when w p == q
        residual = p
    return ChainResult(tokens=drafts[:tau] + [sample(residual, generator)], num_accepted=tau)


def _on_support(probs: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    """The columns of p (..., V) that q's columns stand for."""
    return probs if support is None else probs.index_select(-1, support)


def _columns(draft_tokens: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    """The column of q that holds each draft: its target id, or its place in `support`."""
    return draft_tokens if support is None else torch.searchsorted(support, draft_tokens)
