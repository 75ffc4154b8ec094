"""What drafting has paid lately, and when a part that has not paid is tried again.

Both the engine's drafting gate (`engine/drafting_gate.py`: which requests of a step draft) and the hybrid
drafter (`drafters/hybrid.py`: whether its model drafts this round) decide from a request's recent yield,
the drafts it had kept and verified per drafting round, and both must try a part that stopped paying now
and then, or its estimate would never change.
"""

from dataclasses import dataclass

PRIOR_ROUNDS = 4  # a new request's yield starts as this many drafting rounds at the engine's mean
WINDOW = 64  # the most drafting rounds a mean remembers (it forgets older ones at rate 1 / WINDOW)
EXPLORE_EVERY = 16  # steps without drafting before one drafts again
MAX_EXPLORE_EVERY = 128  # the wait after tries that did not pay, doubled from EXPLORE_EVERY


@dataclass
class Exploration:
    """When a part that has not paid lately (drafting; the hybrid's model) is tried again: after `every`
    rounds without it. A try that leaves it not paying doubles the wait, up to `MAX_EXPLORE_EVERY`; a round
    that chose it on its merits brings the wait back to `EXPLORE_EVERY`."""

    every: int = EXPLORE_EVERY
    without: int = EXPLORE_EVERY  # rounds since it last ran: the first round tries it

    def due(self) -> bool:
        return self.without >= self.every

    def ran(self, tried: bool) -> None:
        """A round ran it; `tried`: only because it was due."""
        self.without = 0
        self.every = min(2 * self.every, MAX_EXPLORE_EVERY) if tried else EXPLORE_EVERY

    def skipped(self) -> None:
        self.without += 1


@dataclass
class DraftYield:
    """Means of one request's (or the engine's) accepted and verified drafts per drafting step: over every
    drafting step so far, its start counting as `PRIOR_ROUNDS` steps, then over about the last `WINDOW`.

    Why so long a memory: a round keeps 0 to 7 drafts and they come in runs, so a short mean mostly follows
    noise. With a mean over ~5 rounds (the earlier 0.8 decay) a few early misses took the mean under break-even,
    drafting stopped, and the tries backed off: on an AVX512-BF16 EPYC, where a drafting round costs ~1.3
    one-token passes and pays at 0.3 kept drafts a round, the gated prefix scheduler ran 1.25x normal decoding
    at T=0, against 1.38x with these means and 1.41x with no gate (`tools/gate_ab.py`, results/gate_ab.md)."""

    kept: float = 1.0
    verified: float = 1.0
    rounds: int = 0

    def prior(self) -> "DraftYield":
        """A new request's yield: this mean, worth `PRIOR_ROUNDS` rounds."""
        return DraftYield(self.kept, self.verified)

    def update(self, verified: int, kept: int) -> None:
        self.rounds += 1
        weight = max(1 / (self.rounds + PRIOR_ROUNDS), 1 / WINDOW)
        self.kept += weight * (kept - self.kept)
        self.verified += weight * (verified - self.verified)
