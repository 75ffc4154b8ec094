"""Suffix decoding: propose the most frequent continuation of the longest earlier match of the context.

Text that repeats its context (editing code, quoting, summarizing a passage, re-emitting tool output) is
drafted for free by looking the context up (SuffixDecoding, Oliaro et al. 2024; Arctic Inference). Where
n-gram lookup takes the last match of a fixed-length suffix, this finds the *longest* suffix that occurred
before and counts every continuation that followed it, so the proposal is the likeliest path, each token
scored by its empirical frequency, and the proposal grows or shrinks with the evidence.

The index is a suffix automaton (Blumer et al. 1985): about two states per token, built online in O(1)
amortized time per appended token. Each state counts the positions where its strings end; an append
adds one to every state on the new state's suffix-link path, a walk that `MAX_COUNT_WALK` bounds (a path
is as long as the number of distinct occurrence counts among the context's suffixes: a handful in text,
long only in a run of one repeated token, where the counts of the shortest suffixes then stop growing).

Two indexes serve a request: its own prompt and output, and optionally a global one over earlier
requests' outputs (bounded: the oldest half is dropped when it fills).
"""

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal
from specdecode.models.sps import profile_target
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

MAX_COUNT_WALK = 64
SEPARATOR = -1  # ends a document in the global index; never a token, so no match crosses it


class SuffixAutomaton:
    """The minimal automaton of every suffix of a token stream, with occurrence counts."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]  # state -> {token: state}
        self.link = [-1]  # suffix link: the state of the longest suffix with more occurrences
        self.length = [0]  # length of the longest string of the state
        self.count = [0]  # occurrences (end positions) of the state's strings
        self.last = 0  # the state of the whole stream
        self.tokens = 0

    def __len__(self) -> int:
        return self.tokens

    def append(self, token: int) -> None:
        nxt, link, length, count = self.next, self.link, self.length, self.count
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        count.append(0)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: its shorter strings now also end here
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                count.append(count[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        self.tokens += 1
        state, steps = cur, 0
        while state > 0 and steps < MAX_COUNT_WALK:  # the new end position is an occurrence of each suffix
            count[state] += 1
            state = link[state]
            steps += 1

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)

    def match(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Extend a match (state, length) of some text by `token`: the longest suffix of text + token that
        occurs in the stream (the standard automaton matching walk, O(1) amortized)."""
        while state and token not in self.next[state]:
            state = self.link[state]
            matched = self.length[state]
        if token in self.next[state]:
            return self.next[state][token], matched + 1
        return 0, 0

    def match_suffix(self, tokens: list[int]) -> tuple[int, int]:
        """The longest suffix of `tokens` that occurs in the stream: (its state, its length)."""
        state, matched = 0, 0
        for token in tokens:
            state, matched = self.match(state, matched, token)
        return state, matched

    def continuation(self, state: int, max_tokens: int, min_score: float) -> tuple[list[int], list[float]]:
        """From `state`, follow the most frequent next token while the path's probability (the product of
        each step's frequency among the continuations seen) stays >= `min_score`."""
        tokens, scores, path = [], [], 1.0
        while len(tokens) < max_tokens:
            edges = self.next[state]
            if not edges:
                break
            seen = 0
            best_token, best_state, best_count = SEPARATOR, 0, -1
            for token, child in edges.items():
                seen += self.count[child]
                if self.count[child] > best_count:
                    best_token, best_state, best_count = token, child, self.count[child]
            score = best_count / seen if seen else 0.0
            if best_token == SEPARATOR or path * score < min_score:
                break
            tokens.append(best_token)
            scores.append(score)
            path *= score
            state = best_state
        return tokens, scores


