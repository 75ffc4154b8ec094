"""The batched verify pass: R requests, each with its own context and its own 1 + l_r new tokens, verified
in one target forward and accepted independently.

Design: a slot KV cache (`models/llama.KVCache`): every layer owns preallocated buffers (slots, kv_heads,
max_len, head_dim); a request owns a slot and a length. Why slots, and not one cache per request or a
paged cache:
- one forward needs all rows' keys and values in one tensor; the slot buffers already are that tensor, so
  a pass copies nothing but its new entries (and gathers rows only when the slots in use are not adjacent);
- rolling a request back is setting its length: entries past it are never attended and get overwritten;
- memory is bounded and known when the engine starts: slots x max_len x bytes per token (`nbytes`).
Paging would fit more short requests into the same memory, at the price of a gather or a custom kernel in
every layer; for a small target on a CPU the plain layout is enough.

Prefix reuse: every slot knows the tokens its entries hold, and a released slot keeps them until it is taken
again; `acquire_cached` gives a new prompt a free slot holding the longest start of it that any slot holds
(copied over from a slot in use where needed: 23 KB a token for SmolLM2), and its prefill skips that start
(every chat prompt opens with the same system turn; a conversation's next turn opens with the last). A drafter
that reads target features needs them at every prompt position: with `keep_features` each slot also keeps the
features of its first `FEATURE_SPAN` entries (captured layers and last hidden state, ~14 KB a token for SmolLM2
with DSpark's five layers), and those starts are reused with them.
Kept entries stand for a fresh prefill only where the target computes each token's bits however its sequence
was cut into passes (`Target.splits_alike`); elsewhere nothing is reused.

Row r's query i sits at position len_r + i and sees its slot's entries 0 .. len_r + i. The linears run on
the rows' real tokens packed, so a pass costs what its number of tokens costs, however unequal its rows;
attention alone sees the rows padded to the longest row's Q tokens, where a padded query attends nothing
(C++ kernel) or its row's first entries (SDPA's boolean mask: no empty softmax row, no NaN), its keys and
values are never written and its outputs are zero.
"""

from dataclasses import dataclass

import torch

from specdecode.drafters.base import Proposal, TargetFeatures
from specdecode.errors import SpecDecodeError
from specdecode.models.llama import Output, Rows
from specdecode.models.sps import DEFAULT_SIZES, StepCostTable, load_or_profile
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams, greedy_tokens, probabilities
from specdecode.verify import ChainResult, verify_block, verify_greedy

FEATURE_SPAN = 256  # leading entries of a slot whose target features are kept (`keep_features`)


