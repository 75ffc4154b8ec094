"""Continuous batching: many requests share the target, one batched verify pass per step.

The loop runs on the caller's thread (`drive`, what the server, regeneration and the serving bench use) or
on a background thread (`start`). Stepping on the thread that loaded the model is what is fast on a CPU:
OpenMP gives each thread that starts parallel work its own pool of workers, and once the process holds more
pool threads than cores, libgomp lets idle workers spin only ~100 times before sleeping, so every parallel
region of every kernel pays a futex wake-up (measured on a 2-core EPYC: one-row decode step 15 ms on the main
thread, 39 ms on a second thread; 64 rows 114 against 169 ms).

Between steps, queued requests join while KV slots are free (their prompt is prefilled in its own pass, less
the start that a free slot still holds from an earlier request: prefix reuse, `engine/batch.py`) and finished
or cancelled ones leave and free their slot. Each step:
every running request's drafter proposes (in one batched call where the drafter has one), unless the
drafting gate (`engine/drafting_gate.py`, with the prefix scheduler) predicts that drafting will not pay
this step; the scheduler (`engine/scheduler.py`) decides how many drafts of each to verify, counting the
step's drafting time in its cost; one batched pass (`engine/batch.py`)
verifies them all; each request accepts with its own sampling settings and seed, commits, streams its new
text and records its round. Per request the loop is the one of `engine/decode.py` (same limit, EOS, stop
strings, streaming), so at temperature 0 a request's tokens are normal greedy decoding's, whatever else
shares its passes.

Drafters keep a request's state in attributes that `begin()` sets, so each request gets a shallow copy of
the engine's drafter: its own state, the same weights.
"""

import copy
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from specdecode.drafters.base import Drafter, Proposal, TargetFeatures, joined_features
from specdecode.drafters.yields import DraftYield
from specdecode.engine.batch import BatchedTarget, VerifyRow, profile_batched_pass, verify_batch
from specdecode.engine.decode import Completion, stream_safe
from specdecode.engine.detokenize import IncrementalText
from specdecode.engine.drafting_gate import DraftingGate, profile_drafting
from specdecode.engine.metrics import EngineMetrics
from specdecode.engine.scheduler import SCHEDULER_MODES, has_confidences, schedule
from specdecode.engine.stats import DecodeStats
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    """`max_batch` KV slots of `max_len` tokens each (prompt + completion); the verify length per request is
    at most `draft_length` (a lookup drafter's may run further), cut further by the scheduler."""

    max_batch: int = 8
    max_len: int = 2048
    draft_length: int = 7
    scheduler: str = "fixed"  # prefix | threshold | fixed
    threshold: float = 0.5
    gate: bool = True  # with the prefix scheduler: skip drafting in steps where it is not expected to pay
    prefix_caching: bool = True  # a prompt's prefill skips the start a KV slot holds (engine/batch.py)


class RequestHandle:
    """The caller's side of a request. `on_text(delta)`, `on_round(round)` and `on_done(completion or error)`
    run on the engine thread, so they must return quickly (the server hands them to its event loop).

    A round is {"accepted": drafts kept, "spans": [[end, source], ...]}: the round's tokens as character
    offsets into the completion's text (decoded so far, before stop strings are cut) and where each came
    from, source j >= 1 for the draft accepted at position j and 0 for the target's own token."""

    def __init__(
        self,
        request_id: int,
        on_text: Callable[[str], None] | None,
        on_done: Callable[[Completion | Exception], None] | None,
        on_round: Callable[[dict], None] | None = None,
    ) -> None:
        self.id = request_id
        self.on_text = on_text
        self.on_done = on_done
        self.on_round = on_round
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.time_to_first_token_s: float | None = None
        self.completion: Completion | None = None
        self.error: Exception | None = None
        self._done = threading.Event()

    def cancel(self) -> None:
        """Stop generating (a client went away); the slot is freed before the next step."""
        self.cancelled = True

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.completion

    def finish(self, outcome: Completion | Exception) -> None:
        if isinstance(outcome, Exception):
            self.error = outcome
        else:
            self.completion = outcome
        self._done.set()
        if self.on_done:
            self.on_done(outcome)


@dataclass
class _Request:
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    seed: int
    speculate: bool = True  # False: this request verifies no drafts (normal decoding inside the batch)


@dataclass
class _Sequence:
    """A running request: its slot, committed tokens, drafter copy and what it has streamed."""

    request: _Request
    slot: int
    ids: list[int]
    drafter: Drafter
    generator: torch.Generator
    stats: DecodeStats
    started: float
    detok: IncrementalText
    drafting: DraftYield
    streamed: str = ""
    last_emit: float = 0.0
    finished: bool = False

    @property
    def generated(self) -> int:
        return len(self.ids) - len(self.request.prompt_ids)


