"""DSpark (and DFlash, the same model with two parts switched off): a block drafter over target features.

Parallel stage (the DFlash backbone): a few Qwen3-style decoder layers (q/k heads RMS-normed, as the
engines' drafters have them) read a block [anchor, MASK x (B-1)] at its true positions. Every layer attends
bidirectionally inside the block and to the committed context, whose target features (several layers'
outputs, concatenated, projected by one linear layer and RMS-normed) enter as extra keys and values
through that layer's own k/v projections. Two layouts (`sample_from_anchor`): DSpark's (also DeepSpec's
DFlash baseline) makes the anchor the first prediction position, so B inputs give B draft logits, slot k
predicting x_{a+k+1}; the original DFlash (z-lab, and vLLM's `dflash` method) predicts only the B-1 mask
slots, each the token at its own position, which are the same labels one slot later. The target's
embedding is used frozen and shared, never stored; so is its LM head, unless the drafter has a reduced
draft vocabulary (`draft_vocab_size` N > 0, `drafters/vocab.py`): then an own LM head over the N most
frequent answer tokens (started from the target's rows) gives the draft logits, and the Markov bias covers
the same N tokens, as vLLM's DSpark drafter has it.

Sequential stage (DSpark only): a Markov head adds a low-rank bias from the previous draft token,
B(x_{k-1}) = W2(W1[x_{k-1}]), and sampling runs left to right; the corrected distribution is the q that
verification uses, so acceptance stays exact. A confidence head c_k = sigmoid(w . [h_k ; W1[x_{k-1}]])
estimates P(token k survives | its prefix survived) for the scheduler.

Mask token: SmolLM2 uses every row of its embedding, so there is no spare id to borrow; the mask input is
a learned embedding vector (`mask_embedding`). A target with a spare row can name it in `mask_token_id`.
"""

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from specdecode.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal, TargetFeatures
from specdecode.drafters.block_kernels import BlockKernels
from specdecode.drafters.context_pool import ContextPool
from specdecode.drafters.layers import DecoderBlock, Rotary
from specdecode.drafters.vocab import draft_ids_of, maps_agree, vocab_maps
from specdecode.errors import SpecDecodeError
from specdecode.models.llama import KVCache
from specdecode.sampling import SamplingParams, probabilities, sample


@dataclass
class DSparkConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    num_layers: int = 2
    block_size: int = 7  # B: inputs per round = anchor + (B - 1) masks
    sample_from_anchor: bool = True  # B drafts (anchor predicts); False: B - 1 drafts (the mask slots)
    qk_norm: bool = True  # checkpoints made before it existed load with False
    mask_token_id: int | None = None  # None: a learned mask embedding
    markov_rank: int = 64  # 0 switches the sequential stage off (DFlash)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn
    confidence_head: bool = True
    num_anchors: int = 32  # blocks trained per sequence
    loss_decay: float = 4.0  # position weight exp(-(k-1)/decay)
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    calibration_temperatures: list[float] = field(default_factory=list)  # per position, from STS
    calibration_biases: list[float] = field(default_factory=list)  # per position, from STS; [] = 0
    # fit on greedy rounds: at T = 0 the target keeps more of the same drafts (2.38 a round on GSM8K against
    # 1.85 at T = 1), and the sampled map made the prefix scheduler verify too few; [] = the map above
    greedy_calibration_temperatures: list[float] = field(default_factory=list)
    greedy_calibration_biases: list[float] = field(default_factory=list)
    draft_vocab_size: int = 0  # 0: the target's whole vocabulary through its shared LM head

    @property
    def draft_vocab(self) -> int:
        """Tokens the drafter can propose: its draft vocabulary, or the target's whole one."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def kind(self) -> str:
        return "dspark" if self.markov_rank > 0 else "dflash"

    @property
    def draft_length(self) -> int:
        """Draft tokens per round (gamma)."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def to_dict(self) -> dict:
        return asdict(self)

    def clear_calibration(self) -> None:
        """Raw confidences: no STS map for either decoding (before recording rounds, or training on)."""
        self.calibration_temperatures, self.calibration_biases = [], []
        self.greedy_calibration_temperatures, self.greedy_calibration_biases = [], []

    def calibration(self, greedy: bool) -> tuple[list[float], list[float]]:
        """The STS map (temperatures, biases) for greedy or sampled decoding."""
        if greedy and self.greedy_calibration_temperatures:
            return self.greedy_calibration_temperatures, self.greedy_calibration_biases
        return self.calibration_temperatures, self.calibration_biases