class BatchedTarget:
    """A target run for many requests at once, each in its own KV slot; one `forward` is one batched pass."""

    def __init__(self, target: Target, slots: int, max_len: int, keep_features: bool = False) -> None:
        if slots < 1:
            raise SpecDecodeError(f"the batch needs at least one slot, got {slots}")
        if not 2 <= max_len <= target.max_context:
            raise SpecDecodeError(
                f"max_len {max_len} is out of range: {target.name}'s context holds 2 .. {target.max_context} tokens"
            )
        self.target = target
        self.cache = target.new_cache(slots, max_len)
        self.lengths = [0] * slots
        self.tokens: list[list[int]] = [[] for _ in range(slots)]  # what each slot's first `lengths` entries hold
        self.slots = slots
        self.max_len = max_len
        self._free = list(range(slots))
        self.keep_features = keep_features
        self.features: torch.Tensor | None = None  # (slots, FEATURE_SPAN, captured + hidden), made by the first pass
        self.featured = [0] * slots  # leading entries of each slot whose features `features` holds

    # ---------------------------------------------------------------- slots
    @property
    def nbytes(self) -> int:
        """KV memory held by the slot buffers (allocated up front, never grows)."""
        return self.cache.nbytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """A free slot, emptied; the lowest free one, so slots in use stay adjacent when they can."""
        if not self._free:
            raise SpecDecodeError("every KV slot is in use")
        slot = min(self._free)
        self._free.remove(slot)
        self.rollback(slot, 0)
        return slot

    def acquire_cached(self, tokens: list[int]) -> tuple[int, int]:
        """A free slot holding the longest start of `tokens` that any slot holds (with `keep_features`: and their
        features, `kept_features`), and its length: a prefill of `tokens` may begin there (see the module
        docstring). The entries come from the slot itself where it is free, else they are copied from the slot in
        use that holds them into the free slot that holds most of them already; of equal free slots the one
        holding the fewest tokens besides is taken (a chat's history stays for its next turn). 0 where the
        target's bits depend on how a sequence is cut. Between passes, where every slot holds committed tokens
        only."""
        if not self._free:
            raise SpecDecodeError("every KV slot is in use")
        if not self.target.splits_alike:
            return self.acquire(), 0
        held = [common_start(kept, tokens) for kept in self.tokens]
        if self.keep_features:
            held = [min(n, featured) for n, featured in zip(held, self.featured, strict=True)]
        slot = min(self._free, key=lambda s: (-held[s], len(self.tokens[s]), s))
        longest = max(held)
        source = slot if held[slot] == longest else held.index(longest)  # else copied from a slot in use
        self._free.remove(slot)
        self.rollback(slot, held[slot])
        n = held[source]
        if n > held[slot]:
            self.cache.copy_entries(source, slot, held[slot], n)
            if self.keep_features:  # `held` counted only entries with features: both slots have them
                self.features[slot, held[slot] : n] = self.features[source, held[slot] : n]
                self.featured[slot] = n
            self.lengths[slot] = n
            self.tokens[slot] = tokens[:n]
        return slot, n

    def kept_features(self, slot: int, n: int) -> TargetFeatures:
        """The target features of the slot's first `n` entries (n <= what `acquire_cached` found with them)."""
        assert self.features is not None and self.featured[slot] >= n
        width = self.features.shape[-1] - self.target.config.hidden_size
        kept = self.features[slot, :n]
        return TargetFeatures(kept[:, :width] if width else None, kept[:, width:])

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise SpecDecodeError(f"slot {slot} is already free")
        self._free.append(slot)

    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        """Keep the slot's first `length` entries (never grows it)."""
        self.lengths[slot] = min(self.lengths[slot], length)
        del self.tokens[slot][self.lengths[slot] :]
        self.featured[slot] = min(self.featured[slot], self.lengths[slot])

    def close(self) -> None:
        """Free the KV memory; no pass can run after this."""
        self.cache = None

    # ---------------------------------------------------------------- the pass
    def forward(self, slots: list[int], rows: list[torch.Tensor], logits: bool = True) -> Output:
        """Append `rows[r]` (n_r new tokens) to slot `slots[r]` in one target pass; outputs are (R, Q, ...)
        with Q = max n_r, and row r's outputs past n_r are zero padding."""
        if len(slots) != len(rows) or not rows or len(set(slots)) != len(slots):
            raise SpecDecodeError("a batched pass needs one row per distinct slot, and at least one row")
        counts = [len(row) for row in rows]
        starts = [self.lengths[s] for s in slots]
        if min(counts) < 1:
            raise SpecDecodeError("every row of a batched pass holds at least one token")
        if max(s + c for s, c in zip(starts, counts, strict=True)) > self.max_len:
            raise SpecDecodeError(f"a row would outgrow its KV slot of {self.max_len} tokens")
        ids = torch.zeros(len(rows), max(counts), dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = row
        out = self.target.run(ids, self.cache, Rows.batch(slots, starts, counts), logits=logits)
        for r, (s, start, row) in enumerate(zip(slots, starts, rows, strict=True)):
            self.lengths[s] = start + len(row)
            self.tokens[s] += row.tolist()
            if self.keep_features and self.featured[s] == start < FEATURE_SPAN:
                self._keep_features(s, start, min(start + len(row), FEATURE_SPAN), out, r)
        return out

    def _keep_features(self, slot: int, start: int, end: int, out: Output, r: int) -> None:
        """Store row r's features of entries start .. end - 1 of `slot` (its captured layers, then its last hidden
        state), the buffer made at the first pass."""
        parts = [out.last_hidden[r, : end - start]]
        if out.layer_hidden is not None:
            parts.insert(0, out.layer_hidden[r, : end - start])
        if self.features is None:
            width = sum(part.shape[-1] for part in parts)
            self.features = parts[0].new_zeros(self.slots, FEATURE_SPAN, width)
        self.features[slot, start:end] = torch.cat(parts, dim=-1)
        self.featured[slot] = end


def common_start(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share from their first."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass
class VerifyRow:
    """One request in a batched verify pass: its slot, its last committed token and the drafts to verify."""

    slot: int
    last_token: int
    proposal: Proposal
    params: SamplingParams
    generator: torch.Generator


@dataclass
class RowResult:
    """A request's accepted tokens and the target features of the positions it committed."""

    result: ChainResult
    features: TargetFeatures


def verify_batch(batched: BatchedTarget, rows: list[VerifyRow]) -> list[RowResult]:
    """One target pass over every row's [last token, drafts]; each row accepts with verify_greedy or
    verify_block on its own logits and rolls its own slot back to its committed tokens but the last."""
    starts = [batched.length(row.slot) for row in rows]
    inputs = [torch.cat([torch.tensor([row.last_token]), row.proposal.tokens]) for row in rows]
    out = batched.forward([row.slot for row in rows], inputs)
    argmax = greedy_tokens(out.logits).cpu() if any(row.params.greedy for row in rows) else None
    target_probs = {}  # row -> p of its positions, computed once per group of rows that sample alike
    for params in {row.params for row in rows if not row.params.greedy}:
        group = [r for r, row in enumerate(rows) if row.params == params]
        # every row alike (regeneration's 64): the logits as they are, not a gathered copy (12.6 MB for SmolLM2)
        logits = out.logits if len(group) == len(rows) else out.logits[group]
        target_probs.update(zip(group, probabilities(logits, params).cpu(), strict=True))
    results = []
    for r, (row, start) in enumerate(zip(rows, starts, strict=True)):
        n = 1 + row.proposal.length
        if row.params.greedy:
            result = verify_greedy(argmax[r, :n], row.proposal.tokens)
        else:
            proposal = row.proposal
            result = verify_block(target_probs[r][:n], proposal.tokens, proposal.probs, row.generator, proposal.support)
        kept = result.num_accepted + 1
        batched.rollback(row.slot, start + kept)
        layer_hidden = None if out.layer_hidden is None else out.layer_hidden[r, :kept]
        results.append(RowResult(result, TargetFeatures(layer_hidden, out.last_hidden[r, :kept])))
    return results


def profile_batched_pass(
    batched: BatchedTarget, context: int = 256, max_tokens: int = 64, reps: int = 5, refresh: bool = False
) -> StepCostTable:
    """SPS(B) of the real batched pass, for the prefix scheduler: B tokens spread evenly over min(B, slots)
    rows of `context` cached tokens each (R requests verify at least R tokens, so B rows of one token is
    the cheapest way to hold B tokens when B <= slots). Cached per target, kernel, slots and machine."""
    sizes = tuple(b for b in DEFAULT_SIZES if b <= max(max_tokens, 2))
    context = max(1, min(context, batched.max_len - -(-sizes[-1] // batched.slots)))
    target = batched.target
    key = {
        "target": target.name,
        "kernel": target.kernel,
        "dtype": str(target.dtype),
        "context": context,
        "rows": batched.slots,
    }
    slots: list[int] = []

    def run_pass(num_tokens: int) -> None:
        if not slots:  # prefill lazily: a cached table needs no pass at all
            slots.extend(batched.acquire() for _ in range(batched.slots))
            batched.forward(slots, [torch.zeros(context, dtype=torch.long)] * len(slots), logits=False)
        rows = min(num_tokens, len(slots))
        counts = [num_tokens // rows + (r < num_tokens % rows) for r in range(rows)]
        batched.forward(slots[:rows], [torch.zeros(n, dtype=torch.long) for n in counts])
        for slot in slots[:rows]:
            batched.rollback(slot, context)

    try:
        what = f"a batched pass's costs over {batched.slots} slots"
        return load_or_profile(what, key, run_pass, sizes, reps, refresh)
    finally:
        for slot in slots:
            batched.release(slot)
