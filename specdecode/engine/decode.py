"""The one-request speculative decoding loop: draft, verify in one pass, accept, roll back, repeat.

Invariant: the target's KV cache holds every committed token but the last one. Each round feeds that
last token plus the k drafts (k + 1 positions, one pass), so normal decoding is the same loop with k = 0.
In tree mode the drafts form a tree rooted at that last token: one pass with a tree attention mask
verifies every node, and only the accepted path's KV entries stay in the cache.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal, TargetFeatures, TreeProposal, TreeSettings
from specdecode.engine.detokenize import IncrementalText
from specdecode.engine.drafting_gate import DraftingGate, profile_drafting
from specdecode.engine.scheduler import SCHEDULER_MODES, has_confidences, schedule
from specdecode.engine.stats import DecodeStats
from specdecode.errors import SpecDecodeError
from specdecode.models.sps import profile_target
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams, greedy_tokens, probabilities
from specdecode.verify import ChainResult, verify_block, verify_greedy, verify_tree, verify_tree_greedy


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: DecodeStats = field(default_factory=DecodeStats)


class SpeculativeDecoder:
    """Runs one target and one drafter; `drafter=Drafter()` is normal decoding; `tree` switches to tree drafts."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        draft_length: int = 8,
        tree: TreeSettings | None = None,
        scheduler: str = "fixed",
        threshold: float = 0.5,
        gate: bool = True,
    ) -> None:
        """`scheduler` decides how many of a chain's drafts are verified: `fixed` (all, up to draft_length),
        `prefix` (DSpark's Algorithm 1 on this machine's SPS(B) table; with `gate`, rounds whose drafting is
        not expected to pay go without it, `engine/drafting_gate.py`, unless the drafter makes that choice
        itself, as the hybrid does with its own measured round costs) or `threshold` (up to the first draft
        whose confidence is below `threshold`); the last two need a drafter with a confidence head."""
        if draft_length < 0:
            raise SpecDecodeError(f"draft length must be >= 0, got {draft_length}")
        if tree is not None:
            check_tree_settings(tree)
        if scheduler not in SCHEDULER_MODES:
            raise SpecDecodeError(f"unknown scheduler '{scheduler}'; choose one of {', '.join(SCHEDULER_MODES)}")
        if scheduler != "fixed" and (tree is not None or not has_confidences(drafter)):
            raise SpecDecodeError(f"the '{scheduler}' scheduler needs chain drafting by a drafter with confidences")
        drafter.check_target(target)
        self.target = target
        self.drafter = drafter
        self.draft_length = draft_length
        self.tree = tree
        self.scheduler, self.threshold = scheduler, threshold
        costs = profile_target(target) if scheduler == "prefix" else None
        self.steps_per_s = costs.steps_per_s if costs else None
        self.gate: DraftingGate | None = None
        if costs and gate and not drafter.gates_itself:
            drafting = profile_drafting(target, drafter, 1, draft_length)
            self.gate = DraftingGate(costs.step_seconds, drafting.step_seconds)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise SpecDecodeError("the prompt is empty")
        if len(prompt_ids) >= self.target.max_context:
            raise SpecDecodeError(
                f"the prompt has {len(prompt_ids)} tokens but {self.target.name}'s context holds "
                f"{self.target.max_context}: shorten the prompt"
            )

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int = 128,
        seed: int = 0,
        stop: tuple[str, ...] = (),
        num_samples: int = 1,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[Completion]:
        """`num_samples` independent completions; the prompt is prefilled once and the cache rolled back."""
        self.check_prompt(prompt_ids)
        if max_new_tokens < 1:
            raise SpecDecodeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if num_samples < 1:
            raise SpecDecodeError(f"num_samples must be >= 1, got {num_samples}")
        generator = torch.Generator().manual_seed(seed)
        start = time.perf_counter()
        self.target.set_capture_layers(self.drafter.target_layer_ids)  # decoders may share one target
        self.target.reset()
        prefill = self.target.forward(torch.tensor(prompt_ids[:-1]), logits=False) if len(prompt_ids) > 1 else None
        prefill_s = time.perf_counter() - start
        features = None if prefill is None else TargetFeatures(prefill.layer_hidden, prefill.last_hidden)
        completions = []
        for i in range(num_samples):
            self.target.rollback(len(prompt_ids) - 1)
            emit = (lambda text, i=i: on_text(i, text)) if on_text else None
            completion = self._complete(prompt_ids, params, max_new_tokens, generator, stop, features, emit)
            completion.stats.prefill_s = prefill_s if i == 0 else 0.0
            completion.stats.wall_s += completion.stats.prefill_s
            completions.append(completion)
        return completions

    def _complete(self, prompt_ids, params, max_new_tokens, generator, stop, features, emit) -> Completion:
        target, drafter, stats = self.target, self.drafter, DecodeStats()
        start = time.perf_counter()
        ids = list(prompt_ids)
        limit = min(max_new_tokens, target.max_context - len(prompt_ids))
        eos = target.eos_token_ids
        drafter.begin(ids, params, generator, features)
        detok, streamed, finish = IncrementalText(target.tokenizer, stop), "", "length"
        request_yield = self.gate.new_request() if self.gate else None
        while len(ids) - len(prompt_ids) < limit:
            room = limit - (len(ids) - len(prompt_ids)) - 1  # drafts beyond the limit would be wasted
            drafting = self.gate.choose([request_yield])[0] if self.gate else True
            t0 = time.perf_counter()
            proposal = self._propose(ids, room if drafting else 0)
            drafter.scheduled(proposal.length)
            t1 = time.perf_counter()
            result, kept_features = self._verify(ids, proposal, params, generator)
            t2 = time.perf_counter()
            if self.gate:
                if drafting:
                    self.gate.observe(request_yield, proposal.length, result.num_accepted)
                self.gate.stepped(drafting)
            stats.record_round(_draft_depth(proposal), result.num_accepted, getattr(proposal, "source", None))
            new = result.tokens[: limit - (len(ids) - len(prompt_ids))]
            hit_eos = next((j for j, t in enumerate(new) if t in eos), None)
            if hit_eos is not None:
                new = new[: hit_eos + 1]
            ids += new
            drafter.observe(ids, result.num_accepted, kept_features)
            stats.draft_s += (t1 - t0) + (time.perf_counter() - t2)
            stats.verify_s += t2 - t1
            detok.extend(new)
            if detok.stop_at is not None or hit_eos is not None:
                finish = "stop"
                break
            if emit:
                shown = stream_safe(detok.visible(), stop)
                if len(shown) > len(streamed):
                    emit(shown[len(streamed) :])
                    streamed = shown
        drafter.end(ids)
        text = detok.visible(final=True)
        if emit and len(text) > len(streamed):
            emit(text[len(streamed) :])
        generated = ids[len(prompt_ids) :]
        stats.new_tokens = len(generated)
        stats.wall_s = time.perf_counter() - start
        return Completion(token_ids=generated, text=text, finish_reason=finish, stats=stats)

    def _propose(self, ids: list[int], room: int) -> Proposal | TreeProposal:
        """A chain of at most `draft_length` drafts (a lookup's may run further), or a tree; none when no draft
        could be committed."""
        if self.tree is not None:
            return self.drafter.propose_tree(ids, self.tree, max_depth=room) if room > 0 else EMPTY_PROPOSAL
        # a limit of 0 drafts nothing and keeps the drafter in step
        proposal = self.drafter.propose(ids, max(0, min(self.drafter.proposal_limit(self.draft_length), room)))
        if self.scheduler == "fixed" or not proposal.length:
            return proposal
        rate = self.gate.step_rate(1) if self.gate else self.steps_per_s
        (n,) = schedule(self.scheduler, [proposal.confidences], [proposal.length], rate, self.threshold)
        return proposal.prefix(n)

    def _verify(
        self, ids: list[int], proposal: Proposal | TreeProposal, params: SamplingParams, generator: torch.Generator
    ) -> tuple[ChainResult, TargetFeatures]:
        """One target pass over the last committed token and the drafts; accept; keep the accepted KV only.

        Returns the result and the target's features of the kept positions (the root, then the accepted drafts).
        """
        target, tree = self.target, isinstance(proposal, TreeProposal)
        start = len(ids) - 1  # the root's position: the cache holds every committed token but the last
        mask, positions = tree_attention(proposal.parents, start, target.device) if tree else (None, None)
        out = target.forward(
            torch.cat([torch.tensor(ids[-1:]), proposal.tokens]), position_ids=positions, attention_mask=mask
        )
        if params.greedy:
            argmax = greedy_tokens(out.logits).cpu()
            result = verify_tree_greedy(argmax, proposal) if tree else verify_greedy(argmax, proposal.tokens)
        elif tree:
            result = verify_tree(probabilities(out.logits, params).cpu(), proposal, generator)
        else:
            result = verify_block(
                probabilities(out.logits, params).cpu(), proposal.tokens, proposal.probs, generator, proposal.support
            )
        path = result.path if tree else range(result.num_accepted)
        rows = [0] + [node + 1 for node in path]
        target.keep_path(start, rows)
        index = torch.tensor(rows, device=out.last_hidden.device)
        layer_hidden = None if out.layer_hidden is None else out.layer_hidden.index_select(0, index)
        return result, TargetFeatures(layer_hidden, out.last_hidden.index_select(0, index))