class DraftLayer(DecoderBlock):
    """A pre-norm Llama-style block whose attention also sees the context's keys and values."""

    def forward(self, x, positions, ctx_k, ctx_v, rotary: Rotary, mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, Q, H) block tokens at `positions` (B, Q); ctx_k/ctx_v (B, kvh, T, d); mask (B, 1, Q, T+Q)."""
        normed = self.input_layernorm(x)
        k, v = self.keys_values(normed, positions, rotary)
        keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        return self.attend_and_mlp(x, self.queries(normed, positions, rotary), keys, values, mask)


class MarkovHead(nn.Module):
    """The sequential stage: a bias on position k's logits from the token drawn at k-1."""

    def __init__(self, c: DSparkConfig) -> None:
        super().__init__()
        self.kind, r = c.markov_head_type, c.markov_rank
        if self.kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"unknown Markov head type {self.kind!r}")
        self.w1 = nn.Embedding(c.vocab_size, r)
        self.w2 = nn.Linear(r, c.draft_vocab, bias=False)
        nn.init.zeros_(self.w2.weight)  # start as plain DFlash
        if self.kind == "gated":
            self.gate = nn.Linear(c.hidden_size + r, r)
        if self.kind == "rnn":
            self.cell = nn.Linear(2 * r + c.hidden_size, 3 * r)
        self.rank = r

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """h (..., H), prev (...) -> (bias (..., V), prev embedding (..., r), new state)."""
        e = self.w1(prev)
        if self.kind == "vanilla":
            return self.w2(e), e, state
        if self.kind == "gated":
            return self.w2(torch.sigmoid(self.gate(torch.cat([h, e], -1))) * e), e, state
        s = torch.zeros_like(e) if state is None else state
        g, cand, out = self.cell(torch.cat([s, e, h], -1)).chunk(3, dim=-1)
        s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(cand)
        return self.w2(torch.tanh(out)), e, s


