"""One proposer for every kind of text: suffix decoding where the text repeats, a model drafter elsewhere,
and no drafts at all where neither pays.

Each round the suffix drafter proposes first (a lookup, microseconds) with its expected number of
surviving drafts (from its learned confidences). The model drafter is asked only when that looks like the
faster round: tokens per second are estimated for both kinds of round as (1 + drafts expected to survive)
/ (the round's cost), the model's drafts kept and verified per round taken from its rounds in this request
(`DraftYield`). A round with the model costs its drafting plus a pass over the drafts the scheduler verifies
(it cuts the model's 7 to 3-4 on average), one without it a one-position pass. Those costs (`RoundCosts`) are
measured once per machine, target and drafter, for greedy and for sampled rounds (at T > 0 the drafter samples
its chain with its q, and every verified position costs its p and the block verification), and cached on disk
(like the SPS(B) table), not timed as rounds go: a choice that followed the clock would make a seeded sampling
run give other tokens on every rerun. On copy-heavy text the suffix wins and the model's drafting pass is saved;
where the model's drafts do not pay for their drafting time, rounds go without it (the suffix's proposal, often
nothing: normal decoding). The model drafts again after `EXPLORE_EVERY` rounds without it, so its estimate stays
current, and each such try that leaves it not paying doubles that wait (`Exploration`, as the drafting gate's).
Both parts observe every round, so each stays in step with the committed text.

Lossless at any temperature: the choice depends only on the context and on earlier rounds, never on the
model's drafts of this round, so whichever proposal is verified was drawn from the q it carries (choosing a
sampled chain by its own tokens would bias the output, as a retrospective scheduler does).
"""

import copy
import itertools
import json
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from specdecode.drafters.base import (
    EMPTY_PROPOSAL,
    Drafter,
    Proposal,
    TargetFeatures,
    cost_digest,
    in_second_round,
)
from specdecode.drafters.suffix import SuffixDrafter, expected_accepted
from specdecode.drafters.yields import DraftYield, Exploration
from specdecode.machine import machine_info, measurement_file, quiet_samples, ratio_medians
from specdecode.models.linear import kernels_digest
from specdecode.models.target import Target
from specdecode.paths import write_text_atomically
from specdecode.sampling import SamplingParams, probabilities
from specdecode.verify import verify_block


@dataclass(frozen=True)
class RoundCosts:
    """Seconds of a target pass over k = 1 .. len(passes) positions (`passes[k - 1]`) and of the model's drafting."""

    passes: tuple[float, ...]
    drafting: float

    @classmethod
    def flat(cls, light_s: float, model_s: float) -> "RoundCosts":
        """A round without the model at `light_s` and one with it at `model_s`, however many drafts are verified."""
        return cls((light_s,), model_s - light_s)

    def light(self) -> float:
        """A round without the model's drafts: a one-position pass (the suffix's drafts, where any, ride along)."""
        return self.passes[0]

    def model(self, verified: float) -> float:
        """A round with the model: its drafting and a pass over the root and `verified` drafts."""
        return self.drafting + self.passes[min(len(self.passes), 1 + round(verified)) - 1]


@dataclass
class SharedEstimates:
    """What every request of a drafter shares: the costs of a round with and without the model drafting, the
    model's drafts kept and verified per round (a new request starts from them, then follows its own text),
    and when the model is tried again."""

    costs: dict[bool, RoundCosts] = field(default_factory=dict)  # by whether the rounds sample (T > 0)
    model_yield: DraftYield = field(default_factory=DraftYield)
    exploration: Exploration = field(default_factory=lambda: Exploration(without=0))


ROUND_COST_SWEEPS = 40  # ~4 s for SmolLM2 and the shipped DSpark on 2 cores, once per machine


