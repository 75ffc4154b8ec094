"""Which requests of a step should draft at all (the continuous engine and one-request decoding).

The prefix scheduler chooses how many drafts to verify once they exist, so a step's drafting is paid even
when it then verifies none. With several requests in a pass the target is compute-bound on a CPU: a verify
pass over 4 rows x 8 tokens costs several one-token passes, the scheduler rightly verifies few drafts, and
drafting for every request every step made speculative serving slower than normal decoding. Before
drafting, the gate predicts the step's tokens per second from measured costs and each request's recent
yield, for the m requests of highest yield drafting and the others not:

    m drafting:  (R + sum_top-m kept_r) / (draft_s(m) + verify_s(R + sum_top-m verified_r))
    none:        R / verify_s(R)

(the batched pass runs its linears on the rows' tokens packed, so it costs what their number costs) where
kept_r and verified_r are means of request r's accepted and verified drafts over its steps that drafted (a
new request starts from the engine's mean; `DraftYield`), and takes the best m. After `EXPLORE_EVERY`
steps without drafting one request drafts, so the means stay current: the one that has drafted least, so each
takes its turn and a new one comes first. A try pays the drafting and whatever target features of its request
are still unprojected (a prompt's, the first time: 8-13 ms for 500 tokens), so trying every request at once
cost a fresh engine 8% of its tokens at 12 requests of 64 tokens, where drafting never paid (Zen 4 EPYC,
MT-Bench, interleaved in one process, medians of 7 sweeps: 0.96x normal decoding with every request trying,
0.99x with one; 1, 4 and 8 clients unchanged within the sweeps' noise). Each try that leaves drafting still
not paying doubles the wait before the next (up to `MAX_EXPLORE_EVERY`; a step that drafts on its merits
resets it). In the demo's flow the backoff and a fixed 16-round wait tie on its chat
prompt (`tools/demo_ab.py`, results/demo_ab*.md).
Both costs are tables measured once per machine and cached (SPS(B) of the batched pass, and
`profile_drafting` below), never timed as steps go, so a seeded request decodes the same tokens on every
rerun of the same batch.
Lossless: the choice reads only earlier steps, never this step's drafts.
"""

import itertools
from collections.abc import Callable

import torch

from specdecode.drafters.base import Drafter, TargetFeatures, cost_digest, in_second_round
from specdecode.drafters.yields import DraftYield, Exploration
from specdecode.models.sps import StepCostTable, load_or_profile
from specdecode.models.target import Target


class DraftingGate:
    """`verify_s(B)`: seconds of a batched verify pass over B tokens; `draft_s(R)`: seconds of drafting for
    R requests in one call."""

    def __init__(self, verify_s: Callable[[int], float], draft_s: Callable[[int], float]) -> None:
        self.verify_s, self.draft_s = verify_s, draft_s
        self.engine_yield = DraftYield()
        self.exploration = Exploration()
        self.exploring = False  # this step drafts (one request) only because a try was due

    def new_request(self) -> DraftYield:
        return self.engine_yield.prior()

    def choose(self, yields: list[DraftYield]) -> list[bool]:
        """Which of these requests (the ones that speculate) draft this step."""
        r = len(yields)
        if not r:
            return []
        self.exploring = self.exploration.due()
        if self.exploring:
            tried = min(range(r), key=lambda i: yields[i].rounds)
            return [i == tried for i in range(r)]
        by_yield = sorted(range(r), key=lambda i: -yields[i].kept)
        best_m, best_rate = 0, r / self.verify_s(r)
        kept, verified = 0.0, 0
        for m, i in enumerate(by_yield, 1):
            kept, verified = kept + yields[i].kept, verified + round(yields[i].verified)
            rate = (r + kept) / (self.draft_s(m) + self.verify_s(r + verified))
            if rate > best_rate:
                best_m, best_rate = m, rate
        chosen = [False] * r
        for i in by_yield[:best_m]:
            chosen[i] = True
        return chosen

    def step_rate(self, drafted_requests: int) -> Callable[[int], float]:
        """Steps per second of a whole step verifying B tokens, for the prefix scheduler: the step's drafting
        counts too (paid whatever is verified, it makes each verified draft relatively cheaper)."""
        draft_s = self.draft_s(drafted_requests) if drafted_requests else 0.0
        return lambda b: 1.0 / (draft_s + self.verify_s(b))

    def stepped(self, drafted: bool) -> None:
        """After a step: whether any request drafted in it."""
        if drafted:
            self.exploration.ran(tried=self.exploring)
        else:
            self.exploration.skipped()
        self.exploring = False

    def observe(self, request_yield: DraftYield, verified: int, kept: int) -> None:
        """After a drafting step: request r had `verified` drafts verified and `kept` of them accepted."""
        request_yield.update(verified, kept)
        self.engine_yield.update(verified, kept)


def profile_drafting(
    target: Target, drafter: Drafter, max_requests: int, draft_length: int, context: int = 128, reps: int = 5
) -> StepCostTable:
    """Seconds of one `propose_batch` call for R requests (R = 1, 2, 4, ... up to `max_requests`), each in its
    second round after a `context`-token prompt (`in_second_round`) and just after a target pass, as in decoding.
    Until stop 44 the timed calls projected no target features and found the drafter's weights in the caches:
    one request's round was priced at 1.4-1.7 ms where it takes 2.2 ms on a Zen 4 EPYC. Measured once and cached
    per machine, target and drafter like SPS(B). A drafter that picks between parts is timed by its costliest
    (`Drafter.costliest`): timed whole, the hybrid chose its suffix lookups alone (0.01-0.04 ms for 1-16
    requests), the gate let every step of a batch draft, and the hybrid's model then drafted in them at a cost
    the gate never saw."""
    drafter = drafter.costliest()
    sizes = tuple(sorted({min(2**i, max_requests) for i in range(max_requests.bit_length() + 1)} | {1, 2}))
    key = {
        "target": target.name,
        "kernel": target.kernel,
        "dtype": str(target.dtype),
        "drafting": cost_digest(drafter),
        "round": "second, after a target pass",
        "draft_length": draft_length,
        "context": context,
    }
    ids = [(7 * i) % target.config.vocab_size for i in range(context)]
    features: list[TargetFeatures] = []
    states: list[Drafter] = []
    seeds = itertools.count()

    def prepare(requests: int) -> None:
        if not features:  # prefill lazily: a cached table needs no pass at all
            target.set_capture_layers(drafter.target_layer_ids)
            target.reset()
            out = target.forward(torch.tensor(ids[:-1]), logits=False)
            target.reset()
            features.append(TargetFeatures(out.layer_hidden, out.last_hidden))
        states.clear()  # the last size's copies give their context slots back first
        states.extend(in_second_round(drafter, ids, features[0], draft_length, next(seeds)) for _ in range(requests))
        target.forward(torch.tensor(ids[:1]))  # a verify pass comes before each drafting call and takes the caches
        target.reset()

    def run_pass(requests: int) -> None:
        type(drafter).propose_batch(states, [ids] * requests, [draft_length] * requests)

    return load_or_profile("the drafter's costs by batch size", key, run_pass, sizes, reps, prepare=prepare)
