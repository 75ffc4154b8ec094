"""The runner's own forward for the Llama family (Llama, Mistral, Qwen2, Qwen3), read like gpt-fast's model.py.

Why not the Hugging Face forward: a 135M model's step is a few milliseconds of weight streaming, and HF's
modelling code, mask building and `DynamicCache` add hundreds of small ops and allocations on top (on one
2-core CPU: 87 ms a step where the weights need ~10 ms). Here a pass is the layers' math and nothing else:
- weights taken from the loaded HF model, q/k/v and gate/up fused into one matrix each (the HF modules are
  repointed at views of the fused tensors, so memory is not doubled and the HF model stays the reference);
- a preallocated KV cache of slots (one request = one slot); rollback is a length, a tree's accepted path
  one index copy over all layers at once;
- every pass is rows of new tokens (`Rows`): one request's chain, a tree with its mask, or a batch of
  requests with their own positions; hidden states of chosen layers are kept as the loop passes them.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode.models.linear import (
    EIGHT_BIT_INPUTS,
    ROW_BUCKETS,
    Linear,
    cpu_kernels_available,
    kernel_weights_on_huge_pages,
    plan_kernels,
    plans_eight_bit_inputs,
    rounded_cache_dtype,
)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(config) -> str | None:
    """Why this runner cannot run a model of `config`, or None when it can."""
    if config.model_type not in SUPPORTED_TYPES:
        return f"model type {config.model_type}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        return f"sliding-window attention ({window} tokens)"
    return None


class KVCache:
    """Keys and values of every layer: (layers, slots, kv_heads, capacity, head_dim), allocated up front.

    A slot holds one request; which entries are valid is the caller's business (a length per slot), so a
    rollback writes nothing. Zeros, not empty: a padded query of a batched pass may read stale entries,
    which must be finite.
    """

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, capacity: int, dtype, device) -> None:
        shape = (layers, slots, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    def grow(self, capacity: int, slots: int | None = None) -> None:
        """Reallocate to hold `capacity` entries per slot (and `slots` slots), keeping what is there (rare:
        they double)."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], slots or old.shape[1], old.shape[2], capacity, old.shape[4])
            new[:, : old.shape[1], :, : old.shape[3]] = old
            setattr(self, name, new)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, rows: "Rows") -> None:
        """Store a pass's new keys and values (R, kv_heads, Q, head_dim) where `rows` says, rounded to the
        cache's dtype."""
        layer_keys, layer_values = self.keys[layer], self.values[layer]
        keys, values = keys.to(layer_keys.dtype), values.to(layer_values.dtype)
        if len(rows.slots) == 1:
            slot, start = rows.slots[0], rows.starts[0]
            layer_keys[slot, :, start : start + keys.shape[2]] = keys[0]
            layer_values[slot, :, start : start + keys.shape[2]] = values[0]
        elif rows.real is None:
            layer_keys[rows.write_slot, :, rows.write_entry] = keys.transpose(1, 2).flatten(0, 1)
            layer_values[rows.write_slot, :, rows.write_entry] = values.transpose(1, 2).flatten(0, 1)
        else:
            layer_keys[rows.write_slot, :, rows.write_entry] = keys.transpose(1, 2)[rows.real]
            layer_values[rows.write_slot, :, rows.write_entry] = values.transpose(1, 2)[rows.real]

    def read(self, layer: int, rows: "Rows") -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's entries 0 .. kv_length - 1 of this layer: (R, kv_heads, kv_length, head_dim); a view
        when the rows' slots are adjacent, else a gather (a copy of those slots)."""
        layer_keys, layer_values = self.keys[layer], self.values[layer]
        if rows.adjacent:
            first = rows.slots[0]
            picked = slice(first, first + len(rows.slots))
            return layer_keys[picked, :, : rows.kv_length], layer_values[picked, :, : rows.kv_length]
        return layer_keys[rows.slot_index, :, : rows.kv_length], layer_values[rows.slot_index, :, : rows.kv_length]

    def copy_entries(self, source: int, dest: int, start: int, end: int) -> None:
        """Copy slot `source`'s entries start .. end - 1 to the same places of slot `dest`, in every layer."""
        for buffer in (self.keys, self.values):
            buffer[:, dest, :, start:end] = buffer[:, source, :, start:end]

    def move(self, slot: int, source: torch.Tensor, dest: int) -> None:
        """Copy entries `source` of `slot` to `dest`, `dest + 1`, ... in every layer (a tree's accepted path)."""
        for buffer in (self.keys, self.values):
            buffer[:, slot, :, dest : dest + len(source)] = buffer[:, slot].index_select(2, source)


