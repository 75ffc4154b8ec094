"""Training a block drafter (DFlash, DSpark): random anchors, one masked pass over all blocks, the losses.

Each sequence gets `num_anchors` random anchors; each anchor opens a block [x_a, MASK x (B-1)] at
positions a..a+B-1. Its predicting slots (all B with the anchor predicting, else the B-1 masks) give
draft k = 0, 1, ... the label x_{a+k+1}. All blocks of a batch run in one pass: a block sees the context
strictly before its anchor (the anchor's own features do not exist yet at inference) and its own block,
nothing of other blocks. Losses are weighted by exp(-k/decay) over drafts and cover a contiguous
supervised prefix of each block:
  DFlash: cross-entropy.
  DSpark: 0.1 CE (Markov-corrected, teacher-forced) + 0.9 ||p_draft - p_target||_1
          + 1.0 BCE(confidence, 1 - 0.5 ||p_draft - p_target||_1, detached).
With a reduced draft vocabulary p_draft is zero off it: the L1 distance counts the target's mass there, and
cross-entropy leaves out the labels the drafter cannot propose.
"""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdecode.drafters.vocab import draft_index, logits_of
from specdecode.training.features import TEACHER_CHUNK_ROWS

if TYPE_CHECKING:
    from specdecode.drafters.dspark import DSparkModel
    from specdecode.training.features import FeatureBatch


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` sorted anchors per row among positions whose next token is supervised."""
    b, t = loss_mask.shape
    candidate = torch.zeros_like(loss_mask)
    candidate[:, :-1] = loss_mask[:, 1:]
    scores = torch.rand(b, t, generator=generator).to(loss_mask.device)  # drawn on the CPU: the same on every device
    scores = scores.masked_fill(~candidate, 2.0)  # non-candidates sort last
    order = scores.argsort(dim=1)[:, :num_anchors]
    valid = torch.gather(candidate, 1, order)
    order = torch.where(valid, order, torch.full_like(order, t))  # invalid ones sort after the valid
    anchors, sort_idx = order.sort(dim=1)
    valid = torch.gather(valid, 1, sort_idx)
    return anchors.clamp_max(t - 1), valid


def block_attention_mask(anchors: torch.Tensor, attention_mask: torch.Tensor, block: int) -> torch.Tensor:
    """(B, 1, N*G, T + N*G) boolean: context before the block's anchor, plus the block itself."""
    b, n = anchors.shape
    t = attention_mask.shape[1]
    device = anchors.device
    sees_context = (torch.arange(t, device=device)[None, None, :] < anchors[:, :, None]) & attention_mask[:, None, :]
    sees_context = sees_context.repeat_interleave(block, dim=1)  # (B, N*G, T)
    block_id = torch.arange(n, device=device).repeat_interleave(block)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def training_losses(
    model: "DSparkModel",
    batch: "FeatureBatch",
    generator: torch.Generator,
    num_anchors: int | None = None,
    outcomes: bool = False,
) -> dict:
    """The losses and metrics of one batch. `num_anchors` overrides the drafter's (at the sequence length every
    supervised position opens a block); with `outcomes`, `out["outcomes"]` also holds each block's (valid,
    greedy survival, survival probability at T=1), (B, N, G) each, with the blocks in anchor order."""
    c = model.config
    ids, loss_mask = batch.input_ids, batch.loss_mask & batch.attention_mask
    b, t = ids.shape
    block, g = c.block_size, c.draft_length
    anchors, anchor_valid = sample_anchors(loss_mask, num_anchors or c.num_anchors, generator)
    n = anchors.shape[1]
    block_positions = anchors[:, :, None] + torch.arange(block, device=ids.device)  # (B, N, block)
    offsets = torch.arange(g, device=ids.device)
    positions = anchors[:, :, None] + offsets  # (B, N, G): draft k is the next token after position a + k

    inputs = model.mask_input((b, n, block))
    inputs = torch.cat([model.embed(torch.gather(ids, 1, anchors))[:, :, None], inputs[:, :, 1:]], dim=2)
    context_kv = model.context_kv(model.context(batch.layer_hidden), torch.arange(t, device=ids.device).expand(b, t))
    mask = block_attention_mask(anchors, batch.attention_mask, block)
    h = model.backbone(inputs.flatten(1, 2), block_positions.flatten(1, 2), context_kv, mask)
    h = model.prediction_states(h.view(b, n, block, -1))

    label_pos = (positions + 1).clamp_max(t - 1)
    labels = torch.gather(ids, 1, label_pos.flatten(1)).view(b, n, g)
    supervised = (positions + 1 < t) & torch.gather(loss_mask, 1, label_pos.flatten(1)).view(b, n, g)
    valid = (supervised & anchor_valid[:, :, None]).long().cumprod(dim=-1).bool()  # contiguous prefix
    weights = torch.exp(-offsets.float() / c.loss_decay) * valid

    logits, conf_logits, _ = model.sequential(h, model.draft_logits(h), torch.gather(ids, 1, anchors), choose=labels)
    with torch.no_grad():
        teacher_pos = positions.clamp_max(t - 1).flatten(1)  # slots past the end are masked out by `valid`
        teacher_hidden = torch.gather(batch.last_hidden, 1, teacher_pos[..., None].expand(-1, -1, h.shape[-1]))
        cached = [None if x is None else torch.gather(x, 1, teacher_pos).view(b, n, g) for x in batch.teacher]
        p_target, off_vocab, target_argmax = teacher(model, teacher_hidden.view(b, n, g, -1), *cached)
    log_p = logits.float().log_softmax(-1)
    p_draft = log_p.exp()
    total = weights.sum().clamp_min(1e-6)

    def weighted(x: torch.Tensor) -> torch.Tensor:
        return (x * weights).sum() / total

    label_index, proposable = (labels, None) if model.draft_ids is None else draft_index(model.t2d, labels)
    nll = -torch.gather(log_p, -1, label_index[..., None]).squeeze(-1)
    if proposable is None:
        ce = weighted(nll)
    else:
        ce = (nll * weights * proposable).sum() / (weights * proposable).sum().clamp_min(1e-6)
    l1 = (p_draft - p_target).abs().sum(-1) + off_vocab
    out = {"ce": ce.detach(), "l1": weighted(l1).detach()}
    if c.kind == "dflash":
        loss = ce
    else:
        loss = c.ce_weight * ce + c.l1_weight * weighted(l1)
        if conf_logits is not None:
            survival = (1 - 0.5 * l1.detach()).clamp(0, 1)
            bce = F.binary_cross_entropy_with_logits(conf_logits, survival, reduction="none")
            loss = loss + c.confidence_weight * weighted(bce)
            out["confidence_bce"] = weighted(bce).detach()
    out["loss"] = loss
    # a slot survives greedy verification when the draft's argmax is the target's, at T=1 with 1 - TV
    draft_argmax = model.to_target(p_draft.detach().argmax(-1))
    alpha = (1 - 0.5 * l1.detach()).clamp(0, 1)
    out.update(acceptance_metrics(valid, draft_argmax == labels, draft_argmax == target_argmax, alpha))
    if outcomes:
        out["outcomes"] = (valid, draft_argmax == target_argmax, alpha)
    return out


@torch.no_grad()
def teacher(
    model, last_hidden: torch.Tensor, log_z: torch.Tensor | None = None, argmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the target's final-normed states (..., H): its probabilities of the draft vocabulary (..., N), its
    mass off the draft vocabulary (...) and its argmax over the whole vocabulary (...). `model` gives
    `target_head` and `draft_ids` (None: the whole vocabulary). With the cached log-normalizer and argmax of
    these positions only the N draft rows of the head are read; otherwise all of it, a chunk of rows at a time."""
    if log_z is not None and argmax is not None and model.draft_ids is not None:
        p = (logits_of(model.target_head, last_hidden, model.draft_ids) - log_z[..., None]).exp()
        return p, (1 - p.sum(-1)).clamp_min(0), argmax
    probs, argmaxes, rows = [], [], last_hidden.flatten(0, -2)
    for chunk in rows.split(TEACHER_CHUNK_ROWS):
        logits = logits_of(model.target_head, chunk)
        chunk_log_z = logits.logsumexp(-1, keepdim=True)
        probs.append((logits if model.draft_ids is None else logits[:, model.draft_ids]).sub_(chunk_log_z).exp_())
        argmaxes.append(logits.argmax(-1))
    p = torch.cat(probs).view(*last_hidden.shape[:-1], -1)
    return p, (1 - p.sum(-1)).clamp_min(0), torch.cat(argmaxes).view(last_hidden.shape[:-1])


@torch.no_grad()
def acceptance_metrics(valid, correct, greedy_match, alpha) -> dict[str, torch.Tensor]:
    """The metrics every drafter's training reports, per drafting round (..., positions), so runs of
    different drafters compare: accuracy per position over contiguous supervised prefixes; the greedy
    accepted length (drafts kept while `greedy_match`); at T=1, 1 + sum_k prod_{i<=k} alpha_i, where alpha
    is each draft's survival probability 1 - TV(p_draft, p_target)."""
    prefix = valid.long().cumprod(-1).bool()
    rounds = prefix[..., 0]
    metrics = {}
    for j in range(valid.shape[-1]):
        metrics[f"acc_pos_{j + 1}"] = (correct & prefix)[..., j].sum() / prefix[..., j].sum().clamp_min(1)
    count = rounds.sum().clamp_min(1)
    greedy = (greedy_match & prefix).long().cumprod(-1).sum(-1)
    accepted = (alpha * prefix).cumprod(-1).sum(-1)
    metrics["simulated_accept_length_greedy"] = 1 + (greedy * rounds).sum() / count
    metrics["simulated_accept_length"] = 1 + (accepted * rounds).sum() / count
    return metrics
