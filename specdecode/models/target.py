"""The target runner: prefill, the verify pass over k new positions, hidden-state capture, rollback.

Layer-index convention (used everywhere in specdecode, stored in drafter checkpoints as
"output_of_layer"): layer id i is the output of decoder layer i, counting from 0, i.e. the raw residual
stream after that layer. It equals index i + 1 of Hugging Face's `output_hidden_states` tuple (whose
index 0 is the embedding output); id -1 is the embedding output. This is the DFlash / DeepSpec
convention; EAGLE's "input of layer j" and vLLM's explicit ids are j - 1 here. The last decoder layer
cannot be captured (HF's tuple holds it after the final norm), and the final-normed state is available
separately as `last_hidden`.
"""

import functools
import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, Cache, PreTrainedTokenizerBase

from specdecode.errors import SpecDecodeError
from specdecode.models import registry
from specdecode.models.gguf_rows import gguf_rows, holds_rows
from specdecode.models.linear import (
    KERNELS,
    FrozenLinear,
    bfloat16_is_faster,
    cpu_kernels_available,
    rows_beat_bfloat16,
)
from specdecode.models.llama import KVCache, LlamaRunner, Output, Rows, unsupported_reason

INITIAL_CACHE = 512  # entries of a one-request cache; it doubles when a context outgrows it


@dataclass
class PassOutput:
    """What one target pass returns for its new positions (batch dimension 1 removed)."""

    logits: torch.Tensor | None  # (k, V), or None when logits were not asked for
    layer_hidden: torch.Tensor | None  # (k, n_layers * H): captured layers, concatenated in id order
    last_hidden: torch.Tensor  # (k, H), after the final norm


