"""The batched verify pass and the continuous-batching engine: batching must not change what each request gets."""

import json
import threading

import pytest
import torch

from specdecode.drafters.base import Drafter, Proposal
from specdecode.drafters.dspark import BlockDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine.batch import BatchedTarget, VerifyRow, profile_batched_pass, verify_batch
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.prefix_reuse_bench import run_prefix_reuse
from specdecode.models.linear import EIGHT_BIT_INPUTS
from specdecode.sampling import SamplingParams
from specdecode.training.recipes import build_block_drafter
from tests.conftest import needs_q8_rows, tiny_target
from tests.test_dspark import loop_drafter

GREEDY = SamplingParams()


def _single_pass(target, context: torch.Tensor, new: torch.Tensor):
    """The one-request reference: prefill `context`, then one pass over `new`."""
    target.reset()
    target.forward(context, logits=False)
    return target.forward(new)


def _check_rows_match(target, contexts, news, atol):
    batched = BatchedTarget(target, slots=4, max_len=96)
    slots = [batched.acquire() for _ in range(4)][1:]  # slots 1..3 of 4: not starting at 0
    slots = [slots[2], slots[0], slots[1]]  # and not in slot order: the gathered (non-view) path
    batched.forward(slots, contexts, logits=False)
    out = batched.forward(slots, news)
    assert torch.isfinite(out.logits).all()  # padded queries included
    for r, (context, new) in enumerate(zip(contexts, news, strict=True)):
        ref = _single_pass(target, context, new)
        got = out.logits[r, : len(new)]
        torch.testing.assert_close(got, ref.logits, atol=atol, rtol=0)
        assert torch.equal(got.argmax(-1), ref.logits.argmax(-1))
        if ref.layer_hidden is not None:
            torch.testing.assert_close(out.layer_hidden[r, : len(new)], ref.layer_hidden, atol=atol, rtol=0)
        assert batched.length(slots[r]) == len(context) + len(new)


def test_batched_pass_equals_single_passes_tiny():
    target = tiny_target()
    target.set_capture_layers([0])
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, 24, (n,), generator=g) for n in (5, 31, 2)]
    news = [torch.randint(0, 24, (n,), generator=g) for n in (4, 1, 8)]  # 1 + l_r with l_r = 3, 0, 7
    _check_rows_match(target, contexts, news, atol=1e-4)


def test_batched_pass_equals_single_passes_real_target(smollm2):
    smollm2.set_capture_layers([])
    contexts = [torch.tensor(smollm2.encode(p)) for p in ("Hi", "Name three rivers in Europe, please.", "2+2?")]
    news = [torch.tensor(smollm2.tokenizer.encode(t)) for t in ("Hello there", "The", "The answer is four.")]
    _check_rows_match(smollm2, contexts, news, atol=1e-3)


def test_rollback_is_per_row():
    """Row 0 keeps 2 of its 6 new entries, row 1 keeps all; the next pass sees exactly the kept entries."""
    target = tiny_target()
    batched = BatchedTarget(target, slots=2, max_len=64)
    a, b = batched.acquire(), batched.acquire()
    ctx_a, ctx_b = torch.arange(3, 10), torch.arange(4, 8)
    new_a, new_b = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([9, 9])
    batched.forward([a, b], [ctx_a, ctx_b], logits=False)
    batched.forward([a, b], [new_a, new_b])
    batched.rollback(a, len(ctx_a) + 2)
    assert (batched.length(a), batched.length(b)) == (len(ctx_a) + 2, len(ctx_b) + 2)
    out = batched.forward([a, b], [torch.tensor([7, 8]), torch.tensor([10])])
    ref_a = _single_pass(target, torch.cat([ctx_a, new_a[:2]]), torch.tensor([7, 8]))
    ref_b = _single_pass(target, torch.cat([ctx_b, new_b]), torch.tensor([10]))
    torch.testing.assert_close(out.logits[0, :2], ref_a.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.logits[1, :1], ref_b.logits, atol=1e-4, rtol=0)


