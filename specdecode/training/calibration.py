"""Sequential Temperature Scaling (STS) of DSpark's confidence head, and the measures that judge it.

The scheduler turns confidences into expected accepted tokens, so their *cumulative products* must be
calibrated, not just ranked: a_k = prod_{i<=k} sigmoid(z_i / T_i + b_i) should equal the frequency with
which drafts 1..k all survive. STS fits T_1, T_2, ... left to right, each by a grid search minimising the
expected calibration error of a_k with the earlier positions held fixed (DSpark paper, section 3.2.1).
The paper's map has no bias b_i; ours adds one because a temperature only stretches logits around 0: a
head whose logits sit below 0 yet overstate survival on average (ours at position 1: 0.37 predicted, 0.30
observed) cannot be mended by any T, while a shift can. b_i = 0 is the paper's STS.

The data are real decoding rounds: the drafter's raw confidence logits and how many drafts the target
accepted, recorded by `RoundRecorder` while the ordinary engine decodes held-out prompts.
"""

import math
from dataclasses import dataclass, field

import torch

from specdecode.drafters.base import Drafter, Proposal, TargetFeatures
from specdecode.drafters.dspark import calibrated_confidence
from specdecode.errors import SpecDecodeError
from specdecode.sampling import SamplingParams

ECE_BINS = 20  # equal-width bins, as DeepSpec's evaluator uses
# 0.1 .. 10, 1.5% apart; logit shifts 0.02 apart. A shift of 0.1 moves a survival near 0.45 by 2.5 points, so the
# coarser grids of stops 40-48 (81 temperatures, shifts 0.1 apart) could not bring position 1's mean onto its
# rate: fit on 43,500 rounds, they reported ECE 1.76 / 1.17% at positions 1-2 where these grids give 1.01 / 1.01%
TEMPERATURE_GRID = torch.logspace(-1, 1, 161, dtype=torch.float64)
BIAS_GRID = torch.linspace(-2, 2, 201, dtype=torch.float64)


@dataclass
class Rounds:
    """Recorded rounds: confidence logits (N, gamma) with NaN past each proposal, and accepted drafts (N,)."""

    logits: torch.Tensor
    accepted: torch.Tensor

    def labels(self) -> torch.Tensor:
        """(N, gamma): 1 where drafts 1..k all survived, NaN where draft k was not proposed."""
        k = torch.arange(1, self.logits.shape[1] + 1, dtype=torch.float64)
        survived = (self.accepted[:, None] >= k).double()
        return torch.where(self.logits.isnan(), torch.nan, survived)

    def split(self, every: int = 2) -> tuple["Rounds", "Rounds"]:
        """Interleaved halves (fit, report): neighbouring rounds of one prompt land on both sides."""
        fit = torch.arange(len(self.accepted)) % every != 0
        return Rounds(self.logits[fit], self.accepted[fit]), Rounds(self.logits[~fit], self.accepted[~fit])


class RoundRecorder(Drafter):
    """Wraps a drafter with a confidence head; records (raw confidence logits, accepted count) per round."""

    def __init__(self, inner: Drafter, gamma: int) -> None:
        self.inner, self.gamma = inner, gamma
        self.name, self.target_layer_ids = inner.name, inner.target_layer_ids
        # plain floats, not a small tensor per round: thousands of long-lived small allocations between a
        # pass's large transient ones fragmented the heap (at the 421st of 600 prompts: 23 GB resident)
        self.logits: list[list[float]] = []
        self.accepted: list[int] = []
        self._pending: list[float] | None = None

    def check_target(self, target) -> None:
        self.inner.check_target(target)

    def begin(self, prompt_ids, params: SamplingParams, generator, features) -> None:
        self.inner.begin(prompt_ids, params, generator, features)

    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        proposal = self.inner.propose(ids, max_tokens)
        if proposal.length and proposal.confidences is None:
            raise SpecDecodeError(f"the {self.name} drafter has no confidence head to calibrate")
        if proposal.length:
            logits = torch.logit(proposal.confidences.double(), eps=1e-12).tolist()
            self._pending = logits + [math.nan] * (self.gamma - len(logits))
        else:
            self._pending = None
        return proposal

    def observe(self, ids: list[int], num_accepted: int, features: TargetFeatures | None) -> None:
        if self._pending is not None:
            self.logits.append(self._pending)
            self.accepted.append(num_accepted)
        self.inner.observe(ids, num_accepted, features)

    def rounds(self) -> Rounds:
        if not self.logits:
            raise SpecDecodeError("no drafting rounds were recorded")
        return Rounds(torch.tensor(self.logits, dtype=torch.float64), torch.tensor(self.accepted, dtype=torch.float64))


def cumulative_confidence(
    logits: torch.Tensor, temperatures: list[float] | torch.Tensor, biases: list[float] | torch.Tensor = ()
) -> torch.Tensor:
    """a_k = prod_{i<=k} c_i; NaN past each proposal stays NaN."""
    return torch.cumprod(calibrated_confidence(logits, temperatures, biases), dim=-1)


def expected_calibration_error(predicted: torch.Tensor, label: torch.Tensor, bins: int = ECE_BINS) -> float:
    """sum over equal-width bins of (bin share) x |mean prediction - mean outcome| (Naeini et al. 2015)."""
    keep = ~(predicted.isnan() | label.isnan())
    predicted, label = predicted[keep], label[keep]
    if predicted.numel() == 0:
        return float("nan")
    index = (predicted * bins).long().clamp(0, bins - 1)
    count = torch.bincount(index, minlength=bins).double()
    gap = torch.bincount(index, predicted, bins) - torch.bincount(index, label, bins)
    return float(gap.abs().sum() / count.sum())