def check_tree_settings(tree: TreeSettings) -> None:
    """Raise on settings that would draft no tree; the CLI calls this before loading anything."""
    if min(tree.steps, tree.branches, tree.num_tokens) < 1:
        raise SpecDecodeError(
            f"tree steps, branches and tokens must all be >= 1, got {tree.steps},{tree.branches},{tree.num_tokens}"
        )


def tree_attention(
    parents: torch.Tensor, start: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-D boolean mask (1, 1, N+1, start+N+1) and positions (1, N+1) of a tree pass over root + N nodes.

    Each row sees the whole cache (`start` committed positions), the root, its ancestors and itself, so a
    node's hidden state is what a plain causal pass over its root-to-node path computes; its position is
    the root's (`start`) plus its depth. True means "may attend", which HF passes to SDPA as it is.
    """
    n = parents.numel()
    seen = torch.eye(n + 1, dtype=torch.bool)
    for i, parent in enumerate(parents.tolist()):
        if not -1 <= parent < i:
            raise SpecDecodeError(f"tree node {i} has parent {parent}: parents must precede their children")
        seen[i + 1] |= seen[parent + 1]  # the parent's row already holds the root and the parent's ancestors
    mask = torch.cat([torch.ones(n + 1, start, dtype=torch.bool), seen], dim=1)
    positions = start + seen.sum(dim=1) - 1  # depth: the number of ancestors, root included
    return mask[None, None].to(device), positions[None].to(device)


def _draft_depth(proposal: Proposal | TreeProposal) -> int:
    """Draft positions a round could fill: a chain's length or a tree's depth (its per-position statistics)."""
    if isinstance(proposal, TreeProposal):
        return int(proposal.depths().max()) if proposal.length else 0
    return proposal.length


def stream_safe(text: str, stop: tuple[str, ...]) -> str:
    """What may be streamed now: hold back a partial UTF-8 character and a possible stop-string start."""
    hold = max((len(s) - 1 for s in stop), default=0)
    shown = text[: len(text) - hold] if hold else text
    return shown.rstrip("\ufffd")
