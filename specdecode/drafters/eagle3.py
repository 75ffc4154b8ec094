"""EAGLE-3: one autoregressive decoder layer over fused target features, drafting chains or trees.

The target's outputs of a low, a middle and a high layer are concatenated and projected by `fc` (3H -> H)
into a hidden state h. One decoder layer reads h beside the embedding of the next token: its q/k/v take
[input_layernorm(embed(token)) ; hidden_norm(h)] (2H wide), its attention output joins the residual
stream of h (not of the concatenation), then a SiLU-gated MLP; a final norm and an LM head over a reduced
draft vocabulary give the next token. Drafting feeds the layer's own output hidden state and the token it
chose back in, so after the first step the drafter runs on its own features; training-time test (TTT,
`specdecode/training/eagle3_losses.py`) trains exactly that.

Draft vocabulary: the N most frequent answer tokens of the training data. `d2t[i]` is the offset of draft
id i (target id = i + d2t[i]) and `t2d` marks the target ids that are drafted; both are buffers, stored
in the checkpoint. The target's embedding is used frozen and never stored.

KV convention: entry t of the drafter's cache is built from the target's feature at position t and token
t + 1, at RoPE position t, so the entry of the last position whose features are known predicts the first
draft token. The layer's attention takes extra keys/values and an explicit boolean mask, which is how one
layer serves the TTT mask, chain drafting and tree drafting.
"""

from dataclasses import asdict, dataclass

import torch
from torch import nn

from specdecode.drafters.base import Drafter, Proposal, TargetFeatures, TreeProposal, TreeSettings
from specdecode.drafters.layers import DecoderBlock, Rotary
from specdecode.drafters.vocab import draft_ids_of, maps_agree, vocab_maps
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_layer_ids: list[int]  # low, middle, high (output-of-layer ids)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    ttt_steps: int = 7  # drafting steps unrolled in training
    step_weight_decay: float = 0.8  # step j's loss weight is decay**j
    num_anchors: int = 32  # indices per sequence unrolled and scored in training; 0 = all

    @property
    def kind(self) -> str:
        return "eagle3"

    def to_dict(self) -> dict:
        return asdict(self)


class Eagle3Layer(DecoderBlock):
    """A Llama block whose attention input is [normed token embedding ; normed hidden] (2H wide)."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__(c, attention_width=2 * c.hidden_size)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, hidden, embeds, positions, past_k, past_v, mask, rotary: Rotary):
        """hidden, embeds (B, Q, H) at positions (B, Q); past_k/past_v (B, kvh, P, d) or None; mask (B, 1, Q,
        P + Q) boolean (True: may attend) or None. Returns the output hidden (B, Q, H) and the new keys/values."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        k, v = self.keys_values(x, positions, rotary)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        return self.attend_and_mlp(hidden, self.queries(x, positions, rotary), keys, values, mask), k, v