class GlobalSuffixIndex:
    """Earlier requests' outputs, shared by every request of a process, in at most two automata of
    `capacity // 2` tokens each: when the newer fills up, the older is dropped (oldest outputs first)."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self.automata = [SuffixAutomaton()]
        self.version = 0  # bumped on every change, so a request knows when to match again

    def add(self, tokens: list[int]) -> None:
        if not tokens:
            return
        if len(self.automata[-1]) + len(tokens) > self.capacity // 2:
            self.automata = [*self.automata[-1:], SuffixAutomaton()]
        newest = self.automata[-1]
        newest.extend(tokens[-(self.capacity // 2 - 1) :])
        newest.append(SEPARATOR)
        self.version += 1

    def clear(self) -> None:
        self.automata = [SuffixAutomaton()]
        self.version += 1

    @property
    def tokens(self) -> int:
        return sum(len(a) for a in self.automata)


class AcceptanceTable:
    """P(a suffix draft survives | its prefix survived), learned online from verified rounds per (matched
    length, frequency score) cell, from a Beta(1, 1) prior. Counts alone are overconfident (a phrase seen
    once scores 1.0), and how much a match predicts depends on the text: a long match in a copied passage
    is near certain, a two-token match in fresh prose rarely is."""

    LENGTHS = (1, 2, 4, 8, 16)  # matched-length cells: 1, 2, 3-4, 5-8, 9-16, 17+
    SCORES = (0.5, 0.8, 0.95)  # frequency-score cells: <0.5, <0.8, <0.95, >=0.95

    def __init__(self) -> None:
        cells = (len(self.LENGTHS) + 1) * (len(self.SCORES) + 1)
        self.tries = [2.0] * cells
        self.hits = [1.0] * cells

    def cell(self, matched: int, score: float) -> int:
        """The cell of a draft: how many length bounds `matched` exceeds, how many score bounds `score` reaches."""
        return bisect.bisect_left(self.LENGTHS, matched) * (len(self.SCORES) + 1) + bisect.bisect_right(
            self.SCORES, score
        )

    def confidence(self, cell: int) -> float:
        return self.hits[cell] / self.tries[cell]

    def record(self, cell: int, survived: bool) -> None:
        self.tries[cell] += 1
        self.hits[cell] += survived


class RequestCalibration:
    """One factor on the shared table's odds for one request: (drafts that survived + prior) / (the odds they
    were given + prior), over the drafts scored so far (each given its prefix survived). Why: the table's cells
    average every text it saw, and a cell's odds depend on the text; after two copy-the-input prompts the
    demo's chat prompt drafted at odds that predicted 0.60 kept drafts a round and kept 0.22 (2-core AVX2 EPYC),
    paying 3-position passes. One factor learns a text's level within a few rounds; the cells keep the shape."""

    def __init__(self, prior: float) -> None:
        self.survived = self.expected = prior

    @property
    def factor(self) -> float:
        """1 under an infinite prior: the table's odds as they are."""
        return 1.0 if math.isinf(self.expected) else self.survived / self.expected

    def record(self, odds: float, survived: bool) -> None:
        self.expected += odds
        self.survived += survived


@dataclass
class SuffixSettings:
    """With the machine's measured cost curve, a proposal holds as many drafts, up to `lookup_length` (past
    the engine's draft length: a lookup's drafts cost no pass, only verify width), as the drafts' learned
    survival pays for in the wider verify pass, none where one draft would not; without a curve,
    `max_spec_factor` drafts per matched token (SuffixDecoding's alpha) within the draft length. Either stops
    where the continuation's path frequency falls below `min_score`. `global_capacity`: 0 turns the shared
    index of earlier outputs off. `calibration_prior`: drafts' worth of evidence that a request's text keeps the
    shared table's odds (`RequestCalibration`; math.inf: the table's odds as they are)."""

    max_spec_factor: float = 4.0
    min_score: float = 0.1
    lookup_length: int = 32
    global_capacity: int = 200_000
    rematch_tokens: int = 64  # context tokens matched again in the global index after it changed
    calibration_prior: float = 2.0


