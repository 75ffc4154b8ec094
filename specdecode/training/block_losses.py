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
"""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

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
    scores = torch.rand(b, t, generator=generator).masked_fill(~candidate, 2.0)  # non-candidates sort last
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
    sees_context = (torch.arange(t)[None, None, :] < anchors[:, :, None]) & attention_mask[:, None, :]
    sees_context = sees_context.repeat_interleave(block, dim=1)  # (B, N*G, T)
    block_id = torch.arange(n).repeat_interleave(block)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(b, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def training_losses(model: "DSparkModel", batch: "FeatureBatch", generator: torch.Generator) -> dict[str, torch.Tensor]:
    c = model.config
    ids, loss_mask = batch.input_ids, batch.loss_mask & batch.attention_mask
    b, t = ids.shape
    block, g = c.block_size, c.draft_length
    anchors, anchor_valid = sample_anchors(loss_mask, c.num_anchors, generator)
    n = anchors.shape[1]
    block_positions = anchors[:, :, None] + torch.arange(block)  # (B, N, block)
    offsets = torch.arange(g)
    positions = anchors[:, :, None] + offsets  # (B, N, G): draft k is the next token after position a + k

    inputs = model.mask_input((b, n, block))
    inputs = torch.cat([model.embed(torch.gather(ids, 1, anchors))[:, :, None], inputs[:, :, 1:]], dim=2)
    context_kv = model.context_kv(model.context(batch.layer_hidden), torch.arange(t).expand(b, t))
    mask = block_attention_mask(anchors, batch.attention_mask, block)
    h = model.backbone(inputs.flatten(1, 2), block_positions.flatten(1, 2), context_kv, mask)
    h = model.prediction_states(h.view(b, n, block, -1))

    label_pos = (positions + 1).clamp_max(t - 1)
    labels = torch.gather(ids, 1, label_pos.flatten(1)).view(b, n, g)
    supervised = (positions + 1 < t) & torch.gather(loss_mask, 1, label_pos.flatten(1)).view(b, n, g)
    valid = (supervised & anchor_valid[:, :, None]).long().cumprod(dim=-1).bool()  # contiguous prefix
    weights = torch.exp(-offsets.float() / c.loss_decay) * valid

    logits, conf_logits, _ = model.sequential(h, model.lm_head(h), torch.gather(ids, 1, anchors), choose=labels)
    with torch.no_grad():
        teacher_pos = positions.clamp_max(t - 1).flatten(1)  # slots past the end are masked out by `valid`
        teacher_hidden = torch.gather(batch.last_hidden, 1, teacher_pos[..., None].expand(-1, -1, h.shape[-1]))
        p_target = model.lm_head(teacher_hidden.view(b, n, g, -1)).float().softmax(-1)
    log_p = logits.float().log_softmax(-1)
    p_draft = log_p.exp()
    total = weights.sum().clamp_min(1e-6)

    def weighted(x: torch.Tensor) -> torch.Tensor:
        return (x * weights).sum() / total

    ce = weighted(-torch.gather(log_p, -1, labels[..., None]).squeeze(-1))
    l1 = (p_draft - p_target).abs().sum(-1)
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
    out.update(_acceptance_metrics(p_draft.detach(), p_target, labels, valid))
    return out


@torch.no_grad()
def _acceptance_metrics(p_draft, p_target, labels, valid) -> dict[str, torch.Tensor]:
    """Per-slot accuracy and the accepted length verification would give, per block (teacher-forced prefix).
    A slot survives greedy verification when the draft's argmax equals the target's, and at T=1 with
    probability 1 - 0.5 ||p_draft - p_target||_1."""
    draft_argmax = p_draft.argmax(-1)
    alpha = (1 - 0.5 * (p_draft - p_target).abs().sum(-1)).clamp(0, 1)
    return acceptance_metrics(valid, draft_argmax == labels, draft_argmax == p_target.argmax(-1), alpha)


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
