"""A reduced draft vocabulary: the drafter's LM head covers only N frequent target tokens.

The LM head over a 49,152-token vocabulary is most of a small drafter's compute, in training and in every
round; the answers a target writes use far fewer tokens. EAGLE-3, SpecForge and vLLM's DFlash/DSpark
drafters keep two maps, stored beside the weights: `d2t[i]`, the offset of draft id i (its target id is
i + d2t[i], the convention of their checkpoints), and `t2d`, which marks the target ids that are drafted.
A draft distribution is zero off the draft vocabulary, which verification handles like any other q.
"""

import torch
import torch.nn.functional as F
from torch import nn


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for sorted target ids `draft_ids`: target id = i + d2t[i]; t2d marks the drafted ids."""
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def draft_ids_of(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft id."""
    return torch.arange(len(d2t), device=d2t.device) + d2t


def maps_agree(d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    """Whether d2t and t2d describe the same increasing set of target ids (a loaded checkpoint may not)."""
    ids, size = draft_ids_of(d2t).cpu(), len(t2d)
    valid = bool(((ids >= 0) & (ids < size)).all()) and bool((ids[1:] > ids[:-1]).all())
    return valid and torch.equal(vocab_maps(ids, size)[1], t2d.cpu())


def draft_index(t2d: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft id of each target id (0 where it has none) and whether it has one."""
    drafted = t2d[target_ids]
    index = (t2d.long().cumsum(0) - 1)[target_ids]
    return torch.where(drafted, index, torch.zeros_like(index)), drafted


def logits_of(head: nn.Module, hidden: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits of a (frozen) linear head, over all its rows or over the rows `ids` only."""
    hidden = hidden.to(head.weight.dtype)
    return (head(hidden) if ids is None else F.linear(hidden, head.weight[ids])).float()
