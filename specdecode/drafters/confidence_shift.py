"""A correction to a drafter's confidences, learned from the rounds the target verifies.

Why: the STS map (`specdecode calibrate`) is fitted on held-out rounds of the training distribution, and on
other text the drafter keeps fewer drafts than its confidences say (the shipped DSpark drafter at T = 0, drafts
kept a model round, predicted against kept: the demo's prose prompt 0.53 against 0.35, two GSM8K prompts 1.20 /
1.61 against 0.80 / 1.04, two MT-Bench prompts 0.51 / 0.30 against 0.12 / 0.00; stop 52). The prefix scheduler
then verifies drafts that do not pay for their positions in the pass.

Each verified draft is one observation of its conditional confidence c_j = P(draft j survives | the drafts
before it did): it survived (the accepted ones) or not (the first rejected one); past that, nothing was
observed. A logit shift s, c'_j = sigmoid(logit(c_j) + s), follows the observations of every request a
drafter serves by stochastic gradient steps on their log-likelihood, from s = 0 (the map as fitted): the map
adapts to the traffic. A shift per request, from 0 each time, moved too little in a request's 10-25 model
rounds to change its speed (tools/confidence_shift_ab.py, stop 52).

Lossless at any temperature: the shift depends on earlier rounds only, and the scheduler may cut a proposal
at any length.
"""

import math
from dataclasses import dataclass

import torch

RATE = 0.1  # logit units per unit of surprise (survived - predicted) of one observation


@dataclass
class ConfidenceShift:
    shift: float = 0.0

    def apply(self, confidences: torch.Tensor) -> torch.Tensor:
        """The confidences with the shift added to their logits."""
        if not self.shift:
            return confidences
        return torch.sigmoid(torch.logit(confidences, eps=1e-6) + self.shift)

    def learn(self, confidences: list[float], verified: int, accepted: int) -> None:
        """One round: `confidences` as calibrated, before any shift; the target verified the first `verified`
        drafts and `accepted` of them survived."""
        for j, c in enumerate(confidences[: min(verified, accepted + 1)]):
            c = min(max(c, 1e-6), 1 - 1e-6)
            predicted = 1 / (1 + math.exp(-(math.log(c / (1 - c)) + self.shift)))
            self.shift += RATE * (float(j < accepted) - predicted)