@dataclass
class Rows:
    """Where a pass's queries go: R rows of Q new tokens, row r in cache slot `slots[r]`.

    Row r's query i is written at cache entry `starts[r] + i` (if i < counts[r]; the rest is padding),
    rotated as position `positions[r, i]` (a tree node: its root's position plus its depth), and attends to
    entries 0 .. kv_length - 1 of its slot where `mask` allows (None: all of them). Chains and batches of
    chains also say it as `limits`: query i of row r sees entries 0 .. limits[r, i] - 1. A tree says it as
    `limits` and `paths`: query i sees the row's first starts[r] entries, then its ancestors and itself,
    entries paths[r, i, 0 .. limits[r, i] - starts[r] - 1], root first (a mask that is no tree: None).
    """

    slots: list[int]
    starts: list[int]
    counts: list[int]
    positions: torch.Tensor  # (R, Q) long
    mask: torch.Tensor | None  # (R, 1, Q, kv_length) bool, True = may attend
    kv_length: int
    limits: torch.Tensor | None = None  # (R, Q) long: the causal mask as entry counts
    paths: torch.Tensor | None = None  # (R, Q, depth + 1) long: a tree's ancestor entries per query

    def __post_init__(self) -> None:
        """Only what every pass reads; the index tensors of the Python path's cache writes are made when asked
        for (a pass through the C++ loop never asks: building them took ~0.2 ms of a 10 ms one-token pass)."""
        R, Q = self.positions.shape
        first = self.slots[0]
        self.adjacent = self.slots == list(range(first, first + R))  # read a view of the slots, not a gather
        self.slot_index = torch.tensor(self.slots)
        self.real = None  # which queries are written (None: all)
        if any(count < Q for count in self.counts):
            self.real = torch.arange(Q)[None] < torch.tensor(self.counts)[:, None]
            if self.limits is not None:
                self.limits = self.limits * self.real  # a padded query sees nothing: the C++ attention skips it

    @functools.cached_property
    def start_index(self) -> torch.Tensor:
        return torch.tensor(self.starts, device=self.slot_index.device)

    @functools.cached_property
    def write_slot(self) -> torch.Tensor:
        """The slot of every written query, row after row."""
        return self.pack(self.slot_index[:, None].expand(self.positions.shape))

    @functools.cached_property
    def write_entry(self) -> torch.Tensor:
        """The cache entry of every written query, row after row."""
        return self.pack(
            self.start_index[:, None] + torch.arange(self.positions.shape[1], device=self.start_index.device)
        )

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        """(R, Q, ...) per query -> (N, ...) for the N real queries, row after row."""
        return values.flatten(0, 1) if self.real is None else values[self.real]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, ...) for the real queries -> (R, Q, ...), padded queries zero."""
        R, Q = self.positions.shape
        if self.real is None:
            return packed.view(R, Q, *packed.shape[1:])
        padded = packed.new_zeros(R, Q, *packed.shape[1:])
        padded[self.real] = packed
        return padded

    def grouped_limits(self, group: int) -> torch.Tensor:
        """`limits` for `group` query heads per kv head, query (g, i) seeing what position i sees; built once
        per pass, not once per layer."""
        if getattr(self, "_grouped", None) is None or self._grouped[0] != group:
            paths = None if self.paths is None else self.paths.repeat(1, group, 1)
            self._grouped = (group, self.limits.repeat(1, group), paths)
        return self._grouped[1]

    def grouped_paths(self, group: int) -> torch.Tensor | None:
        """`paths` for `group` query heads per kv head, as `grouped_limits`."""
        self.grouped_limits(group)
        return self._grouped[2]

    def to(self, device: torch.device) -> "Rows":
        """The same rows with their index tensors on `device` (a no-op on the CPU)."""
        for name in (
            *("positions", "mask", "limits", "paths"),
            *("slot_index", "start_index", "real", "write_slot", "write_entry"),
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        return self

    @classmethod
    def chain(cls, slot: int, start: int, count: int) -> "Rows":
        """One request's `count` tokens after `start` cached ones, causal."""
        positions = torch.arange(start, start + count)
        mask = None if count == 1 else (torch.arange(start + count)[None] <= positions[:, None])[None, None]
        return cls([slot], [start], [count], positions[None], mask, start + count, positions[None] + 1)

    @classmethod
    def tree(cls, slot: int, start: int, positions: torch.Tensor, mask: torch.Tensor) -> "Rows":
        """One request's tree pass: nodes written at start, start + 1, ..., with their depths' positions."""
        count = positions.shape[-1]
        mask = mask.view(1, 1, count, -1)
        limits, paths = _tree_paths(start, positions.view(count), mask[0, 0])
        return cls([slot], [start], [count], positions.view(1, count), mask, start + count, limits, paths)

    @classmethod
    def batch(cls, slots: list[int], starts: list[int], counts: list[int]) -> "Rows":
        """Several requests, row r's tokens after its own `starts[r]` cached ones, padded to the longest row."""
        width = max(counts)
        positions = torch.tensor(starts)[:, None] + torch.arange(width)
        kv_length = max(s + c for s, c in zip(starts, counts, strict=True))
        mask = torch.arange(kv_length)[None, None] <= positions[:, :, None]
        return cls(list(slots), list(starts), list(counts), positions, mask[:, None], kv_length, positions + 1)