def round_costs(
    target: Target, model: Drafter, context: int = 128, reps: int = ROUND_COST_SWEEPS, sampled: bool = False
) -> RoundCosts:
    """Seconds of passes over 1 .. 8 positions and of the model drafting 7 tokens, after `context` tokens: the
    one-position pass's median over `reps` sweeps, the rest at their median ratio to it within a sweep
    (`ratio_medians`). Measured together, once, and cached per machine, target and drafter under
    `$XDG_CACHE_HOME/specdecode/sps/`. Five sweeps of column medians, as before stop 55, spread a model round's
    price widely: on the Zen 3 EPYC a four-position pass came out anywhere from 1.12 to 1.81 one-position passes
    (sd 0.10; 40 sweeps of ratio medians: 1.26-1.55, sd 0.05; 1,400 sweeps together: 1.43), the drafting from
    0.38 to 0.60 (0.46-0.51; 0.49) (results/cost_estimates_ab.md). The cached table then in use said 1.71 and
    0.56; yet the hybrid with those costs ran the mix at 1.24x / 1.05x normal decoding (T = 0 / 1) against 1.21x /
    0.97x with 40 sweeps' (one interleaved run, 20 prompts; results/cost_outlier_ab.md): rounds inside decoding
    cost more than these sweeps say (a model round verifying 3 drafts 1.85-2.15 normal rounds where priced at
    1.78, a suffix round with 1 draft 1.13-1.30 where priced at 1.08; results/round_shapes*.md), and the outlier
    happened to sit nearer. Until stop 45 a model round was priced at a pass over all 8 positions, while the
    prefix scheduler verified 3.8 drafts of its 7 on average at T=0 and 3.0 at T=1. The drafting timed is a
    request's second round (`in_second_round`): timing its first call priced a model round at 2.0x a normal step
    instead of ~1.4x. It follows a one-position pass, which leaves the caches holding the target's weights, not
    the drafter's, as in decoding (drafting after a target pass: 2.2 ms against 1.7 ms right after drafting).
    `sampled`: as rounds at T = 1 cost them, the drafting sampling its chain and each pass followed by p at its
    positions and the block verification of the drafts before them: on the Zen 3 EPYC a model round verifying 3
    drafts costs 2.30 light rounds where the greedy table says 2.05 (results/sampled_costs_ab.md)."""
    key = {
        "passes": list(range(1, 9)),
        "drafting": "alone, second round, after a target pass",
        "target": target.name,
        "kernel": target.kernel,
        "dtype": str(target.dtype),
        "hybrid_round_costs": cost_digest(model),
        "context": context,
        "sweeps": reps,
        "estimate": "ratio medians to a one-position pass",
        "machine": machine_info(),
        "kernels": kernels_digest(),
    }
    if sampled:  # greedy tables keep the key they were cached under
        key["rounds"] = "sampled at T = 1: p and block verification after each pass"
    path = measurement_file("sps", key)
    if path.exists():
        try:
            cached = json.loads(path.read_text())
            return RoundCosts(tuple(cached["passes_s"]), cached["drafting_s"])
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a damaged entry is measured again
    kind = "sampled" if sampled else "greedy"
    print(f"specdecode: measuring a {kind} round's cost with and without the drafter here (once)", file=sys.stderr)
    drafting_s, *passes_s = ratio_medians(round_cost_sweeps(target, model, context, reps, sampled), reference=1)
    text = json.dumps({"key": key, "passes_s": passes_s, "drafting_s": drafting_s}, indent=1) + "\n"
    write_text_atomically(path, text)
    return RoundCosts(tuple(passes_s), drafting_s)


def round_cost_sweeps(
    target: Target, model: Drafter, context: int, reps: int, sampled: bool = False
) -> list[list[float]]:
    """`reps` sweeps of [the model's drafting, a pass over 1, ..., over 8 positions] in seconds, after a warm-up;
    a sweep while other processes were busy is measured again (`quiet_samples`). The target's cache is reset.
    `sampled`: see `round_costs`."""
    ids = [(7 * i) % target.config.vocab_size for i in range(context)]
    target.set_capture_layers(model.target_layer_ids)
    target.reset()
    prefill = target.forward(torch.tensor(ids[:-1]), logits=False)
    features = TargetFeatures(prefill.layer_hidden, prefill.last_hidden)
    seeds = itertools.count()

    def timed(run) -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    params = SamplingParams(temperature=1.0 if sampled else 0.0)
    generator = torch.Generator().manual_seed(0)

    def verified_pass(k: int, drafts: Proposal) -> None:
        """A pass over k positions; sampled, then p there and the block verification of k - 1 drafts (the
        drafter's own, with their q: what a model round verifies)."""
        logits = target.forward(torch.tensor(ids[-k:])).logits
        if sampled:
            part = drafts.prefix(k - 1)
            verify_block(probabilities(logits, params), part.tokens, part.probs, generator, part.support)

    def one_sweep() -> list[float]:
        """Seconds of the drafting (just after a one-position pass, which leaves the caches as a round finds
        them: the target's), then of each pass."""
        drafter = in_second_round(model, ids, features, 7, next(seeds), params)
        target.forward(torch.tensor(ids[-1:]))
        target.rollback(context - 1)
        start = time.perf_counter()
        drafts = drafter.propose(ids, 7)
        seconds = [time.perf_counter() - start]
        for k in range(1, 9):
            seconds.append(timed(lambda k=k: verified_pass(k, drafts)))
            target.rollback(context - 1)
        return seconds

    one_sweep()  # warm-up
    sweeps = quiet_samples(one_sweep, reps)
    target.reset()
    return sweeps


