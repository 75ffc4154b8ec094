"""The block drafter's inference on the runner's C++ kernels: backbone, context K/V and the Markov chain.

Why: a drafting round is small (two layers over 7 block tokens a request, an LM head, 7 Markov steps) and in
Python it is mostly dispatch: each layer ~45 ops (norms, rotations, the context concatenated with the block,
SDPA), 2.0 ms a round for the shipped drafter of which ~0.6 ms streams weights; the sequential stage ~0.9 ms.
- Backbone: the target's C++ layer loop (csrc/decoder_layers.cpp) runs the layers in one call. The context's
  keys and values wait in a `ContextPool` (a slot per request, grown by doubling), the block's are written right
  after them (and overwritten by the next round's context), and every block query sees the context and the
  whole block: `limits` = context length + block size.
- Context K/V: every layer's keys and values of new context vectors in one fused product; on the few-rows
  kernels the projection, norms, rotation and the writes into the pool are one C++ call.
- Markov chain: the vanilla Markov stage, greedy or sampled at a plain temperature, is one C++ loop
  (csrc/markov_chain.cpp).
The arithmetic is the Python path's up to summation order and bfloat16 rounding of the Markov input;
verification never depends on it.
"""

import torch
from torch import Tensor

from specdecode.drafters.layers import FrozenRMSNorm
from specdecode.models.linear import (
    FrozenLinear,
    Linear,
    cpu_kernels_available,
    kernel_weights_on_huge_pages,
    rounded_cache_dtype,
)
from specdecode.models.llama import KVCache
from specdecode.sampling import SamplingParams


