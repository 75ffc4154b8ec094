"""The narrow interface every drafter implements.

A drafter proposes up to `max_tokens` next tokens for the committed sequence, either with their draft
distributions q (sampled proposals) or as deterministic guesses (q one-hot); the verifier never learns
how they were made. After each round the drafter is told how many of its tokens survived and gets the
target's features for the positions the target has just committed.
"""

from dataclasses import dataclass

import torch

from specdecode.models.target import Target
from specdecode.sampling import SamplingParams


@dataclass
class Proposal:
    """k draft tokens (k may be 0), for sampled proposals their distributions q (k, V), and where the
    drafter estimates them, confidences: P(token j survives | tokens before it survived)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


@dataclass
class TargetFeatures:
    """What the target computed for positions it committed: captured layers and final-normed state."""

    layer_hidden: torch.Tensor | None  # (n, n_layers * H)
    last_hidden: torch.Tensor  # (n, H)


EMPTY_PROPOSAL = Proposal(tokens=torch.empty(0, dtype=torch.long))


class Drafter:
    """Base class: `none` (normal decoding) is this class itself, proposing nothing."""

    name = "none"
    target_layer_ids: list[int] = []  # target layers whose outputs the drafter reads

    def check_target(self, target: Target) -> None:
        """Raise `SpecDecodeError` when this drafter cannot serve `target` (vocabulary, fingerprint)."""

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        features: TargetFeatures | None,
    ) -> None:
        """A new completion starts from `prompt_ids`; `features` cover all prompt tokens but the last."""

    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        """Draft up to `max_tokens` tokens that continue the committed sequence `ids`."""
        return EMPTY_PROPOSAL

    def observe(self, ids: list[int], num_accepted: int, features: TargetFeatures | None) -> None:
        """`ids` is the committed sequence after a round in which `num_accepted` drafts survived."""
