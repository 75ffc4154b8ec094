"""The Llama block parts the drafters share: rotary embedding and one decoder block's weights.

EAGLE-3 and DSpark/DFlash both draft with target-shaped decoder blocks; they differ only in what the
attention reads (EAGLE-3: [embedding ; hidden], 2H wide; DSpark: the block's own states plus context keys
and values). `DecoderBlock` owns the weights and the shared steps under the target's attribute names, so
checkpoints keep the usual Llama key names; each drafter's layer writes its own `forward`.
"""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim), False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (..., d) of the angles at positions (...)."""
        angles = positions[..., None].float() * self.inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (..., L, d) rotated by positions (..., L)."""
        cos, sin = self.tables(positions)
        return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class FrozenRMSNorm(nn.Module):
    """An inference-only RMSNorm of float32 rows by the runner's C++ loop: at a drafter's few rows the stock
    op chain (square, mean, rsqrt, two products) costs ~40 µs of dispatch a call, the loop a few; a drafting
    round runs 9-11 norms."""

    def __init__(self, norm: nn.RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight.detach().float()  # a plain tensor: never trained, never in a state dict
        self.eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return F.rms_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.eps)
        return torch.ops.specdecode.add_rms_norm(x.contiguous(), None, self.weight, self.eps)


def freeze_norms(module: nn.Module) -> None:
    """Swap every `nn.RMSNorm` of an inference-only module for a `FrozenRMSNorm` (where the C++ kernels built)."""
    from specdecode.models.linear import cpu_kernels_available

    if not cpu_kernels_available():
        return
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.RMSNorm:
                setattr(parent, name, FrozenRMSNorm(child))


class BlockShape(Protocol):
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float


class DecoderBlock(nn.Module):
    """One pre-norm Llama block's weights; q/k/v read `attention_width` features (H unless told).

    With `qk_norm` (Qwen3's block, which the engines' DFlash/DSpark drafters use) every query and key head
    is RMS-normed over its head dimension before the rotation."""

    def __init__(self, c: BlockShape, attention_width: int | None = None, qk_norm: bool = False) -> None:
        super().__init__()
        self.c = c
        h, d, width = c.hidden_size, c.head_dim, attention_width or c.hidden_size
        self.input_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.q_proj = nn.Linear(width, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(width, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(width, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=c.rms_norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(d, eps=c.rms_norm_eps) if qk_norm else nn.Identity()
        self.post_attention_layernorm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.c.head_dim).transpose(-2, -3)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, ...]:
        """Keys (rotated) and values (B, kvh, L, d) of features x (B, L, width) at positions (B, L)."""
        k = rotary(self.k_norm(self.heads(self.k_proj(x), self.c.num_kv_heads)), positions[:, None])
        return k, self.heads(self.v_proj(x), self.c.num_kv_heads)

    def queries(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        return rotary(self.q_norm(self.heads(self.q_proj(x), self.c.num_heads)), positions[:, None])

    def attend_and_mlp(self, residual, q, keys, values, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention output added to `residual` (B, Q, H), then the gated MLP with its residual."""
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        h = residual + self.o_proj(attn.transpose(1, 2).flatten(-2))
        normed = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))
