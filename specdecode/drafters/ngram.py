"""Prompt lookup: propose what followed the last occurrence of the context's final n-gram.

No model and no training: it wins where the answer repeats its input (editing code, quoting,
summaries that copy phrases) and proposes nothing elsewhere, so it never costs a useless verify width.
"""

import torch

from specdecode.drafters.base import EMPTY_PROPOSAL, Drafter, Proposal


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        if max_tokens <= 0:
            return EMPTY_PROPOSAL
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            start = _last_earlier_match(ids, n)
            if start is not None:
                follow = ids[start + n : start + n + max_tokens]
                return Proposal(tokens=torch.tensor(follow, dtype=torch.long))
        return EMPTY_PROPOSAL


def _last_earlier_match(ids: list[int], n: int) -> int | None:
    """Start of the latest earlier occurrence of the final n tokens that is followed by something."""
    suffix = ids[-n:]
    first = suffix[0]
    for start in range(len(ids) - n - 1, -1, -1):
        if ids[start] == first and ids[start : start + n] == suffix:
            return start
    return None