def first_line(error: Exception) -> str:
    """`Type: first line of the message`, for one-line error reports."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str, source: str | None = None) -> torch.dtype:
    """bfloat16 on accelerators. On a CPU float32 where the model ships as GGUF Q4_1 / Q8_0 rows and the runner's
    8-bit-input kernel over them was measured faster than bfloat16 weights (Zen 4, stop 61: normal decoding
    214 against 95 tokens/s); else bfloat16 where native and measured faster, else float32."""
    if device != "cpu":
        return torch.bfloat16
    if holds_rows(source) and rows_beat_bfloat16():
        return torch.float32
    return torch.bfloat16 if bfloat16_is_faster() else torch.float32


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    """The CPU weight dtype the machine did not choose (float32 beside bfloat16 and back): benchmarks run both."""
    return torch.float32 if dtype == torch.bfloat16 else torch.bfloat16


class Target:
    """A causal LM with one KV cache, driven a pass at a time by the decoding loop.

    Every pass runs through `run`: the lean runner (`models/llama.py`) for the Llama family, else the HF
    model's own forward over the same `KVCache` (`runner=False` forces that; it is also the reference the
    tests hold the runner to).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        kernel: str = "auto",
        source: str | None = None,
        runner: bool = True,
    ) -> None:
        if kernel not in KERNELS:
            raise SpecDecodeError(f"unknown kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
        self.model = model.eval().requires_grad_(False)  # the target is never trained
        self.source = source  # what from_pretrained loaded: a folder or a hub id
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.fallback_reason = unsupported_reason(self.config) if runner else "the HF forward was asked for"
        self.runner = None
        if self.fallback_reason is None:
            quantized = self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels_available()
            rows = gguf_rows(source, model.state_dict()) if quantized else {}
            self.runner = LlamaRunner(model, kernel, rows)
        self.kernel = kernel if self.runner else "hf"
        self.capture_layers: list[int] = []
        self._captured: dict[int, torch.Tensor] = {}  # HF forward only: filled by hooks
        self._hooks: list = []
        self._head: FrozenLinear | None = None
        self.kv = self.new_cache(1, min(INITIAL_CACHE, self.max_context))
        self.length = 0  # cached positions of the one request

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        name: str = registry.DEFAULT_TARGET,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        kernel: str = "auto",
        progress=lambda _: None,
        runner: bool = True,
    ) -> "Target":
        device = device or default_device()
        source = registry.resolve(name, progress)
        dtype = dtype or default_dtype(device, source)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
        except Exception as e:  # a corrupt cache folder surfaces as many different errors
            raise SpecDecodeError(
                f"could not load model '{name}' from {source} ({first_line(e)}); "
                f"if this is a converted cache folder, delete it and run again"
            ) from e
        return cls(model.to(device), tokenizer, name=name, kernel=kernel, source=source, runner=runner)

    # ---------------------------------------------------------------- facts
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def eight_bit_inputs(self) -> bool:
        """Whether the plan runs some of the runner's linears on inputs rounded to 8 bits (where it found them
        faster: models/linear.py)."""
        return self.runner is not None and self.runner.eight_bit_inputs

    @property
    def rounds_inputs(self) -> bool:
        """Whether the linears of a decoding pass round their inputs (bfloat16 weights, or 8-bit inputs): its
        logits then stand further from the float32 HF forward than float32 rounding."""
        return self.dtype == torch.bfloat16 or self.eight_bit_inputs

    @functools.cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The generation config's end tokens and the tokenizer's (engines test every new token against them)."""
        ids = self.model.generation_config.eos_token_id
        ids = list(ids) if isinstance(ids, list) else [ids]  # a copy: the config's own list stays as it is
        return frozenset(i for i in [*ids, self.tokenizer.eos_token_id] if i is not None)

    def fingerprint(self) -> str:
        """Hash of the shapes that matter and of the embedding matrix: drafters record it to refuse a mismatch.
        The embedding is hashed as bfloat16, so the same model loaded in float32 or bfloat16 (chosen per
        machine) has one fingerprint: a drafter trained on one machine serves the target on another."""
        c = self.config
        digest = hashlib.sha256()
        digest.update(json.dumps([c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads]).encode())
        embedding = self.model.get_input_embeddings().weight.detach().cpu()
        digest.update(embedding.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        return digest.hexdigest()[:16]

    @property
    def cache_length(self) -> int:
        return self.length

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of a user message wrapped in the model's chat template, or of raw text."""
        if chat and self.tokenizer.chat_template:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, ending with the prompt for the assistant's next answer."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output_head()(hidden)

    def output_head(self) -> nn.Module:
        """The LM head as a frozen module, for drafters that borrow it: the runner's, with its measured kernels."""
        if self.runner is None:
            return self.model.get_output_embeddings()
        if self._head is None:
            self._head = FrozenLinear(self.runner.lm_head)
        return self._head

    # ---------------------------------------------------------------- hidden-state capture
    def set_capture_layers(self, layer_ids: list[int]) -> None:
        """Capture the outputs of these decoder layers (see the module docstring for the convention)."""
        for i in layer_ids:
            if not -1 <= i < self.num_layers - 1:
                raise SpecDecodeError(
                    f"target layer id {i} is out of range for {self.name} ({self.num_layers} layers): use "
                    f"-1 (embedding) .. {self.num_layers - 2} (the last layer is only available after the norm)"
                )
        self.capture_layers = list(layer_ids)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.runner is None:  # the runner keeps the layers it is asked for as it passes them
            for i in layer_ids:
                module = self.model.get_input_embeddings() if i == -1 else self.model.model.layers[i]
                self._hooks.append(module.register_forward_hook(self._make_hook(i)))

    def _make_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    # ---------------------------------------------------------------- passes
    @property
    def splits_alike(self) -> bool:
        """Whether a token's cached keys and values do not depend on how its sequence was cut into passes (the
        runner's `splits_alike`; the HF fallback promises nothing)."""
        return self.runner is not None and self.runner.splits_alike

    def new_cache(self, slots: int, capacity: int) -> KVCache:
        if self.runner:
            return self.runner.new_cache(slots, capacity)
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return KVCache(c.num_hidden_layers, slots, c.num_key_value_heads, head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, cache: KVCache | None, rows: Rows | None, logits: bool = True) -> Output:
        """One pass over `ids` (R, Q) placed in `cache` as `rows` say (no cache: whole sequences, nothing kept)."""
        if self.runner:
            return self.runner.forward(ids, cache, rows, self.capture_layers, logits)
        self._captured.clear()
        ids = ids.to(self.device)
        if rows is None:
            out = self.model.model(input_ids=ids, use_cache=False)
        else:
            mask = rows.mask if rows.mask is not None else torch.ones(1, 1, ids.shape[1], rows.kv_length, dtype=bool)
            out = self.model.model(
                input_ids=ids,
                cache=_HFCache(cache, rows.to(self.device)),
                use_cache=True,
                position_ids=rows.positions.to(self.device),
                attention_mask=mask.expand(ids.shape[0], -1, -1, -1).to(self.device),
            )
        last = out.last_hidden_state
        layer_hidden = torch.cat([self._captured[i] for i in self.capture_layers], -1) if self.capture_layers else None
        return Output(self.lm_head(last) if logits else None, layer_hidden, last)

    def forward(
        self,
        ids: torch.Tensor,
        logits: bool = True,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> PassOutput:
        """One pass over new positions `ids` (k,) appended to the cache. Prefill and verify are both this;
        a tree pass gives its nodes' positions and its 4-D mask."""
        n = ids.numel()
        if self.length + n > self.kv.capacity:
            self.kv.grow(min(max(2 * self.kv.capacity, self.length + n), max(self.max_context, self.length + n)))
        if attention_mask is None:
            rows = Rows.chain(0, self.length, n)
        else:
            rows = Rows.tree(0, self.length, position_ids, attention_mask)
        out = self.run(ids.view(1, -1), self.kv, rows, logits)
        self.length += n
        return _first_row(out)

    def features(self, input_ids: torch.Tensor) -> PassOutput:
        """A pass over a whole sequence (T,) for drafter training, through a scratch cache as a prefill runs: the
        same kernels (attention over the cache, each row count's planned linears), so a drafter learns from the
        very features decoding gives it (a cache-free pass attends through SDPA: where the linears round their
        inputs, to bfloat16 or 8 bits, its last-bit differences grew to 1.7% of the last hidden state over 30
        layers). The decoding cache is left alone."""
        n = input_ids.numel()
        return _first_row(self.run(input_ids.view(1, -1), self.new_cache(1, n), Rows.chain(0, 0, n), logits=False))

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached positions; drop the KV of rejected drafts."""
        self.length = min(self.length, length)

    @torch.inference_mode()
    def keep_path(self, start: int, offsets: list[int]) -> None:
        """Move the cached positions `start + offsets[j]` to `start + j` and drop the rest.

        After a tree pass this keeps the accepted path only. Its keys need no re-rotation: a node at depth d
        was computed at position start + d, the slot it moves to. Entries already in place are not copied, so
        for a chain this is a rollback.
        """
        moved = next((j for j, offset in enumerate(offsets) if offset != j), len(offsets))
        if moved < len(offsets):
            source = torch.tensor(offsets[moved:], device=self.device) + start
            self.kv.move(0, source, start + moved)
        self.rollback(start + len(offsets))

    def reset(self) -> None:
        self.length = 0


def _first_row(out: Output) -> PassOutput:
    return PassOutput(
        logits=None if out.logits is None else out.logits[0],
        layer_hidden=None if out.layer_hidden is None else out.layer_hidden[0],
        last_hidden=out.last_hidden[0],
    )


class _HFCache(Cache):
    """Lets the HF forward (the fallback and the tests' reference) read and write a `KVCache` as the runner does."""

    def __init__(self, kv: KVCache, rows: Rows) -> None:
        super().__init__(layers=[])
        self.kv, self.rows = kv, rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.kv.write(layer_idx, key_states, value_states, self.rows)
        return self.kv.read(layer_idx, self.rows)