def calibrated_ece_floor(predicted: torch.Tensor, draws: int = 200, seed: int = 0) -> float:
    """The ECE a perfectly calibrated predictor shows on these rounds: labels drawn as Bernoulli(predicted).

    With a few hundred rounds per bin the binned ECE of even a perfect predictor is a few percent (sampling
    noise), so a measured ECE means little without this reference next to it."""
    predicted = predicted[~predicted.isnan()]
    if predicted.numel() == 0:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    return (
        sum(expected_calibration_error(predicted, torch.bernoulli(predicted, generator=g)) for _ in range(draws))
        / draws
    )


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """P(score of a survivor > score of a failure), ties counting half (the Mann-Whitney statistic)."""
    keep = ~(score.isnan() | label.isnan())
    score, label = score[keep], label[keep].bool()
    positives, negatives = int(label.sum()), int((~label).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    values, inverse, counts = torch.unique(score, return_inverse=True, return_counts=True)
    first_rank = torch.cumsum(counts, 0) - counts + 1  # ranks from 1; ties share their average rank
    average_rank = (first_rank + (counts - 1) / 2.0)[inverse].double()
    return float((average_rank[label].sum() - positives * (positives + 1) / 2) / (positives * negatives))


@dataclass
class CalibrationFit:
    temperatures: list[float]
    biases: list[float]
    grid: list[float] = field(default_factory=lambda: TEMPERATURE_GRID.tolist())
    bias_grid: list[float] = field(default_factory=lambda: BIAS_GRID.tolist())


def fit_sequential_temperatures(
    rounds: Rounds, grid: torch.Tensor = TEMPERATURE_GRID, bias_grid: torch.Tensor = BIAS_GRID
) -> CalibrationFit:
    """STS: for k = 1..gamma, the grid (T_k, b_k) that minimises the ECE of a_k, earlier positions held fixed.

    `bias_grid=torch.zeros(1)` is the paper's temperature-only STS."""
    labels = rounds.labels()
    gamma = rounds.logits.shape[1]
    temperatures = torch.ones(gamma, dtype=torch.float64)
    biases = torch.zeros(gamma, dtype=torch.float64)
    t_grid, b_grid = (x.flatten() for x in torch.meshgrid(grid, bias_grid, indexing="ij"))
    # a flat minimum (no evidence either way) keeps the map nearest the identity
    distance = t_grid.log().abs() + b_grid.abs()
    survived_before = torch.ones(len(rounds.accepted), dtype=torch.float64)  # a_{k-1}
    for k in range(gamma):
        if labels[:, k].isnan().all():
            break  # no proposal ever reached this position: leave it (and later ones) at the identity
        z = rounds.logits[:, k]
        errors = torch.tensor(
            [
                expected_calibration_error(survived_before * torch.sigmoid(z / t + b), labels[:, k])
                for t, b in zip(t_grid, b_grid, strict=True)
            ]
        )
        best = (errors <= errors.min() + 1e-12).nonzero().flatten()
        choice = best[distance[best].argmin()]
        temperatures[k], biases[k] = t_grid[choice], b_grid[choice]
        survived_before = survived_before * torch.sigmoid(z / temperatures[k] + biases[k])
    return CalibrationFit(
        temperatures=temperatures.tolist(), biases=biases.tolist(), grid=grid.tolist(), bias_grid=bias_grid.tolist()
    )


def per_position_report(rounds: Rounds, temperatures: list[float], biases: list[float] = ()) -> list[dict]:
    """ECE before (raw confidences) and after, the ECE floor of a perfect predictor, AUROC, Brier score and
    counts for each draft position."""
    labels = rounds.labels()
    before = cumulative_confidence(rounds.logits, [])
    after = cumulative_confidence(rounds.logits, temperatures, biases)
    report = []
    for k in range(rounds.logits.shape[1]):
        valid = ~labels[:, k].isnan()
        report.append(
            {
                "position": k + 1,
                "rounds": int(valid.sum()),
                "survival_rate": float(labels[valid, k].mean()) if valid.any() else float("nan"),
                "mean_predicted_before": float(before[valid, k].mean()) if valid.any() else float("nan"),
                "mean_predicted_after": float(after[valid, k].mean()) if valid.any() else float("nan"),
                "ece_before": expected_calibration_error(before[:, k], labels[:, k]),
                "ece_after": expected_calibration_error(after[:, k], labels[:, k]),
                "ece_floor": calibrated_ece_floor(after[valid, k]),
                "auroc": auroc(after[:, k], labels[:, k]),
                "brier_after": float(((after[valid, k] - labels[valid, k]) ** 2).mean())
                if valid.any()
                else float("nan"),
                "temperature": temperatures[k],
                "bias": biases[k] if len(biases) else 0.0,
            }
        )
    return report


def reliability_curve(predicted: torch.Tensor, label: torch.Tensor, bins: int = 10) -> tuple[list, list, list]:
    """(mean prediction, observed frequency, count) per non-empty bin, for the reliability diagram."""
    keep = ~(predicted.isnan() | label.isnan())
    predicted, label = predicted[keep], label[keep]
    index = (predicted * bins).long().clamp(0, bins - 1)
    count = torch.bincount(index, minlength=bins)
    mean_pred = torch.bincount(index, predicted, bins) / count.clamp_min(1)
    mean_label = torch.bincount(index, label, bins) / count.clamp_min(1)
    nonempty = count > 0
    return mean_pred[nonempty].tolist(), mean_label[nonempty].tolist(), count[nonempty].tolist()
