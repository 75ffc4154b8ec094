"""Decoding statistics: accepted length counts the target's own token; per-position acceptance is conditional."""

from specdecode.engine.stats import DecodeStats


def test_rounds_and_merge():
    stats = DecodeStats()
    stats.record_round(proposed=3, accepted=1)  # drafts 1 kept, 2 rejected
    stats.record_round(proposed=3, accepted=3)  # all kept (+ bonus)
    stats.record_round(proposed=0, accepted=0)  # normal decoding round
    stats.record_round(proposed=4, accepted=0)  # first draft rejected
    assert stats.accepted_lengths == [2, 4, 1, 1]
    assert stats.mean_accepted_length == 2.0
    assert stats.position_attempts == [3, 2, 1] and stats.position_accepts == [2, 1, 1]
    assert stats.per_position_acceptance == [2 / 3, 0.5, 1.0]
    merged = DecodeStats()
    merged.merge(stats)
    merged.merge(stats)
    assert merged.position_attempts == [6, 4, 2] and merged.target_passes == 8