class Eagle3Model(nn.Module):
    """Trainable weights of an EAGLE-3 drafter; the target's embedding and LM head are passed in, frozen."""

    def __init__(self, config: Eagle3Config, embedding: nn.Module, target_head: nn.Module, draft_ids: torch.Tensor):
        super().__init__()
        self.config = c = config
        if len(draft_ids) != c.draft_vocab_size:
            raise SpecDecodeError(f"{len(draft_ids)} draft token ids for a draft vocabulary of {c.draft_vocab_size}")
        self._frozen = (embedding.requires_grad_(False), target_head.requires_grad_(False))  # a tuple: not saved
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        d2t, t2d = vocab_maps(draft_ids.cpu(), c.vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft id."""
        return draft_ids_of(self.d2t)

    def vocab_maps_agree(self) -> bool:
        return maps_agree(self.d2t, self.t2d)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._frozen[0](ids).to(self.fc.weight.dtype)

    @property
    def target_head(self) -> nn.Module:
        return self._frozen[1]

    def fuse(self, layer_hidden: torch.Tensor) -> torch.Tensor:
        """Concatenated target layers (..., n*H) -> the step-0 hidden state (..., H)."""
        return self.fc(layer_hidden.to(self.fc.weight.dtype))

    def step(self, hidden, tokens, positions, past_k=None, past_v=None, mask=None):
        """One drafting step for hidden (B, Q, H) and target-id tokens (B, Q): output hidden and new K/V."""
        return self.midlayer(hidden, self.embed(tokens), positions, past_k, past_v, mask, self.rotary)

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output hidden (..., H) -> logits over the draft vocabulary (..., N)."""
        return self.lm_head(self.norm(out))


class Eagle3Drafter(Drafter):
    """Inference: the drafter's KV cache over committed positions grows each round; draft steps' K/V are
    dropped after proposing. Proposals are argmax tokens (q one-hot), so verification is exact at any
    temperature."""

    name = "eagle3"

    def __init__(self, model: Eagle3Model, fingerprint: str | None = None) -> None:
        self.model = model.eval()
        self.config = model.config
        self.fingerprint = fingerprint  # of the target the checkpoint was trained for, when loaded from one
        self.target_layer_ids = list(model.config.target_layer_ids)

    def check_target(self, target: Target) -> None:
        c = self.config
        if (target.vocab_size, target.config.hidden_size) != (c.vocab_size, c.hidden_size):
            raise SpecDecodeError(
                f"this EAGLE-3 drafter was built for vocabulary {c.vocab_size} and hidden size {c.hidden_size}, "
                f"not {target.name}'s {target.vocab_size} and {target.config.hidden_size}"
            )
        if self.fingerprint is not None and self.fingerprint != target.fingerprint():
            raise SpecDecodeError(f"this EAGLE-3 drafter was trained for another target than {target.name}")

    def begin(self, prompt_ids, params: SamplingParams, generator: torch.Generator, features) -> None:
        self.k: torch.Tensor | None = None  # (1, kvh, length, d)
        self.v: torch.Tensor | None = None
        self.length = 0  # cache entries = committed positions with features
        self.last_out: torch.Tensor | None = None  # (1, 1, H): output of the newest entry, predicts the next token
        if features is not None:
            self._append(prompt_ids, features)

    @torch.inference_mode()
    def _append(self, ids: list[int], features: TargetFeatures) -> None:
        """Cache entries for newly committed positions: feature t with token t + 1, causal over the cache."""
        n = min(features.layer_hidden.shape[0], len(ids) - 1 - self.length)
        if n <= 0:
            return
        device = self.model.fc.weight.device
        tokens = torch.tensor(ids[self.length + 1 : self.length + 1 + n], device=device)[None]
        positions = torch.arange(self.length, self.length + n, device=device)[None]
        mask = torch.ones(n, self.length + n, dtype=torch.bool, device=device).tril(self.length)[None, None]
        hidden = self.model.fuse(features.layer_hidden[:n].to(device))[None]
        out, k, v = self.model.step(hidden, tokens, positions, self.k, self.v, mask)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.last_out = out[:, -1:]
        self.length += n

    def _draft_step(self, hidden, tokens, depth: int, extra_k, extra_v, mask):
        """Run queries (hidden (Q, H), target-id tokens (Q,)) of draft depth `depth` (2 = the second draft
        token) against the cache plus `extra` draft K/V (1, kvh, R, d); mask (1, 1, Q, length + R + Q)."""
        past_k = self.k if extra_k is None else torch.cat([self.k, extra_k], dim=2)
        past_v = self.v if extra_v is None else torch.cat([self.v, extra_v], dim=2)
        positions = torch.full((1, len(tokens)), self.length + depth - 2, device=tokens.device)
        out, k, v = self.model.step(hidden[None], tokens[None], positions, past_k, past_v, mask)
        return out[0], k, v

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        return self.model.draft_logits(out).float().log_softmax(-1)

    @torch.inference_mode()
    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        """Greedy chain: each step feeds the previous step's output hidden and chosen token back in."""
        if max_tokens <= 0 or self.last_out is None:
            return Proposal(tokens=torch.empty(0, dtype=torch.long))
        draft_ids = self.model.draft_ids
        out = self.last_out[0]  # (1, H)
        tokens, extra_k, extra_v = [], None, None
        for depth in range(1, max_tokens + 1):
            if depth > 1:
                out, k, v = self._draft_step(out, tokens[-1], depth, extra_k, extra_v, None)
                extra_k = k if extra_k is None else torch.cat([extra_k, k], dim=2)
                extra_v = v if extra_v is None else torch.cat([extra_v, v], dim=2)
            tokens.append(draft_ids[self.model.draft_logits(out).argmax(-1)])
        return Proposal(tokens=torch.cat(tokens).cpu())

    @torch.inference_mode()
    def propose_tree(self, ids: list[int], settings: TreeSettings, max_depth: int) -> TreeProposal:
        """EAGLE-2's dynamic tree. Depth 1: the root's top-`branches` tokens. Each further step runs the
        frontier (the best `branches` nodes of the newest depth by cumulative log-probability) as one batch
        with a tree mask (each node sees the cache, its ancestors and itself) and scores the top `branches`
        children of every frontier node. The best `num_tokens` nodes overall are kept; a child never
        scores above its parent, so the kept set is a tree, listed in creation order (parents first)."""
        if min(settings.steps, settings.branches, settings.num_tokens) < 1:
            raise SpecDecodeError(f"tree settings must all be >= 1, got {settings}")
        depth_limit = min(settings.steps, max_depth)
        empty = torch.empty(0, dtype=torch.long)
        if depth_limit < 1 or self.last_out is None:
            return TreeProposal(tokens=empty, parents=empty)
        draft_ids = self.model.draft_ids
        branches = min(settings.branches, len(draft_ids))

        scores, children = self._log_probs(self.last_out[0])[0].topk(branches)
        tokens, parents, cumulative = draft_ids[children].tolist(), [-1] * branches, scores.tolist()
        frontier, frontier_hidden = list(range(branches)), self.last_out[0].expand(branches, -1)
        ran: list[int] = []  # nodes whose K/V are in extra_k/extra_v, in that order
        extra_k = extra_v = None
        for depth in range(2, depth_limit + 1):
            mask = self._tree_mask(frontier, ran, parents)
            node_tokens = torch.tensor([tokens[i] for i in frontier], device=draft_ids.device)
            out, k, v = self._draft_step(frontier_hidden, node_tokens, depth, extra_k, extra_v, mask)
            extra_k = k if extra_k is None else torch.cat([extra_k, k], dim=2)
            extra_v = v if extra_v is None else torch.cat([extra_v, v], dim=2)
            ran += frontier
            scores, children = self._log_probs(out).topk(branches, dim=-1)  # (Q, branches)
            path = torch.tensor([cumulative[i] for i in frontier], dtype=torch.float64)[:, None]
            candidate_scores = (path + scores.double().cpu()).flatten()
            first = len(tokens)
            tokens += draft_ids[children].flatten().tolist()
            parents += [node for node in frontier for _ in range(branches)]
            cumulative += candidate_scores.tolist()
            best = candidate_scores.topk(min(branches, len(candidate_scores))).indices
            frontier = [first + int(i) for i in best]
            frontier_hidden = out[best.to(out.device) // branches]

        ranked = sorted(range(len(tokens)), key=lambda i: (-cumulative[i], i))  # ties: the parent first
        kept = sorted(ranked[: settings.num_tokens])
        index = {node: i for i, node in enumerate(kept)}
        return TreeProposal(
            tokens=torch.tensor([tokens[i] for i in kept], dtype=torch.long),
            parents=torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in kept], dtype=torch.long),
        )

    def _tree_mask(self, frontier: list[int], ran: list[int], parents: list[int]) -> torch.Tensor:
        """(1, 1, Q, length + R + Q): every frontier node sees the cache, the ran nodes among its ancestors
        and itself."""
        q = len(frontier)
        ancestors = torch.zeros(q, len(ran), dtype=torch.bool)
        column = {node: j for j, node in enumerate(ran)}
        for row, node in enumerate(frontier):
            parent = parents[node]
            while parent >= 0:
                ancestors[row, column[parent]] = True
                parent = parents[parent]
        mask = torch.cat([torch.ones(q, self.length, dtype=torch.bool), ancestors, torch.eye(q, dtype=torch.bool)], 1)
        return mask[None, None].to(self.model.fc.weight.device)

    def observe(self, ids: list[int], num_accepted: int, features: TargetFeatures | None) -> None:
        if features is not None and features.layer_hidden is not None:
            self._append(ids, features)
