"""Training EAGLE-3 with training-time test (TTT): unroll the drafting steps the drafter will take.

Step 0 at index t reads fc(target features at t) and token t+1 and predicts token t+2. Step j >= 1 at
index t reads the drafter's own output hidden of step j-1 at t and token t+1+j (teacher-forced tokens,
self-made features), at RoPE position t+j, and predicts token t+2+j. A query of step j at index t sees the
step-0 keys 0..t (the true-feature context) and the keys of steps 1..j at index t (its own chain), which
is what chain drafting sees at inference.

Loss per step: soft cross-entropy against the target's next-token distribution renormalised over the
draft vocabulary, where the target's argmax lies in the draft vocabulary and the predicted token is an
answer token; steps weighted decay**j and summed (EAGLE-3 / SpecForge / DeepSpec: 7 steps, 0.8).
"""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdecode.drafters.eagle3 import Eagle3Model
    from specdecode.training.features import FeatureBatch

TEACHER_CHUNK_ROWS = 512  # target logits are computed this many positions at a time (49k floats each)


def ttt_attention_mask(step: int, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, (step + 1) * T) boolean over [step-0 keys, step-1 keys, ..., step-`step` keys]: causal over
    the (non-padding) step-0 keys, the diagonal of every later step."""
    b, t = attention_mask.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril() & attention_mask[:, None, :]
    diagonal = torch.eye(t, dtype=torch.bool, device=attention_mask.device).expand(b, t, t)
    return torch.cat([causal] + [diagonal] * step, dim=-1)[:, None]


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, i + n] at index i, zero (False) past the end."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - n] = x[:, n:]
    return out


@torch.no_grad()
def teacher(model: "Eagle3Model", last_hidden: torch.Tensor, needed: torch.Tensor):
    """The target's probabilities of the draft tokens (B, T, N), over its whole vocabulary, and its argmax
    (B, T), at the `needed` positions only, a chunk of rows at a time (the full logits would not fit)."""
    b, t, _ = last_hidden.shape
    draft_ids = model.draft_ids
    probs = last_hidden.new_zeros(b, t, len(draft_ids), dtype=torch.float32)
    argmax = torch.zeros(b, t, dtype=torch.long, device=last_hidden.device)
    rows_b, rows_t = needed.nonzero(as_tuple=True)
    for start in range(0, len(rows_b), TEACHER_CHUNK_ROWS):
        bi, ti = rows_b[start : start + TEACHER_CHUNK_ROWS], rows_t[start : start + TEACHER_CHUNK_ROWS]
        logits = model.target_logits(last_hidden[bi, ti])
        probs[bi, ti] = (logits[:, draft_ids] - logits.logsumexp(-1, keepdim=True)).exp()
        argmax[bi, ti] = logits.argmax(-1)
    return probs, argmax


def ttt_unroll(model: "Eagle3Model", layer_hidden, ids, attention_mask, steps: int) -> list[torch.Tensor]:
    """The drafter's output hidden states (B, T, H) of every unrolled step; step j at index t has read
    token t+1+j and predicts token t+2+j."""
    b, t = ids.shape
    hidden, past_k, past_v, outs = model.fuse(layer_hidden), None, None, []
    positions = torch.arange(t, device=ids.device).expand(b, t)
    for j in range(steps):
        mask = ttt_attention_mask(j, attention_mask)
        hidden, k, v = model.step(hidden, shift_left(ids, j + 1), positions + j, past_k, past_v, mask)
        past_k = k if past_k is None else torch.cat([past_k, k], dim=2)
        past_v = v if past_v is None else torch.cat([past_v, v], dim=2)
        outs.append(hidden)
    return outs


def training_losses(model: "Eagle3Model", batch: "FeatureBatch", generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The weighted TTT loss and, per step, accuracy and the acceptance numbers of `block_losses`."""
    c = model.config
    ids = batch.input_ids
    b, t = ids.shape
    supervised = batch.loss_mask & batch.attention_mask  # token at this position is an answer token
    teaches = shift_left(supervised, 1)  # the target's distribution here is a label's
    p_target, target_argmax = teacher(model, batch.last_hidden, teaches)
    in_vocab = model.t2d[target_argmax]

    shape = (b, t, c.ttt_steps)
    valid = torch.zeros(shape, dtype=torch.bool, device=ids.device)  # step j at index t predicts an answer token
    correct, greedy_match = torch.zeros_like(valid), torch.zeros_like(valid)
    alpha = torch.zeros(shape, device=ids.device)
    step_losses = []
    for j, out in enumerate(ttt_unroll(model, batch.layer_hidden, ids, batch.attention_mask, c.ttt_steps)):
        rows = shift_left(supervised, j + 2)
        rows_b, rows_t = rows.nonzero(as_tuple=True)
        log_q = model.draft_logits(out[rows_b, rows_t]).float().log_softmax(-1)  # (M, N)
        p_full = p_target[rows_b, rows_t + 1 + j]  # the target's distribution of token t+2+j
        trained = in_vocab[rows_b, rows_t + 1 + j].float()
        p_draft_vocab = p_full / p_full.sum(-1, keepdim=True).clamp_min(1e-12)
        ce = -(p_draft_vocab * log_q).sum(-1)
        step_losses.append((ce * trained).sum() / trained.sum().clamp_min(1))

        with torch.no_grad():
            q = log_q.exp()
            drafted = model.draft_ids[log_q.argmax(-1)]
            tv = 0.5 * ((q - p_full).abs().sum(-1) + (1 - p_full.sum(-1)).clamp_min(0))  # p_full's mass off-vocab
            valid[..., j] = rows
            alpha[rows_b, rows_t, j] = (1 - tv).clamp(0, 1)
            correct[rows_b, rows_t, j] = drafted == ids[rows_b, rows_t + 2 + j]
            greedy_match[rows_b, rows_t, j] = drafted == target_argmax[rows_b, rows_t + 1 + j]

    result = {
        "loss": sum(c.step_weight_decay**j * step_loss for j, step_loss in enumerate(step_losses)),
        "soft_ce": torch.stack(step_losses).mean().detach(),  # unweighted mean over steps
        "draft_vocab_coverage": (in_vocab & teaches).sum() / teaches.sum().clamp_min(1),
    }
    result.update(acceptance_metrics(valid, correct, greedy_match, alpha))
    return result


@torch.no_grad()
def acceptance_metrics(valid, correct, greedy_match, alpha) -> dict[str, torch.Tensor]:
    """The definitions of `block_losses`, per drafting round starting at index t (B, T, steps): accuracy
    per position over contiguous supervised prefixes; greedy accepted length (drafts kept while the draft's
    argmax equals the target's); at T=1, 1 + sum_k prod_{i<=k} (1 - TV(p_draft,i, p_target,i))."""
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