class BlockKernels:
    """A frozen `DSparkModel` (its linears `FrozenLinear`, its norms `FrozenRMSNorm`) prepared for the C++
    kernels: q, k, v and gate, up fused into one matrix each, as the target runner has them; every layer's
    context k, v fused; the Markov bias matrix transposed (bfloat16)."""

    def __init__(self, model) -> None:
        c = model.config
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.head_norms = c.qk_norm
        self.eps = model.norm.eps
        self.norm = model.norm.weight
        self.rotary = model.rotary
        # per layer, in the order the C++ loop takes them: norms as tensors, linears as `Linear`s
        self.layer_parts: list[tuple[Tensor | Linear, ...]] = []
        self._loop_weights: dict[str, list[Tensor]] = {}  # per few-rows kernel, made on first use
        # every layer's keys and values of the context in one product: (layers * 2 * kv_heads * head_dim, H)
        self.context_kv_linear = _fused([m for layer in model.layers for m in (layer.k_proj, layer.v_proj)])
        self.fc, self.hidden_norm = model.fc.linear, model.hidden_norm
        self.k_norms = [layer.k_norm.weight if self.head_norms else None for layer in model.layers]
        for layer in model.layers:
            parts = (
                layer.input_layernorm.weight,
                _fused([layer.q_proj, layer.k_proj, layer.v_proj]),
                layer.o_proj.linear,
                layer.post_attention_layernorm.weight,
                _fused([layer.gate_proj, layer.up_proj]),
                layer.down_proj.linear,
            )
            self.layer_parts.append(parts + ((layer.q_norm.weight, layer.k_norm.weight) if self.head_norms else ()))
        # what a round reads, in its order, on 2 MB pages where the kernels read copies (models/huge_pages.py)
        head = [model.lm_head.linear] if c.draft_vocab_size and isinstance(model.lm_head, FrozenLinear) else []
        layer_linears = [p for parts in self.layer_parts for p in parts if isinstance(p, Linear)]
        kernel_weights_on_huge_pages([self.fc, self.context_kv_linear, *layer_linears, *head])
        markov = model.markov
        self.chains = markov is None or markov.kind == "vanilla"  # the C++ chain covers these heads
        if self.chains:
            self.w1 = torch.empty(c.vocab_size, 0) if markov is None else markov.w1.weight.detach().float()
            w2 = torch.empty(c.draft_vocab, 0) if markov is None else markov.w2.weight
            self.bias_blocks = torch.ops.specdecode.markov_bias_blocks(w2.detach())
            self.d2t = model.d2t.long() if c.draft_vocab_size else None

    @property
    def cache_dtype(self) -> torch.dtype | None:
        """The context pool's, by the target runner's KV cache rule (`rounded_cache_dtype`). One request's round
        after a target pass, shipped DSpark, Zen 4 EPYC: 1.12 -> 1.09 / 1.57 -> 1.43 / 1.73 -> 1.55 ms at 128 / 512
        / 1,024 cached tokens. None: the features' own dtype."""
        layers = [p for parts in self.layer_parts for p in parts if isinstance(p, Linear)]
        return rounded_cache_dtype([self.fc, self.context_kv_linear, *layers])

    @classmethod
    def of(cls, model) -> "BlockKernels | None":
        """The kernels for `model` where they run (a CPU model whose kernels built, frozen for inference), else None."""
        linears = [model.fc] + [m for layer in model.layers for m in _linears(layer)]
        norms = (model.norm, model.hidden_norm)
        frozen = all(isinstance(m, FrozenLinear) for m in linears) and all(isinstance(n, FrozenRMSNorm) for n in norms)
        cpu = model.fc.weight.device.type == "cpu"
        return cls(model) if frozen and cpu and cpu_kernels_available() else None

    def loop_kernel(self, tokens: int) -> str | None:
        """The few-rows kernel a backbone pass of `tokens` block tokens takes in the loop, or None where it runs in
        Python: always the loop over bfloat16 panels (they keep up with the library kernels at any row count, as
        in the target runner; measured: 8 requests' blocks 15.4 ms in Python on oneDNN, 10.9 ms in the loop),
        else where the measured plan runs a few-rows kernel."""
        qkv = self.layer_parts[0][1]
        kernel = qkv.kernel_for(tokens)
        if kernel.startswith("few-rows"):
            return kernel
        return "few-rows" if qkv.kernel_weight.dim() == 3 else None

    def loop_weights(self, kernel: str) -> list[Tensor]:
        """Every layer's weights as the C++ loop reads them under the few-rows `kernel`."""
        if kernel not in self._loop_weights:
            self._loop_weights[kernel] = [
                p.few_rows_weight(kernel) if isinstance(p, Linear) else p for parts in self.layer_parts for p in parts
            ]
        return self._loop_weights[kernel]

    @torch.inference_mode()
    def backbone(
        self, inputs: Tensor, positions: Tensor, cache: KVCache, slots: list[int], starts: list[int]
    ) -> Tensor:
        """Final-normed states (R, Q, H) of block inputs (R, Q, H) at positions (R, Q); row r's context is slot
        slots[r] of `cache`, entries 0 .. starts[r] - 1 (its block is written after them)."""
        R, Q, hidden = inputs.shape
        x = inputs.reshape(R * Q, hidden).to(torch.float32, copy=True)  # the residual stream, updated in place
        cos, sin = (t.reshape(R * Q, -1) for t in self.rotary.tables(positions))
        group = self.heads // self.kv_heads
        limits = (torch.tensor(starts) + Q)[:, None].expand(R, group * Q).contiguous()
        weights = self.loop_weights(self.loop_kernel(R * Q))
        delta, *_ = torch.ops.specdecode.decoder_layers(
            x, weights, cache.keys, cache.values, cos, sin, torch.tensor(slots), starts, [Q] * R, limits, None,
            self.heads, self.kv_heads, self.head_norms, self.eps, [],
        )  # fmt: skip
        return torch.ops.specdecode.add_rms_norm(x, delta, self.norm, self.eps).view(R, Q, hidden)

    @torch.inference_mode()
    def context_kv(self, context: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """`DSparkModel.context_kv` in one product and the C++ norm and rotation: every layer's keys (normed,
        rotated) and values (1, kv_heads, n, head_dim) of context vectors (1, n, H) at positions (1, n)."""
        n, KV, D = context.shape[1], self.kv_heads, self.head_dim
        kv = self.context_kv_linear(context.reshape(n, -1)).view(n, len(self.k_norms), 2, KV, D)
        cos, sin = self.rotary.tables(positions.reshape(n))
        out = []
        for layer, k_norm in enumerate(self.k_norms):
            keys = kv[:, layer, 0].contiguous()  # (n, KV, D)
            if k_norm is not None:
                keys = torch.ops.specdecode.add_rms_norm(keys.view(n * KV, D), None, k_norm, self.eps).view(n, KV, D)
            torch.ops.specdecode.rotate_(keys, KV, cos, sin)
            out.append((keys.transpose(0, 1)[None], kv[:, layer, 1].transpose(0, 1)[None]))
        return out

    @torch.inference_mode()
    def project(
        self,
        features: Tensor,
        positions: Tensor,
        cache: KVCache,
        slots: list[int],
        starts: list[int],
        counts: list[int],
    ) -> bool:
        """`DSparkModel.context` and `context_kv` of float32 `features` (N, n * H) at `positions` (N), stored by
        the same C++ call: the next counts[r] rows (rows of requests one after another) are slot slots[r]'s
        entries starts[r] .. starts[r] + counts[r] - 1. The kernels of `context_kv` and its Python glue (the
        norms, the rotation, a copy per layer into the pool), which cost a round 0.14 ms for one request and
        0.25 ms for four (Zen 3 EPYC; results/context_projection_ab.md). Returns False, storing nothing, where
        the plan runs these rows' linears on a library kernel (a long prompt's first round)."""
        linears = (self.fc, self.context_kv_linear)
        kernels = [linear.kernel_for(len(features)) for linear in linears]
        if features.dtype != torch.float32 or not all(k.startswith("few-rows") for k in kernels):
            return False
        cos, sin = self.rotary.tables(positions)
        fc, kv = (linear.few_rows_weight(kernel) for linear, kernel in zip(linears, kernels, strict=True))
        k_norms = [] if self.k_norms[0] is None else self.k_norms
        torch.ops.specdecode.project_context(
            features, fc, self.hidden_norm.weight, kv, k_norms, cache.keys, cache.values, cos, sin,
            torch.tensor(slots), starts, counts, self.hidden_norm.eps,
        )  # fmt: skip
        return True

    def chains_for(self, params: list[SamplingParams]) -> bool:
        """Whether the C++ chain serves requests with these settings: a vanilla Markov head (or none), each
        request greedy or sampling at a plain temperature (top-k and top-p stay on the Python path)."""
        return self.chains and all(p.greedy or (p.top_k == 0 and p.top_p == 1) for p in params)

    @torch.inference_mode()
    def chain(
        self, model, h: Tensor, base_logits: Tensor, anchors: Tensor, temperatures: list[float], generators: list
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        """`DSparkModel.sequential` at inference for states h (R, G, H), draft logits (R, G, N) and anchors (R),
        row r greedy at temperature 0, else drawn from q = softmax(z / t) with uniforms from `generators[r]`:
        confidence logits (R, G) (None without the head), the drafts' target ids (R, G), and per row q (the
        sampled rows) or the corrected logits (R, G, N)."""
        R, G = base_logits.shape[:2]
        uniforms = None
        if any(t > 0 for t in temperatures):
            uniforms = torch.zeros(R, G, dtype=torch.float64)
            for r, (t, generator) in enumerate(zip(temperatures, generators, strict=True)):
                if t > 0:
                    uniforms[r] = torch.rand(G, dtype=torch.float64, generator=generator)
        tokens, out, embedded = torch.ops.specdecode.markov_chain(
            base_logits.float(), self.w1, self.bias_blocks, self.d2t, anchors, temperatures, uniforms
        )
        return model.confidence_logits(h, embedded if self.w1.shape[1] else None), tokens, out


def _linears(layer) -> list:
    return [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.gate_proj, layer.up_proj, layer.down_proj]


def _fused(modules: list) -> Linear:
    """One matrix for frozen projections of the same input, planned as the first of them (their Q8_0 rows joined
    too where each has them)."""
    blocks = [m.linear.blocks for m in modules]
    fused = Linear(torch.cat([m.linear.weight for m in modules]), None, None if None in blocks else torch.cat(blocks))
    fused.plan = dict(modules[0].linear.plan)
    if "onednn" in fused.plan.values():
        fused.pack_onednn()
    return fused