class ContinuousEngine:
    """Owns the target while it runs (its KV slots and its hidden-state capture)."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter,
        config: EngineConfig = EngineConfig(),
        steps_per_s: Callable[[int], float] | None = None,
        draft_s: Callable[[int], float] | None = None,
    ) -> None:
        """`steps_per_s(B)` and `draft_s(R)`: the measured cost tables of the prefix scheduler and the drafting
        gate (profiled on this machine and cached when not given)."""
        if config.scheduler not in SCHEDULER_MODES:
            raise SpecDecodeError(f"unknown scheduler '{config.scheduler}'; choose one of {', '.join(SCHEDULER_MODES)}")
        if config.scheduler != "fixed" and not has_confidences(drafter):
            raise SpecDecodeError(
                f"the '{config.scheduler}' scheduler needs a drafter with a confidence head (DSpark); "
                f"the {drafter.name} drafter only supports --scheduler fixed"
            )
        if config.draft_length < 0:
            raise SpecDecodeError(f"draft length must be >= 0, got {config.draft_length}")
        drafter.check_target(target)
        self.target, self.drafter, self.config = target, drafter, config
        # a drafter of target features needs them at every prompt position: prefix reuse keeps them beside the cache
        self._with_features = bool(drafter.target_layer_ids)
        keep_features = config.prefix_caching and self._with_features
        self.batched = BatchedTarget(target, config.max_batch, config.max_len, keep_features)
        target.set_capture_layers(drafter.target_layer_ids)
        if config.scheduler == "prefix" and steps_per_s is None:
            max_tokens = config.max_batch * (1 + config.draft_length)
            steps_per_s = profile_batched_pass(self.batched, max_tokens=max_tokens).steps_per_s
        self.steps_per_s = steps_per_s
        self.gate: DraftingGate | None = None
        if config.scheduler == "prefix" and config.gate:
            if draft_s is None:
                draft_s = profile_drafting(target, drafter, config.max_batch, config.draft_length).step_seconds
            self.gate = DraftingGate(lambda b: 1.0 / steps_per_s(b), draft_s)
        self.metrics = EngineMetrics()
        self.metrics.kv_cache_bytes = self.batched.nbytes
        self._ids = itertools.count()
        self._queue: deque[_Request] = deque()
        self._running: list[_Sequence] = []
        self._cond = threading.Condition()
        self._closing = False
        self._looping = False  # a thread runs (or is about to run) the loop
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- caller side (any thread)
    def start(self) -> None:
        """Run the loop on a background thread; nothing to do where `drive` runs it."""
        with self._cond:
            if self._looping:
                return
            self._looping = True
        self._thread = threading.Thread(target=self._loop, name="specdecode-engine", daemon=True)
        self._thread.start()

    def drive(self, work: Callable[[], T]) -> T:
        """Run `work()` on a helper thread while this thread runs the loop (see the module docstring for why);
        when it returns, drain the requests left and return its result, or raise its exception."""
        with self._cond:
            if self._looping:
                raise SpecDecodeError("the engine loop is already running")
            self._looping = True
        outcome: dict = {}

        def helper() -> None:
            try:
                outcome["result"] = work()
            except BaseException as error:  # handed to the driving thread
                outcome["error"] = error
            finally:
                self.stop(drain="error" not in outcome)

        thread = threading.Thread(target=helper, name="specdecode-work", daemon=True)
        thread.start()
        self._loop()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; with `drain`, finish the queued and running ones first, else cancel them. A
        loop on another thread gives the KV slots back when it ends."""
        with self._cond:
            self._closing = True
            if not drain:
                for request in self._queue:
                    request.handle.cancel()
                for sequence in self._running:
                    sequence.request.handle.cancel()
            self._cond.notify_all()
            looping = self._looping
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if not looping:
            self.batched.close()

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise `SpecDecodeError` for a request that no slot could ever hold."""
        if prompt_tokens < 1:
            raise SpecDecodeError("the prompt is empty")
        if max_tokens < 1:
            raise SpecDecodeError(f"max_tokens must be >= 1, got {max_tokens}")
        if prompt_tokens + max_tokens > self.config.max_len:
            raise SpecDecodeError(
                f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}, but a request may hold "
                f"at most {self.config.max_len} tokens in all: shorten the prompt or lower max_tokens"
            )

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        stop: tuple[str, ...] = (),
        seed: int = 0,
        on_text: Callable[[str], None] | None = None,
        on_done: Callable[[Completion | Exception], None] | None = None,
        on_round: Callable[[dict], None] | None = None,
        speculate: bool = True,
        front: bool = False,
    ) -> RequestHandle:
        """Queue a request; it joins the running batch when a slot is free. Raises for one that can never fit.
        `front`: before every queued request (a conversation's next turn, sent as its last one ends: the slot that
        turn leaves still holds the conversation so far, for prefix reuse)."""
        self.check_fits(len(prompt_ids), max_tokens)
        handle = RequestHandle(next(self._ids), on_text, on_done, on_round)
        with self._cond:
            if self._closing:
                raise SpecDecodeError("the engine is shutting down and takes no new requests")
            request = _Request(handle, list(prompt_ids), params, max_tokens, tuple(stop), seed, speculate)
            if front:
                self._queue.appendleft(request)
            else:
                self._queue.append(request)
            with self.metrics.lock:
                self.metrics.queue_length = len(self._queue)
            self._cond.notify_all()
        return handle

    @property
    def idle(self) -> bool:
        """No request queued or running (all slots free)."""
        with self._cond:
            return not self._queue and not self._running

    # ---------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._running and not self._closing:
                    self._cond.wait()
                if self._closing and not self._queue and not self._running:
                    # a stopped engine takes no requests again: its KV slots go back now, not when the engine
                    # is collected (a served app's endpoints, which hold it, may outlive the app in FastAPI's
                    # caches)
                    self.batched.close()
                    self._looping = False
                    return
                joining = [self._queue.popleft() for _ in range(min(len(self._queue), self.batched.free_slots))]
            try:
                for request in joining:
                    self._admit(request)
                self._leave_cancelled()
                if self._running:
                    self._step()
            except Exception as error:  # a bug: fail the requests in flight rather than hang their clients
                log.exception("engine step failed")
                for sequence in self._running:
                    self._release(sequence, "failed")
                    sequence.request.handle.finish(error)
                self._running = []
            with self._cond, self.metrics.lock:
                self.metrics.queue_length = len(self._queue)
                self.metrics.running = len(self._running)

    def _admit(self, request: _Request) -> None:
        if request.handle.cancelled:
            with self.metrics.lock:
                self.metrics.requests["cancelled"] += 1
            request.handle.finish(Completion(token_ids=[], text="", finish_reason="cancelled"))
            return
        start = time.perf_counter()
        prompt = request.prompt_ids
        if self.config.prefix_caching:
            slot, cached = self.batched.acquire_cached(prompt[:-1])
        else:
            slot, cached = self.batched.acquire(), 0
        parts = [self.batched.kept_features(slot, cached)] if cached and self._with_features else []
        if len(prompt) - 1 > cached:
            out = self.batched.forward([slot], [torch.tensor(prompt[cached:-1])], logits=False)
            layer_hidden = None if out.layer_hidden is None else out.layer_hidden[0]
            parts.append(TargetFeatures(layer_hidden, out.last_hidden[0]))
        # the features of every prompt position but the last, or none: a drafter that reads none kept none
        features = joined_features(parts) if parts and (self._with_features or not cached) else None
        generator = torch.Generator().manual_seed(request.seed)
        drafter = copy.copy(self.drafter)
        drafter.begin(list(prompt), request.params, generator, features)
        stats = DecodeStats(prefill_s=time.perf_counter() - start)
        detok = IncrementalText(self.target.tokenizer, request.stop)
        drafting = self.gate.new_request() if self.gate else DraftYield()
        self._running.append(_Sequence(request, slot, list(prompt), drafter, generator, stats, start, detok, drafting))
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(prompt)
            self.metrics.prefix_cached_tokens += cached

    def _leave_cancelled(self) -> None:
        for sequence in [s for s in self._running if s.request.handle.cancelled]:
            self._finish(sequence, "cancelled")
        self._running = [s for s in self._running if not s.finished]

    def _step(self) -> None:
        """Draft for the running requests the gate picks (every one without a gate), schedule, one batched
        verify pass, commit each request."""
        speculating = [s for s in self._running if s.request.speculate]
        # one request alone is one-request decoding, where a self-gating drafter (the hybrid) has no gate on top
        # (skipping its drafting would skip its suffix lookups too, whose drafts cost no drafting pass) and the
        # scheduler prices a step by its verify pass alone
        gated = self.gate is not None and not (self.drafter.gates_itself and len(speculating) == 1)
        chosen = self.gate.choose([s.drafting for s in speculating]) if gated else [True] * len(speculating)
        drafts = iter(chosen)
        drafting = [next(drafts) if s.request.speculate else False for s in self._running]
        t0 = time.perf_counter()
        proposals = self.drafter.propose_batch(  # a limit of 0 drafts nothing and keeps the drafter in step
            [s.drafter for s in self._running],
            [s.ids for s in self._running],
            # drafts beyond a request's limit would be wasted
            [
                min(s.drafter.proposal_limit(self.config.draft_length), s.request.max_tokens - s.generated - 1)
                if wants
                else 0
                for s, wants in zip(self._running, drafting, strict=True)
            ],
        )
        draft_s = time.perf_counter() - t0
        for s in self._running:
            s.stats.draft_s += draft_s  # every request waits for the whole batch's drafting
        if any(p.length for p in proposals):  # a step the gate kept from drafting has nothing to schedule
            # an empty proposal carries no confidences; `fixed` ignores them and has_confidences() covers the rest
            confidences = [p.confidences if p.confidences is not None else torch.ones(p.length) for p in proposals]
            lengths = schedule(
                self.config.scheduler,
                confidences,
                [p.length for p in proposals],
                self.gate.step_rate(sum(drafting)) if gated else self.steps_per_s,
                self.config.threshold,
            )
            proposals = [p.prefix(n) for p, n in zip(proposals, lengths, strict=True)]
        for s, p in zip(self._running, proposals, strict=True):
            s.drafter.scheduled(p.length)
        rows = [
            VerifyRow(s.slot, s.ids[-1], p, s.request.params, s.generator)
            for s, p in zip(self._running, proposals, strict=True)
        ]
        t0 = time.perf_counter()
        results = verify_batch(self.batched, rows)
        verify_s = time.perf_counter() - t0
        with self.metrics.lock:
            self.metrics.verify_rows.observe(len(rows))
            self.metrics.verify_tokens.observe(sum(1 + p.length for p in proposals))
        for s, p, row, wants in zip(self._running, proposals, results, drafting, strict=True):
            s.stats.verify_s += verify_s
            if self.gate and wants:
                self.gate.observe(s.drafting, p.length, row.result.num_accepted)
            self._commit(s, p, row.result, row.features)
        if self.gate:
            self.gate.stepped(any(drafting))
            with self.metrics.lock:
                self.metrics.steps_without_drafting += not any(drafting)
        self._running = [s for s in self._running if not s.finished]

    def _commit(self, s: _Sequence, verified: Proposal, result, features: TargetFeatures) -> None:
        """As in `SpeculativeDecoder._complete`: cut at the limit and EOS, observe, stream, maybe finish."""
        t0 = time.perf_counter()
        new = result.tokens[: s.request.max_tokens - s.generated]
        hit_eos = next((j for j, t in enumerate(new) if t in self.target.eos_token_ids), None)
        if hit_eos is not None:
            new = new[: hit_eos + 1]
        spans = []
        for j, token in enumerate(new):  # where each token ends in the text, and whether it was a draft
            s.detok.append(token)
            spans.append([len(s.detok.text), j + 1 if j < result.num_accepted else 0])
        if s.request.handle.on_round:
            s.request.handle.on_round({"accepted": result.num_accepted, "spans": spans})
        s.ids += new
        s.drafter.observe(s.ids, result.num_accepted, features)
        s.stats.record_round(verified.length, result.num_accepted, verified.source)
        now = time.perf_counter()
        handle = s.request.handle
        with self.metrics.lock:
            self.metrics.record_round(verified.length, result.num_accepted)
            self.metrics.generated_tokens += len(new)
            if handle.time_to_first_token_s is None:
                handle.time_to_first_token_s = now - handle.submitted
                self.metrics.time_to_first_token.observe(handle.time_to_first_token_s)
            else:
                for _ in new:
                    self.metrics.inter_token_latency.observe((now - s.last_emit) / len(new))
        s.last_emit = now
        stopped = s.detok.stop_at is not None
        s.stats.draft_s += time.perf_counter() - t0
        if stopped or hit_eos is not None or s.generated >= s.request.max_tokens:
            text = s.detok.visible(final=True)
            self._emit(s, text)
            self._finish(s, "stop" if stopped or hit_eos is not None else "length", text)
        else:
            self._emit(s, stream_safe(s.detok.visible(), s.request.stop))

    def _emit(self, s: _Sequence, shown: str) -> None:
        if len(shown) > len(s.streamed):
            if s.request.handle.on_text:
                s.request.handle.on_text(shown[len(s.streamed) :])
            s.streamed = shown

    def _release(self, s: _Sequence, status: str) -> None:
        self.batched.release(s.slot)
        s.finished = True
        with self.metrics.lock:
            self.metrics.requests[status] += 1

    def _finish(self, s: _Sequence, reason: str, text: str | None = None) -> None:
        self._release(s, "cancelled" if reason == "cancelled" else "finished")
        s.drafter.end(s.ids)
        generated = s.ids[len(s.request.prompt_ids) :]
        s.stats.new_tokens = len(generated)
        s.stats.wall_s = time.perf_counter() - s.started
        text = s.streamed if text is None else text
        s.request.handle.finish(Completion(token_ids=generated, text=text, finish_reason=reason, stats=s.stats))
