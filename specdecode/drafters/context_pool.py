"""The projected contexts of every request a block drafter serves, one slot each in one `KVCache`.

Why: a batched drafting round runs the C++ layer loop over the requests' contexts, which reads each row's
keys and values from the slot the row names. With a cache per request, each round first copied every
request's context into a fresh batch cache: a round for 16 requests of 512 tokens took 26-30 ms, and takes
15-16 with the pool, which the round reads in place (shipped DSpark, Zen 4 EPYC, 2 cores; docs/runner.md).

A slot belongs to the drafter copy that took it (`acquire` in `begin`) until `release` (the request's
`end`); a copy that is dropped without ending (an aborted decode) frees its slot with it: the pool holds
its owners weakly. Slots and capacity grow by doubling, keeping what is there.
"""

import weakref

import torch

from specdecode.models.llama import KVCache

MIN_CAPACITY = 256  # entries per slot of a new pool


class ContextPool:
    """Context keys and values (layers, slots, kv_heads, capacity, head_dim) of `layers` drafter layers, held in
    `dtype` (None: that of the first features projected into it)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype | None = None) -> None:
        self.layers, self.kv_heads, self.head_dim, self.dtype = layers, kv_heads, head_dim, dtype
        self.cache: KVCache | None = None
        self.owners: list[weakref.ref | None] = []

    def owns(self, owner: object, slot: int | None) -> bool:
        ref = self.owners[slot] if slot is not None and slot < len(self.owners) else None
        return ref is not None and ref() is owner

    def acquire(self, owner: object) -> int:
        """A slot for `owner`: a free one (or one whose owner is gone), else a new one."""
        for slot, ref in enumerate(self.owners):
            if ref is None or ref() is None:
                self.owners[slot] = weakref.ref(owner)
                return slot
        self.owners.append(weakref.ref(owner))
        return len(self.owners) - 1

    def release(self, slot: int) -> None:
        self.owners[slot] = None

    def reserve(self, entries: int, like: torch.Tensor) -> KVCache:
        """The cache, with a slot for every slot handed out and room for `entries` in each (made, or doubled)."""
        slots = max(len(self.owners), 1)
        if self.cache is None:
            dtype = self.dtype or like.dtype
            self.cache = KVCache(
                self.layers, slots, self.kv_heads, self.head_dim, max(entries, MIN_CAPACITY), dtype, like.device
            )
        elif entries > self.cache.capacity or slots > self.cache.slots:
            self.cache.grow(_doubled(entries, self.cache.capacity), _doubled(slots, self.cache.slots))
        return self.cache


def _doubled(needed: int, have: int) -> int:
    """What a dimension grows to: at least twice what it has, once it has too little."""
    return max(needed, 2 * have) if needed > have else have
