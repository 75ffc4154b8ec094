"""Sampling settings -> the target distribution p.

Normal decoding and verification both call `probabilities`, so temperature, top-k and top-p shape p in
exactly one way: that is what makes speculative output follow normal sampling with the same settings.
"""

import math
from dataclasses import dataclass

import torch

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecDecodeError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecDecodeError(f"top_k must be >= 0 (0 switches it off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of `logits` (..., V) after temperature, top-k and top-p; one-hot argmax when greedy."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        # the k best, in descending order: top-p then ranks k tokens, not the vocabulary (sorting 49k logits
        # per row was most of a batched sampling step); exactly k are kept, ties at the k-th broken by topk
        kept, order = torch.topk(logits, params.top_k, dim=-1)
        if params.top_p < 1:
            kept = _nucleus(kept, params.top_p)
        return torch.zeros_like(logits).scatter(-1, order, kept.softmax(-1))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        logits = logits.scatter(-1, order, _nucleus(sorted_logits, params.top_p))
    return logits.softmax(-1)


def _nucleus(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits in descending order with -inf where the tokens ranked above already hold top_p of the mass
    (the top one is always kept)."""
    sorted_probs = sorted_logits.softmax(-1)
    return sorted_logits.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, -math.inf)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a 1-D distribution by inverting its CDF with one uniform number.

    `torch.multinomial` draws one exponential per vocabulary entry (0.8-1.0 ms for SmolLM2's 49k tokens on this
    CPU), which made sampling the largest cost of a batched drafting call; a cumulative sum took 0.06 ms.
    A zero-probability token is never drawn: its CDF step is empty."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)
