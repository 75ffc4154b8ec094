"""Statistics of one or many completions: accepted length per round, per-position acceptance, timing."""

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Accepted lengths count the target's own token, so normal decoding has 1.0 per round."""

    accepted_lengths: list[int] = field(default_factory=list)
    position_attempts: list[int] = field(default_factory=list)  # rounds that reached draft position j
    position_accepts: list[int] = field(default_factory=list)  # ... and kept it
    target_passes: int = 0
    proposers: dict[str, int] = field(default_factory=dict)  # rounds whose verified drafts each proposer made
    new_tokens: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    def record_round(self, proposed: int, accepted: int, source: str | None = None) -> None:
        if source is not None and proposed:
            self.proposers[source] = self.proposers.get(source, 0) + 1
        self.accepted_lengths.append(accepted + 1)
        self.target_passes += 1
        reached = min(accepted + 1, proposed)
        self._add_positions([1] * reached, [int(j < accepted) for j in range(reached)])

    def merge(self, other: "DecodeStats") -> None:
        self.accepted_lengths += other.accepted_lengths
        for source, rounds in other.proposers.items():
            self.proposers[source] = self.proposers.get(source, 0) + rounds
        self._add_positions(other.position_attempts, other.position_accepts)
        for name in ("target_passes", "new_tokens", "prefill_s", "draft_s", "verify_s", "wall_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def _add_positions(self, attempts: list[int], accepts: list[int]) -> None:
        missing = len(attempts) - len(self.position_attempts)
        if missing > 0:
            self.position_attempts += [0] * missing
            self.position_accepts += [0] * missing
        for j, (tries, hits) in enumerate(zip(attempts, accepts, strict=True)):
            self.position_attempts[j] += tries
            self.position_accepts[j] += hits

    @property
    def mean_accepted_length(self) -> float:
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft j kept | drafts 1..j-1 kept), over the rounds that proposed a j-th draft."""
        return [hits / tries for tries, hits in zip(self.position_attempts, self.position_accepts, strict=True)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        """One line for a person: tokens, time, speed, accepted length and passes."""
        return (
            f"{self.new_tokens} tokens in {self.wall_s:.2f} s ({self.tokens_per_s:.1f} tok/s), "
            f"mean accepted length {self.mean_accepted_length:.2f}, {self.target_passes} target passes"
        )

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "rounds": len(self.accepted_lengths),
            "target_passes": self.target_passes,
            "proposers": dict(self.proposers),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_lengths": self.accepted_lengths,
            "per_position_acceptance": [round(a, 4) for a in self.per_position_acceptance],
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "wall_s": round(self.wall_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }
