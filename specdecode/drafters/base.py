"""The narrow interface every drafter implements.

A drafter proposes up to `max_tokens` next tokens for the committed sequence, either with their draft
distributions q (sampled proposals) or as deterministic guesses (q one-hot); the verifier never learns
how they were made. After each round the drafter is told how many of its tokens survived and gets the
target's features for the positions the target has just committed.
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.linear import FrozenLinear, stable_digest
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams


@dataclass
class Proposal:
    """k draft tokens (k may be 0), for sampled proposals their distributions q (k, V), and where the
    drafter estimates them, confidences: P(token j survives | tokens before it survived). A drafter with a
    reduced vocabulary gives q over it, (k, N), and `support`: the N increasing target ids its columns stand for."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    source: str | None = None  # which proposer of a hybrid made it (kept in the round statistics)
    support: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    def prefix(self, length: int) -> "Proposal":
        """The first `length` drafts: verifying a prefix of a chain keeps verification exact."""
        if length >= self.length:
            return self
        probs, confidences = self.probs, self.confidences
        return Proposal(
            self.tokens[:length],
            None if probs is None else probs[:length],
            None if confidences is None else confidences[:length],
            self.source,
            self.support,
        )


@dataclass
class TargetFeatures:
    """What the target computed for positions it committed: captured layers and final-normed state."""

    layer_hidden: torch.Tensor | None  # (n, n_layers * H)
    last_hidden: torch.Tensor  # (n, H)


def joined_features(parts: list[TargetFeatures]) -> TargetFeatures:
    """Features of consecutive positions, one after another."""
    if len(parts) == 1:
        return parts[0]
    layer_hidden = None if parts[0].layer_hidden is None else torch.cat([p.layer_hidden for p in parts])
    return TargetFeatures(layer_hidden, torch.cat([p.last_hidden for p in parts]))


EMPTY_PROPOSAL = Proposal(tokens=torch.empty(0, dtype=torch.long))


@dataclass
class TreeSettings:
    """EAGLE-2/3 dynamic tree: `steps` drafting steps, `branches` children expanded per step, and the
    best `num_tokens` nodes (by cumulative draft probability) verified. SGLang's Llama defaults."""

    steps: int = 5
    branches: int = 4
    num_tokens: int = 8


@dataclass
class TreeProposal:
    """Draft tokens arranged as a tree rooted at the last committed token.

    `parents[i]` is the index of node i's parent in `tokens`, or -1 for a child of the root; parents
    precede their children. Proposals are deterministic (q one-hot per branch), so verification samples
    the target at each node and follows the child that matches.
    """

    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    def depths(self) -> torch.Tensor:
        """Depth of each node: 1 for children of the root."""
        depth = torch.zeros(self.length, dtype=torch.long)
        for i, parent in enumerate(self.parents.tolist()):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        return depth


class Drafter:
    """Base class: `none` (normal decoding) is this class itself, proposing nothing."""

    name = "none"
    target_layer_ids: list[int] = []  # target layers whose outputs the drafter reads
    has_confidences = False  # proposals carry confidences (what the prefix and threshold schedulers need)
    gates_itself = False  # decides per round whether drafting pays (the hybrid), so one-request decoding adds no gate

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

    def proposal_limit(self, draft_length: int) -> int:
        """The most drafts the next proposal may hold under the engine's `draft_length` (engines ask before
        each `propose`): the same for drafters that pay a pass per draft; lookups, whose drafts are free, may
        run further."""
        return draft_length

    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        """Draft up to `max_tokens` tokens that continue the committed sequence `ids`."""
        return EMPTY_PROPOSAL

    @classmethod
    def propose_batch(cls, drafters: list["Drafter"], ids: list[list[int]], max_tokens: list[int]) -> list[Proposal]:
        """`propose` for many requests at once (`drafters[r]` holds request r's state); drafters whose weights
        can serve a batch in one pass override this."""
        return [d.propose(i, n) for d, i, n in zip(drafters, ids, max_tokens, strict=True)]

    def propose_tree(self, ids: list[int], settings: TreeSettings, max_depth: int) -> TreeProposal:
        """Draft a tree continuing `ids`, no deeper than `max_depth`; only drafters that can branch do this."""
        raise SpecDecodeError(f"the {self.name} drafter cannot draft trees; use chain drafting")

    def scheduled(self, drafts: int) -> None:
        """This round's target pass verifies the first `drafts` of the proposal (the scheduler cut the rest)."""

    def observe(self, ids: list[int], num_accepted: int, features: TargetFeatures | None) -> None:
        """`ids` is the committed sequence after a round in which `num_accepted` drafts survived."""

    def forget(self) -> None:
        """Forget earlier requests' outputs (suffix decoding keeps them for later requests). A benchmark that
        decodes one prompt more than once, or under several settings, calls it before each completion: a
        repeat would otherwise copy its own earlier answer (accepted lengths of 14-17 at T=0)."""

    def costliest(self) -> "Drafter":
        """The drafter whose drafting a step may pay for: this one; one that picks between parts (the hybrid)
        names its costliest, so the drafting gate prices a step that drafts at what it may cost."""
        return self

    def end(self, ids: list[int]) -> None:
        """The completion is over; `ids` is its whole sequence (prompt and output)."""


def cost_digest(drafter: Drafter) -> str:
    """What a drafter's cost depends on: its kind and configuration, those of the drafter it wraps, the
    kernels of its network's linears (and the bytes of the GGUF rows they read), and the drafters' code (every module of
    the package: a faster drafting path, wherever it lives, must be measured again, or the drafting gate keeps
    deciding on the old cost)."""
    parts = []
    while isinstance(drafter, Drafter):
        config = getattr(drafter, "config", None)
        parts.append([drafter.name, config.to_dict() if hasattr(config, "to_dict") else None])
        drafter = getattr(drafter, "model", None)
    if isinstance(drafter, torch.nn.Module):
        linears = [m.linear for m in drafter.modules() if isinstance(m, FrozenLinear)]
        rows = [0 if lin.blocks is None else lin.blocks.shape[1] * 32 // lin.weight.shape[1] for lin in linears]
        parts.append(sorted({(k, r) for lin, r in zip(linears, rows, strict=True) for k in lin.plan.values()}))
    code = [source.read_text() for source in sorted(Path(__file__).parent.glob("*.py"))]
    return stable_digest([parts, code])


def in_second_round(
    drafter: Drafter,
    ids: list[int],
    features: TargetFeatures,
    draft_length: int,
    seed: int,
    params: SamplingParams | None = None,
) -> Drafter:
    """A copy of `drafter` holding a request in its second round: begun on `ids[:-3]`, it proposed once and saw
    two drafts and the target's token committed (`ids`; `features` cover `ids[:-1]`). Drafting costs are timed
    on such a copy: a request's first call also projects its whole prompt's target features (DSpark: 127 rows,
    ~2.6 ms of ~4.3 ms on a 2-core EPYC), paid once per request, and a later call projects the last round's."""

    def rows(part: slice) -> TargetFeatures:
        layer_hidden = None if features.layer_hidden is None else features.layer_hidden[part]
        return TargetFeatures(layer_hidden, features.last_hidden[part])

    state = copy.copy(drafter)
    prompt = ids[:-3]
    state.begin(prompt, params or SamplingParams(), torch.Generator().manual_seed(seed), rows(slice(-3)))
    state.propose(prompt, draft_length)
    state.observe(ids, 2, rows(slice(-3, None)))
    return state
