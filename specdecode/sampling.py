"""Sampling settings -> the target distribution p.

Normal decoding and verification both call `probabilities`, so temperature, top-k and top-p shape p in
exactly one way: that is what makes speculative output follow normal sampling with the same settings.
"""

import bisect
import itertools
import math
from dataclasses import dataclass

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.linear import cpu_kernels_available


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
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).float()
    if 0 < params.top_k < logits.shape[-1]:
        # the k best, in descending order: top-p then ranks k tokens, not the vocabulary (sorting 49k logits
        # per row was most of a batched sampling step); exactly k are kept, ties at the k-th broken by topk.
        # A temperature keeps the order, so only the k kept logits are divided by it, and the zeros are
        # written once (a batched step at 64 rows spent 4.4 ms here on 49k-entry rows, ~8% of the step)
        kept, order = torch.topk(logits, params.top_k, dim=-1)
        kept = kept / params.temperature
        if params.top_p < 1:
            kept = _nucleus(kept, params.top_p)
        return torch.zeros_like(logits).scatter_(-1, order, kept.softmax(-1))
    if params.top_p == 1 and cpp_takes(logits):
        return torch.ops.specdecode.tempered_softmax(logits, params.temperature)  # one C++ pass (csrc/sampling.cpp)
    logits = logits / params.temperature
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        logits = logits.scatter(-1, order, _nucleus(sorted_logits, params.top_p))
    return logits.softmax(-1)


def cpp_takes(values: torch.Tensor) -> bool:
    """Whether csrc/sampling.cpp's passes take these values: float32 on the CPU, where the kernels built."""
    return values.dtype == torch.float32 and values.device.type == "cpu" and cpu_kernels_available()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last dimension, as `torch.argmax` picks it (the first of equal logits). On CPU
    float32 logits one C++ pass (csrc/sampling.cpp): ATen's argmax took 87 us a 49k-entry row on a 2-core EPYC,
    ~1.5% of a one-token step and ~3% of a verify pass over 8 positions at temperature 0."""
    if cpp_takes(logits):
        return torch.ops.specdecode.greedy_tokens(logits)
    return logits.argmax(-1)


def _nucleus(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits in descending order with -inf where the tokens ranked above already hold top_p of the mass
    (the top one is always kept)."""
    sorted_probs = sorted_logits.softmax(-1)
    return sorted_logits.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, -math.inf)


SAMPLE_BLOCK = 256  # entries of one CDF block (csrc/sampling.cpp too): a short scan, vectorised block sums


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from 1-D weights (any positive total) by inverting their CDF with one uniform number.

    `torch.multinomial` draws one exponential per vocabulary entry (0.8-1.0 ms for SmolLM2's 49k tokens on a
    2-core EPYC), and a float64 cumulative sum over the whole vocabulary is a chain of dependent additions
    (0.09-0.14 ms there, once per sampled token of every request). Two levels instead: the sums of blocks of
    `SAMPLE_BLOCK` entries, the CDF of those sums to find the block, then the CDF inside that one block. On CPU
    float32 weights one C++ call does it (csrc/sampling.cpp): in ATen it is ~8 ops, 0.07 ms warm and 0.14-0.22
    ms right after a target pass, a few percent of a sampled step. A zero-weight token is never drawn: its CDF
    step is empty."""
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    if cpp_takes(probs):
        return torch.ops.specdecode.sample_index(probs, u)
    n = probs.numel()
    blocks = -(-n // SAMPLE_BLOCK)
    padded = probs if n == blocks * SAMPLE_BLOCK else torch.nn.functional.pad(probs, (0, blocks * SAMPLE_BLOCK - n))
    block_cdf = padded.reshape(blocks, SAMPLE_BLOCK).sum(1, dtype=torch.float64).cumsum(0)
    u *= float(block_cdf[-1])
    block = int(torch.searchsorted(block_cdf, u, right=True))
    if block == blocks:  # u rounded up to the total: the last block of nonzero weight
        block = int(torch.searchsorted(block_cdf, block_cdf[-1]))
    cdf = padded[block * SAMPLE_BLOCK : (block + 1) * SAMPLE_BLOCK].cumsum(0, dtype=torch.float64)
    rest = u - (float(block_cdf[block - 1]) if block else 0.0)
    index = int(torch.searchsorted(cdf, rest, right=True))
    if index == SAMPLE_BLOCK:  # `rest` reached the block's own total, which rounds apart from its vectorised sum
        index = int(torch.searchsorted(cdf, cdf[-1]))  # the block's last token of nonzero weight
    return block * SAMPLE_BLOCK + index


def sample_weights(weights: list[float], generator: torch.Generator | None = None) -> int:
    """`sample` for a few weights held as Python floats (a block verification's stopping odds: k + 1 a round):
    the same one uniform number and CDF inversion, as a scan; a tensor and `sample`'s two levels cost ~0.06 ms
    a call, a tenth of a sampled round's verification. A zero weight is never drawn."""
    cdf = list(itertools.accumulate(weights))  # its last entry is the total the draw is scaled by, bit for bit
    u = float(torch.rand((), dtype=torch.float64, generator=generator)) * cdf[-1]
    index = bisect.bisect_right(cdf, u)  # the first step above u: a zero weight's step is empty
    if index == len(cdf):  # u rounded up to the total: the last nonzero weight
        index = max(i for i, weight in enumerate(weights) if weight > 0)
    return index