def _tree_paths(start: int, positions: torch.Tensor, mask: torch.Tensor) -> tuple:
    """A tree mask (Q, start + Q) as limits (1, Q) and paths (1, Q, depth + 1): each node sees the whole prefix
    and depth + 1 nodes, its ancestors and itself, written in depth order (parents precede children). Any
    other mask: (None, None), and the pass attends through SDPA."""
    depth = positions - start
    if not bool(mask[:, :start].all()) or not torch.equal(mask[:, start:].sum(1), depth + 1):
        return None, None
    width = int(depth.max()) + 1
    order = torch.arange(start, mask.shape[1]).expand_as(mask[:, start:])
    seen = torch.where(mask[:, start:], order, mask.shape[1])  # a node's visible entries, then past-the-end
    paths = seen.sort(dim=1).values[:, :width].clamp(max=mask.shape[1] - 1)
    return (positions + 1)[None], paths[None]


@dataclass
class Output:
    """What a pass returns, every tensor with its row dimension: (R, Q, ...)."""

    logits: torch.Tensor | None
    layer_hidden: torch.Tensor | None  # captured layers, concatenated in the order asked for
    last_hidden: torch.Tensor  # after the final norm


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None  # Qwen3 normalises each head's q and k before rotating them
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear

    def loop_weights(self, kernel: str) -> tuple[torch.Tensor, ...]:
        """The weights in the order the C++ layer loop takes them, as the few-rows `kernel` reads them."""
        return (
            self.input_norm,
            self.qkv.few_rows_weight(kernel),
            self.o.few_rows_weight(kernel),
            self.post_norm,
            self.gate_up.few_rows_weight(kernel),
            self.down.few_rows_weight(kernel),
        )