class DSparkModel(nn.Module):
    """Trainable weights of a DSpark/DFlash drafter; the target's embedding and LM head are passed in.

    With a reduced draft vocabulary, `draft_ids` are its sorted target ids (None: placeholders that a
    checkpoint's d2t/t2d replace)."""

    def __init__(
        self, config: DSparkConfig, embedding: nn.Module, lm_head: nn.Module, draft_ids: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.config = c = config
        self._frozen = (embedding.requires_grad_(False), lm_head.requires_grad_(False))  # a tuple: not saved
        if c.draft_vocab_size:
            ids = torch.arange(c.draft_vocab_size) if draft_ids is None else draft_ids.cpu()
            if len(ids) != c.draft_vocab_size:
                raise SpecDecodeError(f"{len(ids)} draft token ids for a draft vocabulary of {c.draft_vocab_size}")
            d2t, t2d = vocab_maps(ids, c.vocab_size)
            self.register_buffer("d2t", d2t)
            self.register_buffer("t2d", t2d)
            self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        n_features = len(c.target_layer_ids) * c.hidden_size
        self.fc = nn.Linear(n_features, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c, qk_norm=c.qk_norm) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        if c.mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.randn(c.hidden_size) * 0.02)
        self.markov = MarkovHead(c) if c.markov_rank > 0 else None
        if c.confidence_head:
            self.confidence = nn.Linear(c.hidden_size + c.markov_rank, 1)

    # ------------------------------------------------------------------ shared pieces
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._frozen[0](ids)

    @property
    def target_head(self) -> nn.Module:
        return self._frozen[1]

    def target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's logits over its whole vocabulary from its final-normed hidden states."""
        return self.target_head(h)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Backbone states (..., H) -> logits over the draft vocabulary (..., N)."""
        return self.lm_head(h) if self.config.draft_vocab_size else self.target_logits(h)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """Target id of every draft id; None when the drafter drafts from the whole vocabulary."""
        return draft_ids_of(self.d2t) if self.config.draft_vocab_size else None

    def to_target(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Draft ids -> target ids."""
        return draft_tokens if self.config.draft_vocab_size == 0 else draft_tokens + self.d2t[draft_tokens]

    def vocab_maps_agree(self) -> bool:
        return self.config.draft_vocab_size == 0 or maps_agree(self.d2t, self.t2d)

    def mask_input(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.config.mask_token_id is not None:
            return self.embed(torch.full(shape, self.config.mask_token_id, dtype=torch.long))
        return self.mask_embedding.expand(*shape, -1)

    def context(self, layer_hidden: torch.Tensor) -> torch.Tensor:
        """Target features (..., n*H) -> one context vector per committed token."""
        return self.hidden_norm(self.fc(layer_hidden))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values of context vectors (B, T, H) at positions (B, T)."""
        return [layer.keys_values(context, positions, self.rotary) for layer in self.layers]

    def backbone(self, block_inputs, block_positions, context_kv, mask) -> torch.Tensor:
        """The parallel stage: final-normed hidden states of the block tokens (B, Q, H)."""
        x = block_inputs
        for layer, (ctx_k, ctx_v) in zip(self.layers, context_kv, strict=True):
            x = layer(x, block_positions, ctx_k, ctx_v, self.rotary, mask)
        return self.norm(x)

    def prediction_states(self, h: torch.Tensor) -> torch.Tensor:
        """The backbone states (..., B, H) of the slots that predict: all, or the mask slots only."""
        return h if self.config.sample_from_anchor else h[..., 1:, :]

    def sequential(self, h: torch.Tensor, base_logits: torch.Tensor, prev: torch.Tensor, choose=None):
        """Left to right over the block: corrected logits, confidence logits and the tokens fed forward.

        h (..., G, H), base_logits (..., G, N) over the draft vocabulary, prev (...) the anchor. Teacher
        forcing passes the labels as `choose` (a tensor (..., G) of target ids); inference passes a function
        draft logits -> target id.
        """
        logits, embedded, tokens, state = [], [], [], None
        for k in range(h.shape[-2]):
            step_logits = base_logits[..., k, :]
            if self.markov is not None:
                bias, e, state = self.markov.step(h[..., k, :], prev, state)
                step_logits = step_logits + bias
                embedded.append(e)
            token = choose[..., k] if isinstance(choose, torch.Tensor) else choose(step_logits)
            logits.append(step_logits)
            tokens.append(token)
            prev = token
        conf = self.confidence_logits(h, torch.stack(embedded, -2) if embedded else None)
        return torch.stack(logits, -2), conf, torch.stack(tokens, -1)

    def confidence_logits(self, h: torch.Tensor, embedded: torch.Tensor | None) -> torch.Tensor | None:
        """The confidence head's logits (..., G) from the states h (..., G, H) and the Markov embeddings of the
        tokens fed forward (..., G, r); None without the head. Nothing feeds back from it: one product a block."""
        if not self.config.confidence_head:
            return None
        return self.confidence(h if embedded is None else torch.cat([h, embedded], -1)).squeeze(-1)


def calibrated_confidence(
    logits: torch.Tensor, temperatures: list[float] | torch.Tensor, biases: list[float] | torch.Tensor = ()
) -> torch.Tensor:
    """c_k = sigmoid(z_k / T_k + b_k) over the last dimension (the first len(z) positions of the map);
    an empty list of temperatures or biases means T = 1 or b = 0 (an uncalibrated drafter)."""
    n, dtype = logits.shape[-1], logits.dtype
    t = torch.as_tensor(temperatures, dtype=dtype)[:n] if len(temperatures) else torch.ones(n, dtype=dtype)
    b = torch.as_tensor(biases, dtype=dtype)[:n] if len(biases) else torch.zeros(n, dtype=dtype)
    return torch.sigmoid(logits / t + b)


class BlockDrafter(Drafter):
    """Inference with a DSpark/DFlash model: the projected context K/V is cached and grows each round;
    the block's own K/V is never kept. Committed positions' target features wait until the next draft and
    are then projected in one product (for every drafting request at once): rounds that go without drafting
    (the gate, or a scheduler that verifies nothing) cost the drafter nothing. The copies of one drafter (a
    request each) keep their contexts in one `ContextPool`, a slot each, which a batched round reads in place."""

    def __init__(self, model: DSparkModel) -> None:
        self.model = model.eval()
        self.config = model.config
        self.name = model.config.kind
        self.target_layer_ids = list(model.config.target_layer_ids)
        self.kernels = BlockKernels.of(model)  # inference on the C++ kernels, where they run (block_kernels.py)
        dtype = None if self.kernels is None else self.kernels.cache_dtype
        self.pool = ContextPool(self.config.num_layers, self.config.num_kv_heads, self.config.head_dim, dtype)
        self.slot: int | None = None  # this request's slot of the pool (a copy takes its own in `begin`)

    @property
    def has_confidences(self) -> bool:
        return self.config.confidence_head

    def begin(self, prompt_ids, params: SamplingParams, generator: torch.Generator, features) -> None:
        self.params, self.generator = params, generator
        if not self.pool.owns(self, self.slot):
            self.slot = self.pool.acquire(self)
        self.length = 0  # the slot's context entries 0 .. length - 1 hold every layer's keys and values
        self.pending: list[torch.Tensor] = [] if features is None else [features.layer_hidden]

    @classmethod
    @torch.inference_mode()
    def _project_pending(cls, drafters: list["BlockDrafter"]) -> None:
        """Project the pending target features of every drafter into its layers' context K/V: one product
        over all their rows (each row's projection is its own), each drafter's slice stored in its cache."""
        waiting = [d for d in drafters if d.pending]
        if not waiting:
            return
        model, kernels = waiting[0].model, waiting[0].kernels
        rows = [torch.cat(d.pending) for d in waiting]
        features, counts = torch.cat(rows), [len(r) for r in rows]
        room = max(d.length + n + d.config.block_size for d, n in zip(waiting, counts, strict=True))
        cache = waiting[0].pool.reserve(room, features)  # each context and the next block after it
        slots, starts = [d.slot for d in waiting], [d.length for d in waiting]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        if kernels is None or not kernels.project(features, positions, cache, slots, starts, counts):
            context_kv = model.context_kv if kernels is None else kernels.context_kv
            new = context_kv(model.context(features[None]), positions[None])
            first = 0
            for d, n in zip(waiting, counts, strict=True):
                for layer, (k, v) in enumerate(new):
                    cache.keys[layer, d.slot, :, d.length : d.length + n] = k[0, :, first : first + n]
                    cache.values[layer, d.slot, :, d.length : d.length + n] = v[0, :, first : first + n]
                first += n
        for d, n in zip(waiting, counts, strict=True):
            d.length += n
            d.pending = []

    def end(self, ids: list[int]) -> None:
        if self.pool.owns(self, self.slot):
            self.pool.release(self.slot)
        self.slot = None

    @property
    def _samples(self) -> bool:
        """DSpark samples its drafts from q at temperature > 0; DFlash's positions are marginals: argmax only."""
        return self.config.kind == "dspark" and not self.params.greedy

    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        return self.propose_batch([self], [ids], [max_tokens])[0]

    @classmethod
    @torch.inference_mode()
    def propose_batch(cls, drafters: list[Drafter], ids: list[list[int]], max_tokens: list[int]) -> list[Proposal]:
        """One backbone pass, one LM head product and one Markov stage for every request's block: the weights
        (the LM head alone is the size of the target's embedding) are read once per round, not once per request.
        Contexts of different lengths are right-padded and masked out."""
        proposals = [EMPTY_PROPOSAL] * len(drafters)
        drafting = [r for r, d in enumerate(drafters) if max_tokens[r] > 0]
        cls._project_pending([drafters[r] for r in drafting])
        rows = [r for r in drafting if drafters[r].length > 0]
        if not rows:
            return proposals
        first = drafters[rows[0]]
        model, c = first.model, first.config
        g = c.block_size
        anchors = torch.tensor([ids[r][-1] for r in rows])
        inputs = torch.cat([model.embed(anchors)[:, None], model.mask_input((len(rows), g - 1))], dim=1)
        positions = torch.stack([torch.arange(len(ids[r]) - 1, len(ids[r]) - 1 + g) for r in rows])
        cache, slots, starts = _pool_slots([drafters[r] for r in rows])
        kernels = first.kernels
        if kernels is not None and kernels.loop_kernel(len(rows) * g):
            h = kernels.backbone(inputs, positions, cache, slots, starts)
        else:
            h = model.backbone(inputs, positions, *_context_and_mask(cache, slots, starts, g, inputs.dtype))
        h = model.prediction_states(h)

        drawn_from: dict[int, list[torch.Tensor]] = {r: [] for r in rows}  # q of each sampled draft

        def choose(logits: torch.Tensor) -> torch.Tensor:
            tokens = logits.argmax(-1)
            for i, r in enumerate(rows):
                if drafters[r]._samples:
                    drawn_from[r].append(probabilities(logits[i], drafters[r].params))
                    tokens[i] = sample(drawn_from[r][-1], drafters[r].generator)
            return model.to_target(tokens)

        if kernels is not None and kernels.chains_for([drafters[r].params for r in rows]):
            temperatures = [drafters[r].params.temperature if drafters[r]._samples else 0.0 for r in rows]
            generators = [drafters[r].generator for r in rows]
            conf, tokens, q = kernels.chain(model, h, model.draft_logits(h), anchors, temperatures, generators)
            sampled = {r: q[i] for i, r in enumerate(rows) if drafters[r]._samples}
        else:
            _, conf, tokens = model.sequential(h, model.draft_logits(h), anchors, choose=choose)
            sampled = {r: torch.stack(q) for r, q in drawn_from.items() if q}
        support = model.draft_ids if sampled else None  # q stays over the draft vocabulary (None: the whole)
        for i, r in enumerate(rows):
            d, n = drafters[r], max_tokens[r]
            confidences = None if conf is None else calibrated_confidence(conf[i, :n], *c.calibration(d.params.greedy))
            probs = sampled[r][:n] if d._samples else None
            proposals[r] = Proposal(
                tokens=tokens[i, :n], probs=probs, confidences=confidences, support=None if probs is None else support
            )
        return proposals

    def observe(self, ids: list[int], num_accepted: int, features: TargetFeatures | None) -> None:
        self.pending.append(features.layer_hidden)


def _pool_slots(drafters: list[BlockDrafter]) -> tuple[KVCache, list[int], list[int]]:
    """The pool's cache holding these requests' contexts, their slots and their lengths. Each has room for the
    block after it: `_project_pending` reserved it when it last set the request's length."""
    pool = drafters[0].pool
    if any(d.pool is not pool for d in drafters):
        raise SpecDecodeError("requests drafted in one batch must be copies of one drafter (one context pool)")
    return pool.cache, [d.slot for d in drafters], [d.length for d in drafters]


def _context_and_mask(cache: KVCache, slots: list[int], lengths: list[int], block_size: int, dtype: torch.dtype):
    """Every layer's context K/V (R, kvh, longest, d) of these slots for the Python backbone, in the block's
    `dtype` (the pool may hold bfloat16 beside float32 queries), and the attention mask (R, 1, block, longest +
    block) that hides the padding (None for a single request)."""
    longest = max(lengths)
    index = torch.tensor(slots)
    kv = [
        (keys[index, :, :longest].to(dtype), values[index, :, :longest].to(dtype))
        for keys, values in zip(cache.keys, cache.values, strict=True)
    ]
    if len(lengths) == 1:
        return kv, None
    context = torch.arange(longest)[None] < torch.tensor(lengths)[:, None]
    mask = torch.cat([context, torch.ones(len(lengths), block_size, dtype=torch.bool)], dim=1)
    return kv, mask[:, None, None, :].expand(-1, 1, block_size, -1)