class HybridDrafter(Drafter):
    def __init__(
        self,
        model: Drafter,
        suffix: SuffixDrafter | None = None,
        model_prior: float = 1.0,
        costs: RoundCosts | None = None,
    ) -> None:
        """`model_prior`: drafts per round credited to the model before it has drafted (kept and verified);
        `costs`: of rounds without and with the model's drafting (measured on the target when not given)."""
        self.model, self.suffix = model, suffix or SuffixDrafter()
        self.name = f"suffix+{model.name}"
        self.target_layer_ids = list(model.target_layer_ids)
        self.has_confidences = model.has_confidences
        self.gates_itself = True
        given = {} if costs is None else {False: costs, True: costs}
        self.shared = SharedEstimates(given, DraftYield(kept=model_prior, verified=model_prior))
        self.costs = costs  # of this request's kind of rounds, greedy or sampled (`begin`)
        self._owner: HybridDrafter | None = None  # the instance whose request the parts' state belongs to
        self.model_length: int | None = None  # the model's drafts per round, from the engine's draft length

    def check_target(self, target: Target) -> None:
        self.model.check_target(target)
        self.suffix.check_target(target)
        for sampled in (False, True):  # both measured here, not at a first sampled request
            if sampled not in self.shared.costs:
                self.shared.costs[sampled] = round_costs(target, self.model, sampled=sampled)

    def begin(self, prompt_ids, params: SamplingParams, generator: torch.Generator, features) -> None:
        if self._owner is not self:  # a per-request shallow copy (the continuous engine): parts of its own
            self.model, self.suffix = copy.copy(self.model), copy.copy(self.suffix)
            self._owner = self
        self.model.begin(prompt_ids, params, generator, features)
        self.suffix.begin(prompt_ids, params, generator, features)
        self.model_yield = self.shared.model_yield.prior()  # this request's, from the drafter's mean
        self.model_pending: tuple[int, list[int]] | None = None
        self.model_verified = 0  # of the model's drafts this round, how many the target verifies
        self.model_tried = False  # the model drafts this round only because it was due a try
        self.costs = self.shared.costs[not params.greedy]

    def _wants_model(self, suffix_expected: float) -> bool:
        """Whether a round with the model's drafts is expected to give more tokens per second."""
        shared, expected, costs = self.shared, self.model_yield, self.costs
        self.model_tried = False
        if (1 + expected.kept) / costs.model(expected.verified) > (1 + suffix_expected) / costs.light():
            return True
        self.model_tried = shared.exploration.due()
        return self.model_tried

    def proposal_limit(self, draft_length: int) -> int:
        """The suffix's proposals may run past the draft length; the model keeps to its own limit."""
        self.model_length = self.model.proposal_limit(draft_length)
        return max(self.model_length, self.suffix.proposal_limit(draft_length))

    def _model_tokens(self, max_tokens: int) -> int:
        return max_tokens if self.model_length is None else min(max_tokens, self.model_length)

    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        return self.propose_batch([self], [ids], [max_tokens])[0]

    @classmethod
    def propose_batch(cls, drafters: list[Drafter], ids: list[list[int]], max_tokens: list[int]) -> list[Proposal]:
        """Suffix proposals for every request; one batched model call for the requests that want the model."""
        proposals, wanted = [], []
        for r, (d, context, n) in enumerate(zip(drafters, ids, max_tokens, strict=True)):
            d.model_pending = None
            proposal = d.suffix.propose(context, n) if n > 0 else EMPTY_PROPOSAL
            proposals.append(proposal)
            if n > 0 and d._wants_model(expected_accepted(proposal.confidences) if proposal.length else 0.0):
                wanted.append(r)
        if wanted:
            model = drafters[wanted[0]].model
            limits = [drafters[r]._model_tokens(max_tokens[r]) for r in wanted]
            drafted = type(model).propose_batch([drafters[r].model for r in wanted], [ids[r] for r in wanted], limits)
            for r, proposal in zip(wanted, drafted, strict=True):
                proposals[r] = replace(proposal, source="model")
                drafters[r].model_pending = (len(ids[r]), proposal.tokens.tolist())
                drafters[r].model_verified = proposal.length  # unless the scheduler says fewer
        return proposals

    def scheduled(self, drafts: int) -> None:
        self.model_verified = drafts

    def observe(self, ids: list[int], num_accepted: int, features: TargetFeatures | None) -> None:
        self.model.observe(ids, num_accepted, features)
        self.suffix.observe(ids, num_accepted, features)
        shared, drafted = self.shared, self.model_pending is not None
        if not drafted:
            shared.exploration.skipped()
        else:  # how far the target agreed with the model's drafts that it verified
            shared.exploration.ran(tried=self.model_tried)
            position, tokens = self.model_pending
            tokens = tokens[: self.model_verified]  # the target's own token may match the next: not a kept draft
            kept = 0
            while kept < len(tokens) and position + kept < len(ids) and ids[position + kept] == tokens[kept]:
                kept += 1
            for estimate in (self.model_yield, shared.model_yield):
                estimate.update(len(tokens), kept)

    def forget(self) -> None:
        self.model.forget()
        self.suffix.forget()

    def costliest(self) -> Drafter:
        return self.model

    def end(self, ids: list[int]) -> None:
        self.model.end(ids)
        self.suffix.end(ids)