def test_verify_batch_accepts_each_row_independently():
    """Row 0 proposes the target's own greedy continuation (all kept), row 1 proposes junk (none kept)."""
    target = tiny_target()
    prompt = [3, 5, 7, 9]
    greedy = SpeculativeDecoder(target, Drafter()).generate(prompt, GREEDY, max_new_tokens=5)[0].token_ids
    batched = BatchedTarget(target, slots=2, max_len=64)
    rows = []
    for drafts in (greedy[:4], [(t + 1) % 24 for t in greedy[:3]]):
        slot = batched.acquire()
        batched.forward([slot], [torch.tensor(prompt[:-1])], logits=False)
        proposal = Proposal(tokens=torch.tensor(drafts))
        rows.append(VerifyRow(slot, prompt[-1], proposal, GREEDY, torch.Generator()))
    first, second = verify_batch(batched, rows)
    assert first.result.tokens == greedy[:5] and first.result.num_accepted == 4
    assert second.result.tokens == greedy[:1] and second.result.num_accepted == 0
    assert batched.length(0) == len(prompt) + 4 and batched.length(1) == len(prompt)
    assert first.features.last_hidden.shape[0] == 5 and second.features.last_hidden.shape[0] == 1


def test_slots_are_bounded_and_accounted():
    target = tiny_target()
    batched = BatchedTarget(target, slots=2, max_len=16)
    c = target.config
    head_dim = c.hidden_size // c.num_attention_heads
    assert batched.nbytes == 2 * c.num_hidden_layers * 2 * c.num_key_value_heads * 16 * head_dim * 4
    slot = batched.acquire()
    batched.acquire()
    with pytest.raises(SpecDecodeError, match="in use"):
        batched.acquire()
    with pytest.raises(SpecDecodeError, match="outgrow"):
        batched.forward([slot], [torch.zeros(17, dtype=torch.long)])
    batched.release(slot)
    with pytest.raises(SpecDecodeError, match="already free"):
        batched.release(slot)
    with pytest.raises(SpecDecodeError, match="max_len"):
        BatchedTarget(target, slots=1, max_len=target.max_context + 1)


def _next_logits(batched, slot, prompt, cached):
    """Prefill what `slot` does not hold of prompt[:-1], then the logits of one pass over its last token."""
    if len(prompt) - 1 > cached:
        batched.forward([slot], [torch.tensor(prompt[cached:-1])], logits=False)
    return batched.forward([slot], [torch.tensor(prompt[-1:])]).logits[0]


def test_prefix_reuse_skips_held_tokens_and_keeps_the_bits():
    """A kept slot's start of a prompt, from a free slot or copied from one in use, gives the very logits of a fresh
    prefill (the target's kernels compute each row alike: `splits_alike`); the longest holder wins."""
    target = tiny_target(kernel="few-rows")
    assert target.splits_alike
    batched = BatchedTarget(target, slots=3, max_len=64)
    fresh = BatchedTarget(target, slots=1, max_len=64)
    shared, other = [3, 4, 5, 6, 7, 8], [9, 10, 11, 12]
    first = batched.acquire()
    _next_logits(batched, first, shared + [13, 14, 15], 0)  # slot 0 now holds shared + [13, 14, 15]
    busy, cached = batched.acquire_cached(other + [2, 2])  # nothing shared: the lowest free slot, nothing held
    assert (busy, cached) == (1, 0)
    _next_logits(batched, busy, other + [2, 2], 0)
    prompt = shared + [20, 21, 22]
    slot, cached = batched.acquire_cached(prompt[:-1])  # slot 0 is in use: its start is copied into slot 2
    assert (slot, cached) == (2, len(shared))
    reference = _next_logits(fresh, fresh.acquire(), prompt, 0)
    assert torch.equal(_next_logits(batched, slot, prompt, cached), reference)
    batched.release(first)
    batched.release(slot)  # now slots 0 and 2 are free, and 2 holds all of prompt
    again, cached = batched.acquire_cached(prompt[:-1])
    assert (again, cached) == (2, len(prompt) - 1) and batched.tokens[again] == prompt[:-1]
    assert torch.equal(_next_logits(batched, again, prompt, cached), reference)
    assert batched.free_slots == 1