class SuffixDrafter(Drafter):
    """Deterministic proposals (q one-hot); confidences from the acceptance table, per token."""

    name = "suffix"
    has_confidences = True

    def __init__(
        self, settings: SuffixSettings | None = None, steps_per_s: Callable[[int], float] | None = None
    ) -> None:
        """`steps_per_s`: verify passes per second at B tokens (measured on the target when not given)."""
        self.settings = settings or SuffixSettings()
        capacity = self.settings.global_capacity
        # shared by every request of a process (the engine's per-request copies keep these references)
        self.shared = GlobalSuffixIndex(capacity) if capacity > 0 else None
        self.table = AcceptanceTable()
        self.steps_per_s = steps_per_s
        self._gain_table: tuple | None = None  # (the curve it was read from, gains, their maxima from n on)
        self.draft_length: int | None = None  # the engine's, told by `proposal_limit`

    def check_target(self, target: Target) -> None:
        if self.steps_per_s is None:
            self.steps_per_s = profile_target(target).steps_per_s

    def begin(self, prompt_ids, params: SamplingParams, generator: torch.Generator, features) -> None:
        self.local = SuffixAutomaton()
        self.local.extend(prompt_ids)
        self.prompt_length = len(prompt_ids)
        self.global_matches: list[tuple[int, int]] = []  # (state, length) in each automaton of the index
        self.global_version = -1
        self.pending: tuple[int, list[int], list[int]] | None = None  # (position, drafts, cells) to score
        self.calibration = RequestCalibration(self.settings.calibration_prior)

    def forget(self) -> None:
        if self.shared is not None:
            self.shared.clear()

    def _sync(self, ids: list[int]) -> None:
        """Index the tokens committed since the last call, and follow them in the global index."""
        fresh = ids[len(self.local) :]
        self.local.extend(fresh)
        if self.shared is None:
            return
        if self.global_version != self.shared.version:  # the index changed under the matches: match again
            fresh = ids[-self.settings.rematch_tokens :]
            self.global_matches = [(0, 0)] * len(self.shared.automata)
            self.global_version = self.shared.version
        for a, automaton in enumerate(self.shared.automata):
            state, matched = self.global_matches[a]
            for token in fresh:
                state, matched = automaton.match(state, matched, token)
            self.global_matches[a] = (state, matched)

    def proposal_limit(self, draft_length: int) -> int:
        self.draft_length = draft_length
        return max(draft_length, self.settings.lookup_length) if draft_length > 0 else 0

    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        self.pending = None
        if max_tokens <= 0:
            return EMPTY_PROPOSAL
        self._sync(ids)
        candidates = []
        local_state = self.local.link[self.local.last]  # the longest suffix that also ended earlier
        if local_state > 0:
            candidates.append((self.local, local_state, self.local.length[local_state]))
        if self.shared is not None:
            for automaton, (state, matched) in zip(self.shared.automata, self.global_matches, strict=True):
                if matched > 0:
                    candidates.append((automaton, state, matched))
        best, best_rate, shadow, shadow_value = None, 0.0, None, 0.0
        for automaton, state, matched in candidates:
            tokens, scores = automaton.continuation(state, max_tokens, self.settings.min_score)
            # draft j is predicted by the match grown by the j-1 drafts before it (given that they survive)
            cells = [self.table.cell(matched + j, score) for j, score in enumerate(scores)]
            confidences = [self._odds(cell) for cell in cells]
            cap = max(1, int(self.settings.max_spec_factor * matched))
            keep, rate = self._paying_length(confidences, min(cap, self.draft_length or cap))
            if keep and rate > best_rate:
                best, best_rate = (tokens[:keep], confidences[:keep], (tokens, cells)), rate
            value = expected_accepted(confidences)
            if value > shadow_value:
                shadow, shadow_value = (tokens, cells), value
        if best is not None:
            tokens, confidences, shadow = best
        # the whole continuation is scored against what gets committed, also past the proposal and when
        # nothing pays: a drafter that proposed nothing would otherwise never learn that it should
        if shadow is not None:
            self.pending = (len(ids), *shadow)
        if best is None:
            return EMPTY_PROPOSAL
        return Proposal(torch.tensor(tokens, dtype=torch.long), confidences=torch.tensor(confidences), source="suffix")

    def _odds(self, cell: int) -> float:
        """A draft's survival odds in this request: the shared table's, times the request's factor."""
        return min(1.0, self.table.confidence(cell) * self.calibration.factor)

    def _paying_length(self, confidences: list[float], cap: int) -> tuple[int, float]:
        """The number of drafts with the most expected tokens per second, (1 + drafts expected to survive) x
        SPS(1 + length), 0 where even one draft is slower than a plain decoding step; with the rate, in tokens
        per plain step. Without a cost curve, SuffixDecoding's rule: `cap` drafts (alpha x the match length)."""
        if self.steps_per_s is None or not confidences:
            keep = min(cap, len(confidences))
            return keep, 1 + expected_accepted(confidences[:keep])
        gains, best_from = self._gains(len(confidences))
        keep, best, survived, path = 0, 1.0, 0.0, 1.0
        for n, confidence in enumerate(confidences, 1):  # plain floats: tensor ops took 0.19 ms of a 10 ms round
            path *= float(confidence)  # the odds that drafts 1..n all survive
            survived += path
            rate = (1 + survived) * gains[n]
            if rate > best:
                keep, best = n, rate
            elif (1 + survived + path * (len(confidences) - n)) * best_from[n] <= best:
                break  # each later draft adds at most `path` (odds <= 1) at a gain of at most best_from[n]
        return keep, best

    def _gains(self, drafts: int) -> tuple[list[float], list[float]]:
        """SPS(1 + n) / SPS(1) for n = 0 .. at least `drafts`, and for each n the largest of those from n on:
        the cost curve read once per drafter, not once per draft of every round."""
        table = self._gain_table
        if table is None or table[0] is not self.steps_per_s or len(table[1]) <= drafts:
            plain, longest = self.steps_per_s(1), max(drafts, self.settings.lookup_length)
            gains = [self.steps_per_s(n + 1) / plain for n in range(longest + 1)]
            best_from = list(itertools.accumulate(reversed(gains), max))[::-1]
            self._gain_table = table = (self.steps_per_s, gains, best_from)
        return table[1], table[2]

    def observe(self, ids: list[int], num_accepted: int, features) -> None:
        """Score the last proposal against what was committed, whichever drafter's proposal was verified: a
        draft the target agreed with survives (at temperature 0 exactly what verification does)."""
        if self.pending is None:
            return
        position, tokens, cells = self.pending
        self.pending = None
        for j, (token, cell) in enumerate(zip(tokens, cells, strict=True)):
            if position + j >= len(ids):
                break
            survived = ids[position + j] == token
            self.calibration.record(self.table.confidence(cell), survived)
            self.table.record(cell, survived)
            if not survived:
                break

    def end(self, ids: list[int]) -> None:
        if self.shared is not None:
            self.shared.add(ids[self.prompt_length :])


def expected_accepted(confidences) -> float:
    """sum_j prod_{i<=j} c_i: the expected number of drafts a chain with these survival odds keeps."""
    total, path = 0.0, 1.0
    for c in confidences:
        path *= float(c)
        total += path
    return total
