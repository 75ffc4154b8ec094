"""Lossless acceptance of a chain of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

A pure function of tensors: it never knows how the drafts were made. The target gives p at the k+1
positions of one verify pass (p[i] is the distribution of the token after draft i-1); the drafter gives
k tokens and either their draft distributions q or nothing (deterministic proposals, q one-hot).
"""

from dataclasses import dataclass

import torch

from specdecode.sampling import sample


@dataclass
class ChainResult:
    """`tokens` are the accepted drafts followed by the target's own token (resampled or bonus)."""

    tokens: list[int]
    num_accepted: int


def verify_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> ChainResult:
    """Temperature 0: keep drafts while they equal the target's argmax, then add the target's token."""
    targets = target_argmax.tolist()
    drafts = draft_tokens.tolist()
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return ChainResult(tokens=drafts[:n] + [targets[n]], num_accepted=n)


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
        return ChainResult(tokens=drafts[:i] + [sample(residual / residual.sum(), generator)], num_accepted=i)
    return ChainResult(tokens=drafts + [sample(target_probs[len(drafts)], generator)], num_accepted=len(drafts))