def test_prefix_reuse_keeps_the_features_of_a_slots_start():
    """With `keep_features`, a reused start comes with the captured layers and last hidden state a whole prefill
    gives those positions, bit for bit (a feature drafter's context), also when copied from a slot in use."""
    target = tiny_target(kernel="few-rows")
    target.set_capture_layers([0])
    batched = BatchedTarget(target, slots=2, max_len=64, keep_features=True)
    fresh = BatchedTarget(target, slots=1, max_len=64)
    prompt = [3, 4, 5, 6, 7, 8, 9]
    whole = fresh.forward([fresh.acquire()], [torch.tensor(prompt)], logits=False)
    busy = batched.acquire()
    batched.forward([busy], [torch.tensor(prompt[:5] + [1, 1])], logits=False)
    slot, cached = batched.acquire_cached(prompt)
    assert (slot, cached) == (1, 5)
    kept = batched.kept_features(slot, cached)
    assert torch.equal(kept.layer_hidden, whole.layer_hidden[0, :5])
    assert torch.equal(kept.last_hidden, whole.last_hidden[0, :5])
    batched.forward([slot], [torch.tensor(prompt[5:])], logits=False)
    assert torch.equal(batched.kept_features(slot, len(prompt)).layer_hidden, whole.layer_hidden[0])
    target.set_capture_layers([])


def test_prefix_reuse_leaves_a_conversation_for_its_next_turn():
    """Of free slots holding as much of a new prompt, the one holding least besides is taken: a chat's history
    waits in its slot for the chat's next turn."""
    target = tiny_target(kernel="few-rows")
    batched = BatchedTarget(target, slots=2, max_len=32)
    history, other = [5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 20]
    for tokens in (history, other):
        slot = batched.acquire()
        batched.forward([slot], [torch.tensor(tokens)], logits=False)
    batched.release(0)
    batched.release(1)
    assert batched.acquire_cached([5, 6, 7, 30, 31]) == (1, 3)  # both hold [5, 6, 7]: slot 1 holds less
    assert batched.acquire_cached(history + [40]) == (0, len(history))


def test_prefix_reuse_is_off_where_bits_depend_on_the_cut():
    target = tiny_target(kernel="stock")  # stock kernels promise no row-by-row bits
    assert not target.splits_alike
    batched = BatchedTarget(target, slots=2, max_len=32)
    slot = batched.acquire()
    batched.forward([slot], [torch.tensor([3, 4, 5, 6])], logits=False)
    batched.release(slot)
    assert batched.acquire_cached([3, 4, 5, 6, 7]) == (0, 0) and batched.length(0) == 0