def _fuse(modules: list[torch.nn.Linear], blocks: list[torch.Tensor | None]) -> Linear:
    """One matrix for several projections of the same input; the HF modules are repointed at its rows. Their
    GGUF rows (`blocks`, None where unknown) are joined the same way where every projection has them."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    first = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[first : first + rows], requires_grad=False)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[first : first + rows], requires_grad=False)
        first += rows
    return Linear(weight, bias, None if None in blocks else torch.cat(blocks))


class LlamaRunner:
    """The forward of a loaded HF Llama-family model over `Rows` of new tokens with a `KVCache`."""

    def __init__(self, hf_model, kernel: str = "auto", gguf_rows: dict[str, torch.Tensor] | None = None) -> None:
        c = hf_model.config
        self.config = c
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        inner = hf_model.model
        self.embedding = inner.embed_tokens.weight
        weights, device = self.embedding.dtype, self.embedding.device
        # the C++ norm, rotation and few-rows linear (csrc/runner_kernels.cpp) compute in float32 from float32
        # or bfloat16 weights; elsewhere the stock ops compute in the weights' dtype
        self.fused = device.type == "cpu" and weights in (torch.float32, torch.bfloat16) and cpu_kernels_available()
        self.dtype = torch.float32 if self.fused else weights  # of activations

        def vector(weight: torch.Tensor | None) -> torch.Tensor | None:  # a norm's weight, in the compute dtype
            return None if weight is None else weight.detach().to(self.dtype)

        self.layers = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp

            def rows(module: str, i: int = i) -> torch.Tensor | None:  # its GGUF rows (models/gguf_rows.py)
                return (gguf_rows or {}).get(f"model.layers.{i}.{module}.weight")

            q_norm = getattr(attn, "q_norm", None)
            self.layers.append(
                _Layer(
                    input_norm=vector(layer.input_layernorm.weight),
                    qkv=_fuse(
                        [attn.q_proj, attn.k_proj, attn.v_proj],
                        [rows("self_attn.q_proj"), rows("self_attn.k_proj"), rows("self_attn.v_proj")],
                    ),
                    q_norm=vector(None if q_norm is None else q_norm.weight),
                    k_norm=vector(None if q_norm is None else attn.k_norm.weight),
                    o=Linear(attn.o_proj.weight.detach(), attn.o_proj.bias, rows("self_attn.o_proj")),
                    post_norm=vector(layer.post_attention_layernorm.weight),
                    gate_up=_fuse([mlp.gate_proj, mlp.up_proj], [rows("mlp.gate_proj"), rows("mlp.up_proj")]),
                    down=Linear(mlp.down_proj.weight.detach(), mlp.down_proj.bias, rows("mlp.down_proj")),
                )
            )
        self.norm = vector(inner.norm.weight)
        head = hf_model.get_output_embeddings()
        self.lm_head = Linear(head.weight.detach(), head.bias, (gguf_rows or {}).get("lm_head.weight"))
        self.rotary = inner.rotary_emb  # HF's own inverse frequencies and scaling: every rope type is covered
        self._rope_table(c.max_position_embeddings)
        signature = {"model": c.model_type, "hidden": c.hidden_size, "layers": len(self.layers), "dtype": str(weights)}
        # exact: a verify pass computes bit for bit what one-token steps compute (models/linear.py)
        self.kernel_plan = plan_kernels(self.linears(), kernel, signature, exact=True) if device.type == "cpu" else {}
        # the KV cache holds what the weights hold: bfloat16 entries halve what a long or batched step reads
        # (64 requests of 512 tokens: 1.1 GB a step in float32, against 270 MB of weights); every reader (the
        # C++ attention, SDPA for other masks) widens the same rounded entries, so verify = steps still holds.
        # bfloat16 entries too where the linears take 8-bit inputs (a rounding of bfloat16's class already) and
        # the CPU reads bfloat16 natively: 64 requests at 1,024 tokens read 3 GB of float32 entries a step
        self.cache_dtype = rounded_cache_dtype(self.linears()) or weights
        # the C++ layer loop (csrc/decoder_layers.cpp) runs the layers of the model types it covers
        plain = all(lin.bias is None for lin in self.linears()) and all(lay.q_norm is None for lay in self.layers)
        self.layer_weights: dict[str, list[torch.Tensor]] = {}  # per few-rows kernel
        kernel_weights_on_huge_pages(self.linears())  # in the order a pass reads them
        if self.fused and plain:
            # the float32 kernels' weights are the tensors already held, so both are ready for a plan switched
            # between them; the 8-bit kernel's are an interleaved copy (96 MB, 0.2 s for SmolLM2), made if planned
            for k in ("few-rows", "few-rows-gguf", *([EIGHT_BIT_INPUTS] if self.eight_bit_inputs else [])):
                self.layer_weights[k] = [w for lay in self.layers for w in lay.loop_weights(k)]

    @property
    def eight_bit_inputs(self) -> bool:
        """Whether the plan runs some of the linears on inputs rounded to 8 bits (where it found them faster)."""
        return plans_eight_bit_inputs(self.linears())

    @property
    def splits_alike(self) -> bool:
        """Whether a token's keys and values come out the same bits however its sequence was cut into passes: one
        few-rows kernel at every row bucket (each row computed on its own, `models/linear.py`) and the C++
        attention over the cache. Cached entries of a prompt's start then stand for its prefill."""
        kernels = {kernel for lin in self.linears() for kernel in lin.plan.values()}
        whole = all(len(lin.plan) == len(ROW_BUCKETS) for lin in self.linears())
        return self.fused and whole and len(kernels) == 1 and next(iter(kernels)).startswith("few-rows")

    def linears(self) -> list[Linear]:
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [
            self.lm_head
        ]

    def weight_bytes_read(self, rows: int) -> int:
        """Bytes of weights one pass of `rows` rows reads: every linear's as its planned kernel streams them (GGUF
        rows are a fifth to a quarter of float32), the norms, and the embedding rows of the tokens."""
        norms = [t for layer in self.layers for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm)]
        vectors = sum(t.nbytes for t in [*norms, self.norm] if t is not None)
        embedding_rows = rows * self.embedding.shape[1] * self.embedding.element_size()
        return sum(lin.bytes_read(rows) for lin in self.linears()) + vectors + embedding_rows

    def new_cache(self, slots: int, capacity: int) -> KVCache:
        shape = (len(self.layers), slots, self.kv_heads, self.head_dim, capacity)
        return KVCache(*shape, self.cache_dtype, self.embedding.device)

    def _rope_table(self, length: int) -> None:
        """cos and sin of positions 0 .. length - 1 (regrown on demand: a probe may pass the trained context)."""
        positions = torch.arange(length, dtype=torch.float32)
        freqs = positions[:, None] * self.rotary.inv_freq.float().cpu()[None]
        angles = torch.cat([freqs, freqs], dim=-1)
        device = self.embedding.device
        self.cos = (angles.cos() * self.rotary.attention_scaling).to(device=device, dtype=self.dtype)
        self.sin = (angles.sin() * self.rotary.attention_scaling).to(device=device, dtype=self.dtype)

    def _norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """x += delta (the residual stream takes a block's output), then RMS-normalise x with `weight`."""
        if self.fused:
            return torch.ops.specdecode.add_rms_norm(x, delta, weight, self.eps)
        if delta is not None:
            x += delta
        return F.rms_norm(x, x.shape[-1:], weight, self.eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the rows [gate | up]: the C++ loop's own kernel where the kernels run."""
        if self.fused:
            return torch.ops.specdecode.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of the q and k heads (N, heads, D) of N tokens at angles (N, D)."""
        if self.fused:
            torch.ops.specdecode.rotate_(qk, qk.shape[1], cos, sin)  # a view of the qkv rows: rotated in place
            return qk
        half = qk.shape[-1] // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        return qk * cos[:, None] + rotated * sin[:, None]

    def _attend(self, layer: int, q, k, v, cache: KVCache | None, rows: Rows | None, attention: dict) -> torch.Tensor:
        """Store k, v in the cache and attend (R, heads, Q, D): in place over each row's slot with the C++
        kernel where the mask is causal or a tree's, else SDPA over the rows' entries."""
        if rows is None:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv_heads != self.heads, **attention)
        cache.write(layer, k, v, rows)
        if rows.limits is not None and self.fused and cache.keys.device.type == "cpu":
            R, H, Q, D = q.shape
            group = H // self.kv_heads  # query heads sharing one kv head read its entries once
            grouped = q.reshape(R, self.kv_heads, group * Q, D)
            out = torch.ops.specdecode.cached_attention(
                grouped, cache.keys[layer], cache.values[layer], rows.slot_index, rows.grouped_limits(group),
                D**-0.5, rows.grouped_paths(group), None if rows.paths is None else rows.start_index,
            )  # fmt: skip
            return out.view(R, H, Q, D)
        k, v = (entries.to(q.dtype) for entries in cache.read(layer, rows))
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv_heads != self.heads, **attention)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache | None,
        rows: Rows | None,
        capture: list[int] = (),
        logits: bool = True,
    ) -> Output:
        """One pass over `ids` (R, Q). With no cache, a plain causal pass over whole sequences (training
        features): row r is one sequence, nothing is stored.

        Every layer but attention runs on the rows' real tokens packed (N of them, row after row): a batch's
        short rows cost the linears nothing for the longest one's length (8 requests, one verifying 7 drafts:
        15 tokens through every linear, not 64); attention alone sees the rows padded to Q."""
        R, Q = ids.shape
        H, KV = self.heads, self.kv_heads
        device = self.embedding.device
        ids = ids.to(device)
        rows = rows if rows is None or device.type == "cpu" else rows.to(device)
        positions = torch.arange(Q, device=device)[None].expand(R, Q) if rows is None else rows.positions
        if (Q if rows is None else rows.kv_length) > len(self.cos):
            self._rope_table(2 * (Q if rows is None else rows.kv_length))
        pack = (lambda t: t.flatten(0, 1)) if rows is None else rows.pack
        unpack = (lambda t: t.view(R, Q, *t.shape[1:])) if rows is None else rows.unpack
        packed_positions = pack(positions)  # a padded query's position may lie past the rotary table
        cos, sin = self.cos[packed_positions], self.sin[packed_positions]  # (N, D)
        captured = {}
        x = F.embedding(pack(ids), self.embedding).to(self.dtype)  # (N, hidden): the residual stream, updated in place
        if -1 in capture:
            captured[-1] = unpack(x.clone())
        loop_weights = self._cpp_loop_weights(cache, rows, x.shape[0])
        if loop_weights is not None:
            layer_ids = sorted({i for i in capture if i >= 0})
            delta, *outputs = torch.ops.specdecode.decoder_layers(
                x, loop_weights, cache.keys, cache.values, cos, sin, rows.slot_index, rows.starts,
                rows.counts, rows.grouped_limits(H // KV), rows.grouped_paths(H // KV), H, KV, False, self.eps,
                layer_ids,
            )  # fmt: skip
            captured.update((i, unpack(out)) for i, out in zip(layer_ids, outputs, strict=True))
        else:
            delta = self._layers(x, cos, sin, cache, rows, (pack, unpack), capture, captured)
        last = self._norm(x, delta, self.norm)
        head = unpack(self.lm_head(last)) if logits else None
        layer_hidden = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return Output(head, layer_hidden, unpack(last))

    def _cpp_loop_weights(self, cache: KVCache | None, rows: Rows | None, tokens: int) -> list[torch.Tensor] | None:
        """The weights for the C++ layer loop if it runs this pass (a causal or tree pass (`limits`) through a CPU
        cache whose linears take a few-rows kernel (their exact plan) in a model of the types it covers), else None."""
        if rows is None or rows.limits is None or cache.keys.device.type != "cpu":
            return None
        return self.layer_weights.get(self.layers[0].qkv.kernel_for(tokens))

    def _layers(self, x, cos, sin, cache, rows, packing, capture, captured) -> torch.Tensor:
        """The decoder layers in Python, for every pass (a reference for the C++ loop, which must match it bit
        for bit): x (N, hidden), the packed residual stream, is updated in place; `packing` (pack, unpack) moves
        tokens between N packed and the rows (R, Q, ...) that attention sees; returns the last layer's output."""
        N = x.shape[0]
        pack, unpack = packing
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        attention = dict(is_causal=True) if rows is None else dict(attn_mask=rows.mask)
        delta = None  # a block's output, added to the residual stream x by the next norm
        for i, layer in enumerate(self.layers):
            h = self._norm(x, delta, layer.input_norm)
            qkv = layer.qkv(h)
            qk = qkv[:, : (H + KV) * D].view(N, H + KV, D)
            if layer.q_norm is not None:
                q_normed = F.rms_norm(qk[:, :H], (D,), layer.q_norm, self.eps)
                qk = torch.cat([q_normed, F.rms_norm(qk[:, H:], (D,), layer.k_norm, self.eps)], dim=1)
            qk = unpack(self._rotate(qk, cos, sin)).transpose(1, 2)  # (R, H + KV, Q, D)
            v = unpack(qkv[:, (H + KV) * D :].view(N, KV, D)).transpose(1, 2)
            out = self._attend(i, qk[:, :H], qk[:, H:], v, cache, rows, attention).transpose(1, 2)
            h = self._norm(x, layer.o(pack(out).reshape(N, H * D)), layer.post_norm)
            delta = layer.down(self._silu_mul(layer.gate_up(h)))
            if i in capture:
                captured[i] = unpack(x + delta)
        return delta
