"""The target runner: prefill, the verify pass over k new positions, hidden-state capture, rollback.

Layer-index convention (used everywhere in specdecode, stored in drafter checkpoints as
"output_of_layer"): layer id i is the output of decoder layer i, counting from 0, i.e. the raw residual
stream after that layer. It equals index i + 1 of Hugging Face's `output_hidden_states` tuple (whose
index 0 is the embedding output); id -1 is the embedding output. This is the DFlash / DeepSpec
convention; EAGLE's "input of layer j" and vLLM's explicit ids are j - 1 here. The last decoder layer
cannot be captured (HF's tuple holds it after the final norm), and the final-normed state is available
separately as `last_hidden`.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase

from specdecode.errors import SpecDecodeError
from specdecode.models import registry
from specdecode.models.kernels import KERNELS, install_kernels


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


def default_dtype(device: str) -> torch.dtype:
    """bfloat16 on accelerators; float32 on CPU, where it is ~6x faster than bfloat16 matmuls."""
    return torch.float32 if device == "cpu" else torch.bfloat16


class Target:
    """A causal LM with one KV cache, driven a pass at a time by the decoding loop."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        kernel: str = "auto",
        source: str | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)  # the target is never trained
        self.source = source  # what from_pretrained loaded: a folder or a hub id
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.device = next(model.parameters()).device
        self.kernel = kernel
        if self.device.type == "cpu":
            install_kernels(model, kernel)
        self.cache = DynamicCache(config=self.config)
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self.capture_layers: list[int] = []

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        name: str = registry.DEFAULT_TARGET,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        kernel: str = "auto",
        progress=lambda _: None,
    ) -> "Target":
        if kernel not in KERNELS:
            raise SpecDecodeError(f"unknown kernel '{kernel}'; choose one of {', '.join(KERNELS)}")
        device = device or default_device()
        dtype = dtype or default_dtype(device)
        source = registry.resolve(name, progress)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
        except Exception as e:  # a corrupt cache folder surfaces as many different errors
            raise SpecDecodeError(
                f"could not load model '{name}' from {source} ({first_line(e)}); "
                f"if this is a converted cache folder, delete it and run again"
            ) from e
        return cls(model.to(device), tokenizer, name=name, kernel=kernel, source=source)

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
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return {i for i in ids if i is not None}

    @property
    def cache_length(self) -> int:
        return self.cache.get_seq_length()

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
        return self.model.get_output_embeddings()(hidden)

    # ---------------------------------------------------------------- hidden-state capture
    def set_capture_layers(self, layer_ids: list[int]) -> None:
        """Capture the outputs of these decoder layers (see the module docstring for the convention)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for i in layer_ids:
            if not -1 <= i < self.num_layers - 1:
                raise SpecDecodeError(
                    f"target layer id {i} is out of range for {self.name} ({self.num_layers} layers): use "
                    f"-1 (embedding) .. {self.num_layers - 2} (the last layer is only available after the norm)"
                )
            module = self.model.get_input_embeddings() if i == -1 else self.model.model.layers[i]
            self._hooks.append(module.register_forward_hook(self._make_hook(i)))
        self.capture_layers = list(layer_ids)

    def _make_hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    # ---------------------------------------------------------------- passes
    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        logits: bool = True,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> PassOutput:
        """One pass over new positions `ids` (k,) appended to the cache. Prefill and verify are both this."""
        self._captured.clear()
        out = self.model.model(
            input_ids=ids.view(1, -1).to(self.device),
            cache=self.cache,
            use_cache=True,
            position_ids=position_ids,
            attention_mask=attention_mask,
        )
        last = out.last_hidden_state[0]
        layer_hidden = None
        if self.capture_layers:
            layer_hidden = torch.cat([self._captured[i][0] for i in self.capture_layers], dim=-1)
        return PassOutput(logits=self.lm_head(last) if logits else None, layer_hidden=layer_hidden, last_hidden=last)

    @torch.inference_mode()
    def features(self, input_ids: torch.Tensor) -> PassOutput:
        """A cache-free pass over a whole sequence (T,) for drafter training; the decoding cache is left alone."""
        self._captured.clear()
        out = self.model.model(input_ids=input_ids.view(1, -1).to(self.device), use_cache=False)
        layer_hidden = None
        if self.capture_layers:
            layer_hidden = torch.cat([self._captured[i][0] for i in self.capture_layers], dim=-1)
        return PassOutput(logits=None, layer_hidden=layer_hidden, last_hidden=out.last_hidden_state[0])

    @torch.inference_mode()
    def forward_rows(
        self, ids: torch.Tensor, cache, position_ids: torch.Tensor, attention_mask: torch.Tensor, logits: bool = True
    ) -> PassOutput:
        """One pass over several requests' new positions `ids` (R, Q) with a caller-owned cache (the batched
        verify pass of `engine/batch.py`); every output keeps its row dimension: (R, Q, ...)."""
        self._captured.clear()
        out = self.model.model(
            input_ids=ids.to(self.device),
            cache=cache,
            use_cache=True,
            position_ids=position_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
        )
        last = out.last_hidden_state
        layer_hidden = None
        if self.capture_layers:
            layer_hidden = torch.cat([self._captured[i] for i in self.capture_layers], dim=-1)
        return PassOutput(logits=self.lm_head(last) if logits else None, layer_hidden=layer_hidden, last_hidden=last)

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached positions; drop the KV of rejected drafts."""
        excess = self.cache_length - length
        if excess > 0:
            self.cache.crop(-excess)

    @torch.inference_mode()  # the cache holds inference tensors, which only change in place in this mode
    def keep_path(self, start: int, offsets: list[int]) -> None:
        """Move the cached positions `start + offsets[j]` to `start + j` in every layer and drop the rest.

        After a tree pass this keeps the accepted path only. Its keys need no re-rotation: a node at depth d
        was computed at position start + d, the slot it moves to. Entries already in place are not copied, so
        for a chain this is a rollback.
        """
        moved = next((j for j, offset in enumerate(offsets) if offset != j), len(offsets))
        if moved < len(offsets):
            source = torch.tensor(offsets[moved:], device=self.device) + start
            for layer in self.cache.layers:
                layer.keys[:, :, start + moved : start + len(offsets)] = layer.keys.index_select(2, source)
                layer.values[:, :, start + moved : start + len(offsets)] = layer.values.index_select(2, source)
        self.rollback(start + len(offsets))

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)