def test_profile_batched_pass_measures_and_frees_slots(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    batched = BatchedTarget(tiny_target(), slots=2, max_len=64)
    table = profile_batched_pass(batched, context=8, max_tokens=6, reps=1)
    assert table.tokens == [1, 2, 3, 4, 6] and all(s > 0 for s in table.seconds)
    assert table.key["rows"] == 2 and batched.free_slots == 2
    assert profile_batched_pass(batched, context=8, max_tokens=6, reps=1).seconds == table.seconds  # cached


# ---------------------------------------------------------------- the engine
def _normal_greedy(target, prompt, max_tokens):
    return SpeculativeDecoder(target, Drafter()).generate(prompt, GREEDY, max_new_tokens=max_tokens)[0].token_ids


def _top2_gap(target, ids: list[int]) -> float:
    """The reference's margin between its two best next tokens after `ids`."""
    target.set_capture_layers([])
    target.reset()
    top = target.forward(torch.tensor(ids)).logits[-1].topk(2).values
    return float(top[0] - top[1])


def _run(engine, prompts, max_tokens, **kw):
    engine.start()
    try:
        handles = [engine.submit(p, GREEDY, max_tokens, **kw) for p in prompts]  # all at once: they share passes
        return [h.result(timeout=300) for h in handles]
    finally:
        engine.stop()


def test_engine_greedy_equals_normal_decoding_real_target(smollm2):
    """Temperature 0 under concurrent load on the real target, more requests than slots (so some wait).

    Tolerance, stated: the batched pass computes the same logits up to float rounding (~1e-4, other kernels
    for other row counts), so outputs must be token-identical unless the reference's two best tokens are
    within 1e-3 of each other at the first difference (a float tie); then only the tokens before it are
    compared."""
    questions = (
        "What is 2+2?",
        "Write a haiku about the sea.",
        "Repeat exactly: red, green, blue, red, green, blue.",
        "Explain in detail why the sky is blue, and why sunsets are red.",
        "Hi",
    )
    prompts = [smollm2.encode(q) for q in questions]
    max_tokens = 24
    references = [_normal_greedy(smollm2, p, max_tokens) for p in prompts]
    engine = ContinuousEngine(smollm2, NgramDrafter(), EngineConfig(max_batch=3, max_len=160, draft_length=4))
    completions = _run(engine, prompts, max_tokens)
    for prompt, ref, got in zip(prompts, references, completions, strict=True):
        if got.token_ids != ref:
            j = next(i for i, (x, y) in enumerate(zip(got.token_ids, ref, strict=False)) if x != y)
            assert _top2_gap(smollm2, prompt + ref[:j]) < 1e-3, f"batched output differs at token {j}"
        assert got.text == smollm2.tokenizer.decode(got.token_ids, skip_special_tokens=True)
    assert engine.batched.free_slots == 3
    assert engine.metrics.requests["finished"] == len(prompts)
    assert max(s.mean_accepted_length for s in (c.stats for c in completions)) > 1  # ngram drafts were kept


def _tiny_dspark(target):
    return BlockDrafter(build_block_drafter("dspark", target, num_layers=1, block_size=4, target_layer_ids=[0]))


@pytest.mark.parametrize("scheduler", ["prefix", "threshold", "fixed"])
def test_engine_schedulers_stay_lossless_tiny(scheduler):
    """An untrained DSpark drafter (it has confidences) under each scheduler: greedy output is normal decoding."""
    target = tiny_target(vocab_size=32, seed=3)
    prompts = [[3, 4, 5, 6, 7, 8, 9][:n] for n in (2, 7, 4, 1)]
    references = [_normal_greedy(target, p, 12) for p in prompts]
    drafter = _tiny_dspark(target)
    target.set_capture_layers(drafter.target_layer_ids)
    config = EngineConfig(max_batch=3, max_len=32, draft_length=4, scheduler=scheduler, threshold=0.3)
    steps_per_s = (lambda b: 100.0 / (1 + 0.05 * b)) if scheduler == "prefix" else None
    engine = ContinuousEngine(target, drafter, config, steps_per_s=steps_per_s)
    assert [c.token_ids for c in _run(engine, prompts, 12)] == references


def test_engine_prefix_reuse_changes_no_token_and_counts_what_it_skipped():
    """Prompts opening alike (a system turn) through one slot after another: the same tokens with prefix reuse as
    without, the held starts counted; with a drafter of target features too, which then drafts as it did."""
    target = tiny_target(vocab_size=32, seed=3, kernel="few-rows")
    opening = [5, 6, 7, 8, 9, 10]
    prompts = [opening + tail for tail in ([11, 12], [13], [11, 12, 14], [15, 16])]

    def run(drafter, prefix_caching):
        config = EngineConfig(max_batch=2, max_len=48, draft_length=3, prefix_caching=prefix_caching)
        engine = ContinuousEngine(target, drafter, config)
        completions = _run(engine, prompts, 10)
        rounds = [c.stats.accepted_lengths for c in completions]
        return [c.token_ids for c in completions], rounds, engine.metrics.prefix_cached_tokens

    plain, _, none_cached = run(Drafter(), False)
    reused, _, cached = run(Drafter(), True)
    assert reused == plain and none_cached == 0
    assert cached >= 2 * len(opening)  # the two waiting prompts found the opening at least
    drafter = _tiny_dspark(target)  # reads target features: the kept starts come with theirs
    drafted, rounds, feature_cached = run(drafter, True)
    assert drafted == plain and feature_cached >= 2 * len(opening)
    assert run(drafter, False)[1] == rounds  # its drafts were those of whole prefills


def test_prefix_reuse_bench_reuses_a_chats_first_turn_with_the_same_answers(tmp_path):
    target = tiny_target(kernel="few-rows")
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    chats = [["t3 t4 t5 t6", "t7 t8"], ["t9 t10 t11", "t12"]]
    run_prefix_reuse(target, str(tmp_path), max_tokens=6, repeats=1, chats=chats)
    doc = json.loads((tmp_path / "prefix_reuse.json").read_text())
    rows = {(r["prefix_caching"], r["turn"]): r for r in doc["runs"]}
    assert rows[True, 2]["reused_tokens"] >= rows[True, 1]["prompt_tokens"]  # the whole first prompt at least
    assert rows[False, 2]["reused_tokens"] == 0 and all(r["same_answers"] for r in doc["runs"])
    assert "| on | 2 | 2 |" in (tmp_path / "prefix_reuse.md").read_text()


def test_engine_admits_a_front_request_first_and_it_finds_its_conversation():
    """A conversation's next turn, sent with `front` as the last one ends, goes before the queued requests and takes
    the slot that still holds the conversation (one slot here: B waits for it)."""
    target = tiny_target(vocab_size=32, seed=3, kernel="few-rows")
    engine = ContinuousEngine(target, Drafter(), EngineConfig(max_batch=1, max_len=48, draft_length=0))
    order, first = [], [5, 6, 7, 8]

    def next_turn(done):
        order.append("A")
        engine.submit(first + done.token_ids + [9], GREEDY, 4, on_done=lambda _: order.append("C"), front=True)

    def work():
        a = engine.submit(first, GREEDY, 4, on_done=next_turn)
        engine.submit([10, 11, 12], GREEDY, 4, on_done=lambda _: order.append("B")).result(timeout=60)
        return a.result(timeout=60)

    answer = engine.drive(work)
    assert order == ["A", "C", "B"]
    assert engine.metrics.prefix_cached_tokens >= len(first) + len(answer.token_ids) - 1


def test_engine_refuses_what_can_never_fit_and_needs_confidences_for_prefix():
    target = tiny_target()
    engine = ContinuousEngine(target, NgramDrafter(), EngineConfig(max_batch=1, max_len=16))
    with pytest.raises(SpecDecodeError, match="at most 16 tokens"):
        engine.submit([1] * 10, GREEDY, max_tokens=7)
    with pytest.raises(SpecDecodeError, match="max_tokens"):
        engine.submit([1] * 10, GREEDY, max_tokens=0)
    with pytest.raises(SpecDecodeError, match="confidence head"):
        ContinuousEngine(target, NgramDrafter(), EngineConfig(scheduler="prefix"))


def test_engine_streams_stops_and_frees_cancelled_slots():
    target = tiny_target()
    prompt = [3, 5, 7, 9]
    full = _normal_greedy(target, prompt, 8)
    text = target.tokenizer.decode(full, skip_special_tokens=True)
    words = text.split()
    stop = next(w for i, w in enumerate(words) if i >= 2 and w not in words[:i])  # a later word, first seen there
    engine = ContinuousEngine(target, NgramDrafter(), EngineConfig(max_batch=1, max_len=64, draft_length=3))
    engine.start()
    try:
        streamed = []
        stopped = engine.submit(prompt, GREEDY, 8, stop=(stop,), on_text=streamed.append).result(60)
        assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)] != ""
        assert "".join(streamed) == stopped.text
        long = engine.submit(prompt, GREEDY, 40)
        waiting = engine.submit(prompt, GREEDY, 5)  # one slot: queued behind `long`
        long.cancel()
        assert long.result(60).finish_reason == "cancelled"
        assert waiting.result(60).token_ids == full[:5]
    finally:
        engine.stop()
    assert engine.batched.free_slots == 1 and engine.metrics.requests["cancelled"] == 1
    assert engine.batched.cache is None  # a stopped engine's KV memory goes back at once


