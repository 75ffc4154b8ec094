"""Training EAGLE-3 with training-time test (TTT): unroll the drafting steps the drafter will take.

Step 0 at index t reads fc(target features at t) and token t+1 and predicts token t+2. Step j >= 1 at
index t reads the drafter's own output hidden of step j-1 at t and token t+1+j (teacher-forced tokens,
self-made features), at RoPE position t+j, and predicts token t+2+j. A query of step j at index t sees the
step-0 keys 0..t (the true-feature context) and the keys of steps 1..j at index t (its own chain), which
is what chain drafting sees at inference.

Only `num_anchors` random indices per sequence are unrolled past step 0 and scored (all of them with
`num_anchors=0`): the LM heads over every index and 7 steps would cost ~6x DSpark's anchored blocks on a
CPU, and 32 anchors x 7 steps is the same number of supervised predictions per sequence as DSpark's and
DFlash's 32 blocks of 7, which keeps the three drafters' training budgets comparable.

Loss per step: soft cross-entropy against the target's next-token distribution renormalised over the
draft vocabulary, where the target's argmax lies in the draft vocabulary and the predicted token is an
answer token; steps weighted decay**j and summed (EAGLE-3 / SpecForge / DeepSpec: 7 steps, 0.8).
"""

from typing import TYPE_CHECKING

import torch

from specdecode.training.block_losses import acceptance_metrics, teacher

if TYPE_CHECKING:
    from specdecode.drafters.eagle3 import Eagle3Model
    from specdecode.training.features import FeatureBatch


def ttt_attention_mask(step: int, attention_mask: torch.Tensor, anchors: torch.Tensor | None = None) -> torch.Tensor:
    """(B, 1, S, T + step * S) boolean over [step-0 keys, step-1 keys, ..., step-`step` keys] for queries at
    `anchors` (B, S) (default: every index, S = T): causal over the (non-padding) step-0 keys, the diagonal
    of every later step."""
    b, t = attention_mask.shape
    device = attention_mask.device
    if anchors is None:
        anchors = torch.arange(t, device=device).expand(b, t)
    causal = (torch.arange(t, device=device) <= anchors[..., None]) & attention_mask[:, None, :]
    diagonal = torch.eye(anchors.shape[1], dtype=torch.bool, device=device).expand(b, -1, -1)
    return torch.cat([causal] + [diagonal] * step, dim=-1)[:, None]


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, i + n] at index i, zero (False) past the end."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - n] = x[:, n:]
    return out


def sample_anchors(valid: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` distinct random indices per row among the `valid` ones (B, T): indices (B, S) and which
    of them are real (rows with fewer valid indices are padded with invalid ones)."""
    b, t = valid.shape
    s = min(count, t)
    keys = torch.rand(b, t, generator=generator).to(valid.device) + (~valid).float() * 2  # valid ones sort first
    anchors = keys.argsort(-1)[:, :s].sort(-1).values
    return anchors, valid.gather(1, anchors)


def ttt_unroll(model: "Eagle3Model", layer_hidden, ids, attention_mask, steps: int, anchors=None) -> list[torch.Tensor]:
    """The drafter's output hidden states of every unrolled step at `anchors` (B, S) (default: every index):
    step j at index t has read token t+1+j and predicts token t+2+j. Step 0 runs on the whole sequence (its
    keys are every later step's context); steps >= 1 only at the anchors, each seeing its own chain."""
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).expand(b, t)
    if anchors is None:
        anchors = positions
    hidden, k, v = model.step(
        model.fuse(layer_hidden), shift_left(ids, 1), positions, None, None, ttt_attention_mask(0, attention_mask)
    )
    past_k, past_v = k, v
    hidden = hidden.gather(1, anchors[..., None].expand(-1, -1, hidden.shape[-1]))
    outs = [hidden]
    for j in range(1, steps):
        tokens = shift_left(ids, j + 1).gather(1, anchors)
        mask = ttt_attention_mask(j, attention_mask, anchors)
        hidden, k, v = model.step(hidden, tokens, anchors + j, past_k, past_v, mask)
        past_k, past_v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        outs.append(hidden)
    return outs


def training_losses(model: "Eagle3Model", batch: "FeatureBatch", generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The weighted TTT loss and, per step, accuracy and the acceptance numbers of `block_losses`."""
    c = model.config
    ids = batch.input_ids
    supervised = batch.loss_mask & batch.attention_mask  # token at this position is an answer token
    count = c.num_anchors if c.num_anchors > 0 else ids.shape[1]
    anchors, anchor_ok = sample_anchors(shift_left(supervised, 2), count, generator)

    shape = (*anchors.shape, c.ttt_steps)
    valid = torch.zeros(shape, dtype=torch.bool, device=ids.device)  # step j at the anchor predicts an answer token
    correct, greedy_match = torch.zeros_like(valid), torch.zeros_like(valid)
    alpha = torch.zeros(shape, device=ids.device)
    step_losses, covered, taught = [], 0, 0
    for j, out in enumerate(ttt_unroll(model, batch.layer_hidden, ids, batch.attention_mask, c.ttt_steps, anchors)):
        rows = anchor_ok & shift_left(supervised, j + 2).gather(1, anchors)
        rows_b, rows_s = rows.nonzero(as_tuple=True)
        predicted_at = anchors[rows_b, rows_s] + 1 + j  # the target's distribution there is of token t+2+j
        cached = [None if x is None else x[rows_b, predicted_at] for x in batch.teacher]
        p_full, off_vocab, target_argmax = teacher(model, batch.last_hidden[rows_b, predicted_at], *cached)
        trained = model.t2d[target_argmax].float()
        log_q = model.draft_logits(out[rows_b, rows_s]).float().log_softmax(-1)  # (M, N)
        p_draft_vocab = p_full / p_full.sum(-1, keepdim=True).clamp_min(1e-12)
        ce = -(p_draft_vocab * log_q).sum(-1)
        step_losses.append((ce * trained).sum() / trained.sum().clamp_min(1))
        covered, taught = covered + trained.sum(), taught + len(trained)

        with torch.no_grad():
            q = log_q.exp()
            drafted = model.draft_ids[log_q.argmax(-1)]
            tv = 0.5 * ((q - p_full).abs().sum(-1) + off_vocab)
            valid[..., j] = rows
            alpha[rows_b, rows_s, j] = (1 - tv).clamp(0, 1)
            correct[rows_b, rows_s, j] = drafted == ids[rows_b, predicted_at + 1]
            greedy_match[rows_b, rows_s, j] = drafted == target_argmax

    result = {
        "loss": sum(c.step_weight_decay**j * step_loss for j, step_loss in enumerate(step_losses)),
        "soft_ce": torch.stack(step_losses).mean().detach(),  # unweighted mean over steps
        "draft_vocab_coverage": torch.as_tensor(covered / max(taught, 1)),
    }
    result.update(acceptance_metrics(valid, correct, greedy_match, alpha))
    return result
