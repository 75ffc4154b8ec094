"""The one-request speculative decoding loop: draft, verify in one pass, accept, roll back, repeat.

Invariant: the target's KV cache holds every committed token but the last one. Each round feeds that
last token plus the k drafts (k + 1 positions, one pass), so normal decoding is the same loop with k = 0.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.drafters.base import EMPTY_PROPOSAL, Drafter, TargetFeatures
from specdecode.engine.stats import DecodeStats
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams, probabilities
from specdecode.verify import verify_chain, verify_greedy


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: DecodeStats = field(default_factory=DecodeStats)


class SpeculativeDecoder:
    """Runs one target and one drafter; `drafter=Drafter()` is normal decoding."""

    def __init__(self, target: Target, drafter: Drafter, draft_length: int = 8) -> None:
        if draft_length < 0:
            raise SpecDecodeError(f"draft length must be >= 0, got {draft_length}")
        drafter.check_target(target)
        self.target = target
        self.drafter = drafter
        self.draft_length = draft_length

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
        text, streamed, finish = "", "", "length"
        while len(ids) - len(prompt_ids) < limit:
            room = limit - (len(ids) - len(prompt_ids)) - 1  # drafts beyond the limit would be wasted
            t0 = time.perf_counter()
            proposal = drafter.propose(ids, min(self.draft_length, room)) if room > 0 else EMPTY_PROPOSAL
            t1 = time.perf_counter()
            out = target.forward(torch.cat([torch.tensor(ids[-1:]), proposal.tokens]))
            if params.greedy:
                result = verify_greedy(out.logits.argmax(-1).cpu(), proposal.tokens)
            else:
                p = probabilities(out.logits, params).cpu()
                result = verify_chain(p, proposal.tokens, proposal.probs, generator)
            target.rollback(len(ids) + result.num_accepted)
            t2 = time.perf_counter()
            stats.record_round(proposal.length, result.num_accepted)
            new = result.tokens[: limit - (len(ids) - len(prompt_ids))]
            hit_eos = next((j for j, t in enumerate(new) if t in eos), None)
            if hit_eos is not None:
                new = new[: hit_eos + 1]
            ids += new
            kept = result.num_accepted + 1
            drafter.observe(
                ids,
                result.num_accepted,
                TargetFeatures(None if out.layer_hidden is None else out.layer_hidden[:kept], out.last_hidden[:kept]),
            )
            stats.draft_s += (t1 - t0) + (time.perf_counter() - t2)
            stats.verify_s += t2 - t1
            text, stopped = _visible_text(target.tokenizer, ids[len(prompt_ids) :], stop)
            if stopped or hit_eos is not None:
                finish = "stop"
                break
            if emit:
                shown = _stream_safe(text, stop)
                if len(shown) > len(streamed):
                    emit(shown[len(streamed) :])
                    streamed = shown
        if emit and len(text) > len(streamed):
            emit(text[len(streamed) :])
        generated = ids[len(prompt_ids) :]
        stats.new_tokens = len(generated)
        stats.wall_s = time.perf_counter() - start
        return Completion(token_ids=generated, text=text, finish_reason=finish, stats=stats)


def _visible_text(tokenizer, generated: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
    """The completion's text, cut before the first stop string; and whether one was found."""
    text = tokenizer.decode(generated, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _stream_safe(text: str, stop: tuple[str, ...]) -> str:
    """What may be streamed now: hold back a partial UTF-8 character and a possible stop-string start."""
    hold = max((len(s) - 1 for s in stop), default=0)
    shown = text[: len(text) - hold] if hold else text
    return shown.rstrip("\ufffd")