def test_drive_steps_on_the_calling_thread_and_hands_back_the_work():
    """`drive`: the loop runs on the caller's thread (the model's: OpenMP is fast there) while the work runs
    beside it; the work's result comes back, its exception is raised, and either way the KV memory goes back."""
    target = tiny_target()
    prompt = [3, 5, 7, 9]
    engine = ContinuousEngine(target, NgramDrafter(), EngineConfig(max_batch=2, max_len=64, draft_length=3))
    stepped_on = set()
    step = engine._step
    engine._step = lambda: (stepped_on.add(threading.current_thread()), step())[1]
    tokens = engine.drive(lambda: engine.submit(prompt, GREEDY, 6).result(60).token_ids)
    assert tokens == _normal_greedy(target, prompt, 6)
    assert stepped_on == {threading.current_thread()} and engine.batched.cache is None
    engine.start()  # a stopped engine takes no requests again
    with pytest.raises(SpecDecodeError, match="shutting down"):
        engine.submit(prompt, GREEDY, 2)

    failing = ContinuousEngine(target, NgramDrafter(), EngineConfig(max_batch=1, max_len=256, draft_length=3))

    def work() -> None:
        failing.submit(prompt, GREEDY, 250)  # still running when the work fails: cancelled, not drained
        raise ValueError("the work failed")

    with pytest.raises(ValueError, match="the work failed"):
        failing.drive(work)
    assert failing.batched.cache is None and failing.metrics.requests["finished"] == 0


@pytest.mark.parametrize("drafter_kind", ["ngram", "dspark", pytest.param("dspark-cpp-loop", marks=needs_q8_rows)])
def test_engine_sampling_follows_each_requests_seed(drafter_kind):
    """Temperature 1: each request draws from its own seeded generator exactly as the one-request loop does,
    so batching with other requests leaves its tokens unchanged (same seed, same tokens); also where the drafter
    runs on the CPU's path (its C++ layer loop over 8-bit kernels, batched rounds row by row)."""
    target = tiny_target(vocab_size=32, seed=3)
    drafters = {
        "ngram": NgramDrafter,
        "dspark": lambda: _tiny_dspark(target),
        "dspark-cpp-loop": lambda: loop_drafter(target, EIGHT_BIT_INPUTS),
    }
    drafter = drafters[drafter_kind]()
    params = SamplingParams(temperature=1.0, top_p=0.9)
    prompts = [[3, 4, 5, 3, 4], [7, 8], [9, 9, 9, 9]]
    references = [
        SpeculativeDecoder(target, drafter, draft_length=3).generate(p, params, 10, seed=s)[0].token_ids
        for s, p in enumerate(prompts)
    ]
    engine = ContinuousEngine(target, drafter, EngineConfig(max_batch=3, max_len=32, draft_length=3))
    engine.start()
    try:
        handles = [engine.submit(p, params, 10, seed=s) for s, p in enumerate(prompts)]
        assert [h.result(60).token_ids for h in handles] == references
    finally:
        engine.stop()


def test_premise_times_a_decode_step_per_batch_size():
    """`bench premise` times one step of R requests (each in its own slot, one token each) per context."""
    from specdecode.evaluation.premise import BATCH_ROWS, batched_decoding

    rows = batched_decoding(tiny_target(), [6, 12], reps=1, generator=torch.Generator().manual_seed(0))
    assert [(r["context"], r["rows"]) for r in rows] == [(c, n) for c in (6, 12) for n in BATCH_ROWS]
    assert all(r["ms_median"] > 0 for r in rows) and {r["throughput_vs_1"] for r in rows if r["rows"] == 1} == {1.0}
