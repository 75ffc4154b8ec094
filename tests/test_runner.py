"""The lean runner computes what the Hugging Face model computes: logits and captured hidden states on
prefill, chain verify, tree verify and batched rows; its kernels and caches keep their promises.

Tolerance, stated: both are float32, but the runner fuses q/k/v and gate/up into one GEMM each, uses
fused RMSNorm and grouped-query SDPA, and may pick another GEMM kernel per row count, so sums run in
another order. Each op then differs by a few ulps (~1e-7 relative); over 30 layers that grows to ~1e-4
on logits of magnitude ~30 (measured: 1e-4). 2e-3 absolute leaves room for other machines' kernels while
any real mistake (a wrong position, mask or cache entry) moves logits by whole units.
"""

import contextlib
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specdecode.drafters import Drafter, build_drafter
from specdecode.engine.batch import BatchedTarget
from specdecode.engine.decode import SpeculativeDecoder, tree_attention
from specdecode.models import linear as linear_module
from specdecode.models.gguf_rows import SOURCE_MARKER, dequantize, holds_rows, interleave, quantize_q4_1, quantize_q8_0
from specdecode.models.linear import (
    BFLOAT16,
    EIGHT_BIT_INPUTS,
    FEW_ROWS_MAX,
    FLOAT32,
    ROW_BUCKETS,
    ROWS_8_BIT,
    FrozenLinear,
    Linear,
    build_lock,
    cpu_kernels_available,
    freeze_linears,
    native_bfloat16,
    pack_panels,
    panels_fit,
    plan_kernels,
    prune_builds,
    q8_group_rows,
    same_bits_where_exact,
)
from specdecode.models.llama import Rows, unsupported_reason
from specdecode.models.registry import converted_dir
from specdecode.models.target import Target, default_dtype
from specdecode.sampling import SamplingParams
from tests.conftest import needs_q8_rows, tiny_llama, tiny_tokenizer

ATOL, RTOL = 2e-3, 1e-4
LAYERS = [3, 14, 27]


@pytest.fixture(scope="module")
def hf_reference(smollm2_fp32) -> Target:
    """The default target through the HF forward (same weights: the HF modules are views of the runner's)."""
    return Target(smollm2_fp32.model, smollm2_fp32.tokenizer, name="smollm2-hf", runner=False)


def both(smollm2, hf_reference):
    for target in (smollm2, hf_reference):
        target.set_capture_layers(LAYERS)
        target.reset()
    return smollm2, hf_reference


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's (and the C++ kernels') thread count set to `count` inside, given back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_same(a, b) -> None:
    torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(a.layer_hidden, b.layer_hidden, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(a.last_hidden, b.last_hidden, atol=ATOL, rtol=RTOL)


def test_end_tokens_leave_the_generation_config_as_it_is():
    """A generation config may list several end tokens (Qwen2.5's does): the target's set adds the tokenizer's
    own, and asking for it, as the engines do for every new token, never grows the config's list."""
    model = tiny_llama(vocab_size=24)
    model.generation_config.eos_token_id = [5, 7]
    target = Target(model, tiny_tokenizer(24), name="tiny")
    assert target.eos_token_ids == {5, 7, target.tokenizer.eos_token_id}
    for _ in range(3):
        assert target.eos_token_ids == {5, 7, 0}
    assert model.generation_config.eos_token_id == [5, 7]


def test_the_default_target_runs_on_the_runner(smollm2):
    assert smollm2.runner is not None and smollm2.kernel == "auto"
    assert unsupported_reason(smollm2.config) is None


def test_prefill_and_chain_verify_match_the_hf_forward(smollm2_fp32, hf_reference):
    runner, hf = both(smollm2_fp32, hf_reference)
    ids = torch.tensor(runner.encode("Write a limerick about a cat who codes."))
    assert_same(runner.forward(ids[:-1]), hf.forward(ids[:-1]))
    for k in (1, 5, 9):  # verify passes of k positions after the same context, rolled back in between
        drafts = torch.randint(100, 40000, (k,), generator=torch.Generator().manual_seed(k))
        for target in (runner, hf):
            target.rollback(len(ids) - 1)
        assert_same(runner.forward(drafts), hf.forward(drafts))
    runner.set_capture_layers([])
    hf.set_capture_layers([])


def test_tree_verify_matches_the_hf_forward(smollm2_fp32, hf_reference):
    runner, hf = both(smollm2_fp32, hf_reference)
    ids = runner.encode("Name three rivers.")
    for target in (runner, hf):
        target.forward(torch.tensor(ids[:-1]), logits=False)
    parents = torch.tensor([-1, 0, 0, 1, -1, 4])  # two branches off the root, one of depth three
    tokens = torch.tensor(ids[-1:] + [791, 1345, 28, 2051, 418, 28])
    mask, positions = tree_attention(parents, len(ids) - 1)
    assert_same(
        runner.forward(tokens, position_ids=positions, attention_mask=mask),
        hf.forward(tokens, position_ids=positions, attention_mask=mask),
    )
    runner.set_capture_layers([])
    hf.set_capture_layers([])


def test_batched_rows_match_the_hf_forward_row_by_row(smollm2_fp32, hf_reference):
    """Rows with different context lengths and token counts in non-adjacent slots (the gather path)."""
    prompts = ["Hi.", "Explain what a compiler does in two sentences.", "2 + 2 ="]
    outputs = []
    for target in both(smollm2_fp32, hf_reference):
        batched = BatchedTarget(target, slots=4, max_len=128)
        slots = [batched.acquire() for _ in range(4)][1:]  # slots 1..3; slot 0 stays empty
        contexts = [torch.tensor(target.encode(p)) for p in prompts]
        batched.forward(slots, contexts, logits=False)
        drafts = [torch.tensor([11, 12, 13]), torch.tensor([7]), torch.tensor([5, 6])]
        outputs.append(batched.forward(slots[::-1], drafts[::-1]))  # reversed: rows are not in slot order
    runner_out, hf_out = outputs
    for r, n in enumerate([2, 1, 3]):
        torch.testing.assert_close(runner_out.logits[r, :n], hf_out.logits[r, :n], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(runner_out.layer_hidden[r, :n], hf_out.layer_hidden[r, :n], atol=ATOL, rtol=RTOL)
    for target in (smollm2_fp32, hf_reference):
        target.set_capture_layers([])


def test_training_features_match_the_decoding_pass(smollm2):
    """A training pass over a text computes, bit for bit, what decoding it computes: a prefill of its first
    tokens, then one-token steps (in any dtype, with or without rounded inputs: the same kernels)."""
    ids = torch.tensor(smollm2.encode("A sentence to learn from, and a few words more."))
    smollm2.set_capture_layers([-1, 5])
    features = smollm2.features(ids)
    smollm2.reset()
    head = len(ids) - 3
    decoded = [smollm2.forward(ids[:head], logits=False)]
    decoded += [smollm2.forward(ids[i : i + 1], logits=False) for i in range(head, len(ids))]
    for name in ("layer_hidden", "last_hidden"):
        assert torch.equal(getattr(features, name), torch.cat([getattr(d, name) for d in decoded])), name
    smollm2.set_capture_layers([])


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler on this machine")
def test_the_cpp_layer_loop_computes_what_the_python_loop_computes(smollm2):
    """Bit for bit (the same kernels in the same order, only the glue moved to C++), with captured layers: a
    one-request chain of 1, 3 and 8 positions, and batched rows of unequal lengths in non-adjacent slots."""
    runner = smollm2.runner
    weights = runner.layer_weights
    assert weights  # the default target is a model type the C++ loop covers
    smollm2.set_capture_layers([-1, 2, 20])

    def both_loops(run):
        outputs = []
        for loop_weights in (weights, {}):  # {}: the Python loop
            runner.layer_weights = loop_weights
            outputs.append(run())
        runner.layer_weights = weights
        return outputs

    ids = torch.tensor(smollm2.encode("Count from one to ten, in words."))
    smollm2.reset()
    smollm2.forward(ids, logits=False)
    for k in (1, 3, 8):
        assert runner._cpp_loop_weights(smollm2.kv, Rows.chain(0, len(ids), k), k) is not None

        def verify(k=k):
            smollm2.rollback(len(ids))
            return smollm2.forward(ids[:k])

        cpp, python = both_loops(verify)
        for a, b in zip((cpp.logits, cpp.layer_hidden), (python.logits, python.layer_hidden), strict=True):
            assert torch.equal(a, b), k
    batched = BatchedTarget(smollm2, slots=4, max_len=64)
    slots = [batched.acquire() for _ in range(4)][1:]
    batched.forward(slots, [ids[:5], ids[:9], ids[:3]], logits=False)
    drafts = [torch.tensor([11, 12, 13]), torch.tensor([7]), torch.tensor([5, 6])]

    def rows():
        for slot, length in zip(slots, (5, 9, 3), strict=True):
            batched.rollback(slot, length)
        return batched.forward(slots[::-1], drafts)

    cpp, python = both_loops(rows)
    for r, n in enumerate([3, 1, 2]):
        assert torch.equal(cpp.logits[r, :n], python.logits[r, :n]) and torch.equal(
            cpp.layer_hidden[r, :n], python.layer_hidden[r, :n]
        )
    smollm2.set_capture_layers([])
    smollm2.reset()


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler on this machine")
@pytest.mark.parametrize("prompt_tokens", [None, 255])
def test_a_tree_pass_computes_what_chain_steps_compute(smollm2, prompt_tokens):
    """Bit for bit, on every root-to-leaf path, in the C++ layer loop and the Python one: a tree node sees the
    prefix and its ancestors in the same blocks and order as a chain's query at its depth, so greedy tree
    decoding is token-identical to normal decoding by construction, not by the luck of no near-ties. With a
    prefix of 254 entries the tree's nodes straddle the attention's first chunk boundary (256 entries)."""
    smollm2.set_capture_layers([4])
    ids = torch.tensor(smollm2.encode("List three prime numbers and explain why they are prime."))
    if prompt_tokens:
        ids = ids.repeat(prompt_tokens // len(ids) + 1)[:prompt_tokens]
    parents = torch.tensor([-1, -1, 0, 2, 1, -1])  # drafts' parents (-1: the root): three branches, one of depth four
    tokens = torch.tensor([int(ids[-1]), 791, 1345, 28, 2051, 418, 28])
    paths = [[0, 1, 3, 4], [0, 2, 5], [0, 6]]
    start = len(ids) - 1
    runner = smollm2.runner
    weights = runner.layer_weights
    for loop_weights in (weights, {}):  # the C++ layer loop, then the Python one
        runner.layer_weights = loop_weights
        smollm2.reset()
        smollm2.forward(ids[:-1], logits=False)
        mask, positions = tree_attention(parents, start)
        assert Rows.tree(0, start, positions, mask).paths is not None
        tree = smollm2.forward(tokens, position_ids=positions, attention_mask=mask)
        for path in paths:
            smollm2.rollback(start)
            chain = smollm2.forward(tokens[path])
            assert torch.equal(tree.logits[path], chain.logits), path
            assert torch.equal(tree.layer_hidden[path], chain.layer_hidden), path
    runner.layer_weights = weights
    smollm2.set_capture_layers([])
    smollm2.reset()


def test_only_tree_masks_take_the_cached_kernel():
    """A mask that hides part of the prefix, or shows a node more than its ancestors, keeps SDPA."""
    mask, positions = tree_attention(torch.tensor([-1, 0, 0]), 5)  # root at entry 5, a child with two children
    rows = Rows.tree(0, 5, positions, mask)
    assert rows.limits.tolist() == [[6, 7, 8, 8]]
    assert rows.paths[0].tolist() == [[5, 8, 8], [5, 6, 8], [5, 6, 7], [5, 6, 8]]  # padded past the path
    hidden = mask.clone()
    hidden[..., 2] = False
    assert Rows.tree(0, 5, positions, hidden).paths is None
    extra = mask.clone()
    extra[..., 1, 7] = True
    assert Rows.tree(0, 5, positions, extra).paths is None


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler on this machine")
@pytest.mark.parametrize("head_dim", [64, 128, 96, 24])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cached_attention_matches_sdpa_and_each_query_alone(head_dim, dtype):
    """The C++ attention over a float32 or bfloat16 cache attends like SDPA over the (widened) entries, and each
    query's result is bit for bit the same alone as among other rows and queries (verify = steps) and on one
    thread or two, though queries that see the same keys share value loads in tiles of up to three and a long
    slot is attended in chunks of 256 entries, joined in order (row 0 here spans three: alone, its three (row,
    kv head) pairs are split in a work item per chunk; in the batch, six pairs on two threads, each item joins its
    chunks as it goes; on one thread both ways join as they go). A bfloat16 cache is read in
    another order than a float32 one, so it is close to, not equal to, the float32 kernel over the same values.
    Where the CPU multiplies bfloat16 natively, scores take the queries rounded to bfloat16 and value sums the
    softmax weights rounded to bfloat16 (pairs of products per instruction): within 5e-3 of the float32 result
    with rounded queries (a weight's rounding is 2^-9 of it; a wrong pairing of dimensions or keys is off by
    the values' own size, ~1)."""
    torch.manual_seed(0)
    slots, kv_heads, capacity, group = 4, 3, 600, 3
    keys = torch.randn(slots, kv_heads, capacity, head_dim).to(dtype)
    values = torch.randn(slots, kv_heads, capacity, head_dim).to(dtype)
    q = torch.randn(2, kv_heads, group * 5, head_dim)
    rows = torch.tensor([3, 1])
    limits = torch.tensor([[540, 541, 542, 543, 544] * group, [7, 8, 9, 10, 11] * group])
    limits[0, 5:8] = 544  # three queries seeing the same keys in every block: one tile
    scale = head_dim**-0.5
    attend = torch.ops.specdecode.cached_attention
    out = attend(q, keys, values, rows, limits, scale)
    with torch_threads(1):
        assert torch.equal(attend(q, keys, values, rows, limits, scale), out)
    paired = dtype == torch.bfloat16 and head_dim % 32 == 0 and torch.ops.specdecode.bfloat16_panels()
    scored = q.to(torch.bfloat16).float() if paired else q
    close = attend(scored, keys.float(), values.float(), rows, limits, scale)
    tolerance = 5e-3 if paired else 1e-5
    torch.testing.assert_close(out, close, atol=tolerance, rtol=tolerance)
    for r, slot in enumerate(rows.tolist()):
        visible = torch.arange(capacity)[None] < limits[r][:, None]  # (queries, entries)
        expected = F.scaled_dot_product_attention(
            scored[r], keys[slot].float(), values[slot].float(), attn_mask=visible, scale=scale
        )
        torch.testing.assert_close(out[r], expected, atol=tolerance, rtol=tolerance)
        for m in range(limits.shape[1]):
            one = slice(m, m + 1)
            alone = attend(q[r : r + 1, :, one], keys, values, rows[r : r + 1], limits[r : r + 1, one], scale)
            assert torch.equal(alone[0, :, 0], out[r, :, m])


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler on this machine")
def test_cached_attention_refuses_to_read_outside_the_cache():
    """A slot past the cache's slots or a limit past its capacity is an error, never a read out of bounds."""
    keys = values = torch.zeros(2, 1, 16, 32)
    q = torch.zeros(1, 1, 2, 32)
    attend = torch.ops.specdecode.cached_attention
    assert attend(q, keys, values, torch.tensor([1]), torch.tensor([[16, 16]]), 1.0).shape == q.shape
    with pytest.raises(RuntimeError, match="slot lies outside"):
        attend(q, keys, values, torch.tensor([2]), torch.tensor([[3, 4]]), 1.0)
    with pytest.raises(RuntimeError, match="past the cache's capacity"):
        attend(q, keys, values, torch.tensor([0]), torch.tensor([[3, 17]]), 1.0)


def test_the_cache_holds_bfloat16_where_the_pass_rounds_to_that_class_already(smollm2, smollm2_fp32):
    """bfloat16 weights, or 8-bit inputs where the CPU reads bfloat16 natively: a bfloat16 cache (half the bytes
    a long or batched step reads); float32 weights on float32 inputs: a float32 cache."""
    weights = next(smollm2.model.parameters()).dtype
    rounded = weights == torch.bfloat16 or (smollm2.eight_bit_inputs and native_bfloat16())
    assert smollm2.kv.keys.dtype == smollm2.runner.cache_dtype == (torch.bfloat16 if rounded else weights)
    assert smollm2_fp32.kv.keys.dtype == torch.float32


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_kernel_is_exact_per_row_whatever_the_row_count(dtype):
    """Row r's output is bit-identical whether it is computed alone or beside 1..15 other rows (every tile
    shape runs: one weight row at 1-2 rows, 1 x 4 at 3-4, wider tiles above). With bfloat16 weights the
    result is the float32 product with the rounded weights and, where the CPU multiplies bfloat16 natively,
    the rows rounded to bfloat16 too."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(301, 203, generator=generator).to(dtype)  # odd sizes: the tails of both loops run
    x = torch.randn(FEW_ROWS_MAX, 203, generator=generator)
    alone = torch.cat([torch.ops.specdecode.few_rows_linear(x[r : r + 1], weight) for r in range(FEW_ROWS_MAX)])
    for m in range(1, FEW_ROWS_MAX + 1):
        assert torch.equal(torch.ops.specdecode.few_rows_linear(x[:m], weight), alone[:m]), m
    rows = x.bfloat16().float() if dtype == torch.bfloat16 and native_bfloat16() else x
    torch.testing.assert_close(alone, rows @ weight.float().T, atol=1e-4, rtol=1e-5)


def random_gguf_rows(kind: str, rows: int, inputs: int, generator: torch.Generator) -> torch.Tensor:
    """Rows as a GGUF stores them, per 32 weights: Q4_1 float16 d and m, then 16 bytes of 4-bit q; Q8_0
    float16 d, then 32 signed bytes."""
    blocks = inputs // 32
    d = (torch.rand(rows, blocks, generator=generator) * 0.02 + 1e-3).half().view(torch.uint8).view(rows, blocks, 2)
    if kind == "Q8_0":
        q = torch.randint(-128, 128, (rows, blocks, 32), generator=generator, dtype=torch.int8).view(torch.uint8)
        return torch.cat([d, q], dim=-1).reshape(rows, -1).contiguous()
    m = (-torch.rand(rows, blocks, generator=generator) * 0.1).half().view(torch.uint8).view(rows, blocks, 2)
    q = torch.randint(0, 16, (rows, blocks, 32), generator=generator, dtype=torch.uint8)
    return torch.cat([d, m, q[..., :16] | (q[..., 16:] << 4)], dim=-1).reshape(rows, -1).contiguous()


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler on this machine")
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_gguf_rows_compute_the_bits_of_their_float32_weights_at_every_row_count(kind):
    """The kernel over GGUF rows rebuilds each weight in float32 (d * q + m, d * q: the product is exact) and
    sums the same products in the same order as over the dequantized float32 weights: the same bits at 1..40
    rows (every tile shape), and the dequantization the runner checks rows with is the one the kernel computes."""
    generator = torch.Generator().manual_seed(0)
    blocks = random_gguf_rows(kind, 301, 192, generator)  # an odd number of outputs: the remainder columns run
    weight = dequantize(blocks, 192)
    x = torch.randn(40, 192, generator=generator)
    for m in range(1, 41):
        got = torch.ops.specdecode.few_rows_linear(x[:m], blocks)
        assert torch.equal(got, torch.ops.specdecode.few_rows_linear(x[:m], weight)), m
    torch.testing.assert_close(got, x @ weight.T, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="Q4_1 or Q8_0 blocks"):
        torch.ops.specdecode.few_rows_linear(x[:, :160], blocks)


def eight_bit_reference(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """What the 8-bit-input kernel computes, in float64: each input block rounded as llama.cpp's Q8_1 rounds it
    (d_x = max |x| / 127, q = round(x * 127 / max |x|) to nearest even), then d_w d_x sum(q_w q), plus
    m_w d_x sum(q) for Q4_1 rows."""
    rows, inputs = x.shape
    xb = x.view(rows, inputs // 32, 32)
    top = xb.abs().amax(-1)
    q = (xb * torch.where(top > 0, 127 / top, 0.0)[..., None]).round().double()  # float32 products, as the kernel's
    d_x = (top / 127).double()
    b = blocks.view(blocks.shape[0], inputs // 32, -1)
    d_w = b[..., 0:2].contiguous().view(torch.float16).double()[..., 0]
    if b.shape[-1] == 34:
        return torch.einsum("rbk,nbk,nb,rb->rn", q, b[..., 2:].contiguous().view(torch.int8).double(), d_w, d_x)
    m_w = b[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
    q_w = torch.cat([b[..., 4:] & 15, b[..., 4:] >> 4], dim=-1).double()
    return torch.einsum("rbk,nbk,nb,rb->rn", q, q_w, d_w, d_x) + (d_x * q.sum(-1)) @ m_w.T


@needs_q8_rows
@pytest.mark.parametrize(("kind", "row_bytes"), [("Q4_1", 20), ("Q8_0", 34)])
def test_eight_bit_inputs_are_exact_per_row_and_compute_llama_cpp_s_product(kind, row_bytes):
    """GGUF rows interleaved for 8-bit inputs: row r's output is bit-identical alone or beside 1..39 other rows
    (tiles of one to eight rows where the CPU has VNNI; of four, three, two, one elsewhere) on one thread and on
    two, it is the Q8_1 product (a float64 reference of the same rounding; only the float32 sums of its blocks
    differ), and within the inputs' rounding of the float32 product. Interleaving needs whole groups of the
    kernel's rows (16 with VNNI, else 8)."""
    generator = torch.Generator().manual_seed(0)
    blocks = random_gguf_rows(kind, 304, 192, generator)
    group = torch.ops.specdecode.q8_group_rows()
    packed = interleave(blocks, 192, group)
    assert packed.shape == (304 // group, 6, row_bytes * group) and interleave(blocks[:300], 192, group) is None
    x = torch.randn(40, 192, generator=generator)
    x[3, 32:64] = 0.0  # a block of zeros: scale 0, no division by it
    for count in sorted({1, 2, torch.get_num_threads()}):
        with torch_threads(count):
            alone = torch.cat([torch.ops.specdecode.few_rows_linear(x[r : r + 1], packed) for r in range(len(x))])
            for m in (2, 3, 4, 5, 6, 7, 8, 9, 12, 14, 15, 16, 40):
                assert torch.equal(torch.ops.specdecode.few_rows_linear(x[:m], packed), alone[:m]), (count, m)
    torch.testing.assert_close(alone.double(), eight_bit_reference(x, blocks), atol=1e-5, rtol=1e-5)
    exact = x @ dequantize(blocks, 192).T
    assert (alone - exact).abs().max() < 0.02 * exact.abs().max()  # inputs rounded to ~0.4% of a block's largest
    assert (alone - exact).abs().max() > 1e-5  # and rounded: not the float32 product
    with pytest.raises(RuntimeError, match="interleaved Q4_1 or Q8_0 groups"):
        torch.ops.specdecode.few_rows_linear(x[:, :160], packed)


def test_a_target_shipped_as_gguf_rows_runs_on_them_where_measured_faster_than_bfloat16(smollm2, monkeypatch, tmp_path):
    """On a CPU the default weights are float32 over the GGUF's own Q4_1 / Q8_0 rows (the 8-bit-input kernel a
    candidate) where the target ships as such rows and they streamed faster than bfloat16 weights (Zen 4: 5.3 ms
    against 10.6); otherwise bfloat16 where it is native and faster than float32. The converted folder's marker
    keeps whether the GGUF holds such rows."""
    source = converted_dir("smollm2-135m")
    assert holds_rows(source) and json.loads((source / SOURCE_MARKER).read_text())["holds_rows"] is True
    assert not holds_rows(tmp_path) and not holds_rows(None)
    ms = {FLOAT32: 30.0, BFLOAT16: 10.0, ROWS_8_BIT: 5.0}
    monkeypatch.setattr(linear_module, "weight_format_ms", lambda: ms)
    assert default_dtype("cpu", str(source)) == torch.float32
    assert default_dtype("cpu", str(tmp_path)) == torch.bfloat16
    ms[ROWS_8_BIT] = 12.0
    assert default_dtype("cpu", str(source)) == torch.bfloat16
    monkeypatch.setattr(linear_module, "weight_format_ms", dict)  # bfloat16 emulated: nothing timed
    assert default_dtype("cpu", str(source)) == default_dtype("cpu", str(tmp_path)) == torch.float32
    assert default_dtype("cuda", str(source)) == torch.bfloat16


def test_a_drafter_s_weights_round_to_q8_0_rows_that_every_kernel_reads_alike():
    """`quantize_q8_0` rounds each weight to the nearest multiple of its block's float16 scale (max |w| / 127), and
    rounding the result again changes nothing; a drafter frozen for 8-bit inputs keeps those rows beside the
    float32 weights they stand for (so its float32 kernels multiply the same weights), except where a matrix's
    rows do not fill the 8-bit-input kernel's groups."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 96, generator=g) * 0.1
    weight[3, 32:64] = 0  # an all-zero block: scale 0, weights 0
    blocks = quantize_q8_0(weight)
    assert blocks.shape == (24, 3 * 34) and blocks.dtype == torch.uint8
    scales = blocks.view(24, 3, 34)[..., :2].contiguous().view(torch.float16).float()
    rounded = dequantize(blocks, 96)
    assert torch.all((rounded - weight).abs().view(24, 3, 32) <= scales / 2 * (1 + 1e-3) + 1e-12)
    assert torch.equal(dequantize(quantize_q8_0(rounded), 96), rounded) and not rounded[3, 32:64].any()
    module = torch.nn.Sequential(
        torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 12, bias=False), torch.nn.Linear(32, 24, bias=False)
    )
    freeze_linears(module, "test-q8-drafter", kernel="stock", eight_bit_inputs=True, rows="Q8_0")
    rows, odd, half = (m.linear for m in module if isinstance(m, FrozenLinear))
    assert rows.blocks.shape == (32, 2 * 34)
    assert torch.equal(dequantize(rows.blocks, 64), rows.weight) and odd.blocks is None  # 12 rows: not whole groups
    # 24 rows fill groups of eight (AVX2), not of sixteen (AVX512-VNNI), where they would keep float32 inputs
    assert (half.blocks is not None) == (q8_group_rows() == 8)


def test_a_drafter_s_weights_round_to_q4_1_rows_by_default():
    """`quantize_q4_1` puts each weight on its block's grid m + d q (m the block's minimum, d its range / 15, both
    float16; q in 0 .. 15): within half a step of where it was, the block's extremes on the grid's ends, an
    all-zero block all zero; a drafter frozen for 8-bit inputs keeps Q4_1 rows unless told Q8_0 (the kernel reads
    them as a GGUF's: `test_eight_bit_inputs_are_exact_per_row_and_compute_llama_cpp_s_product`)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 96, generator=g) * 0.1
    weight[3, 32:64] = 0
    blocks = quantize_q4_1(weight)
    assert blocks.shape == (24, 3 * 20) and blocks.dtype == torch.uint8
    halves = blocks.view(24, 3, 20)[..., :4].contiguous().view(torch.float16).float()
    d, m = halves[..., 0:1], halves[..., 1:2]
    rounded = dequantize(blocks, 96).view(24, 3, 32)
    error = (rounded - weight.view(24, 3, 32)).abs()
    assert torch.all(error <= d / 2 * 1.01 + m.abs() * 2e-3 + 1e-9)
    assert torch.allclose(rounded.amin(-1), weight.view(24, 3, 32).amin(-1), atol=1e-3)
    assert not rounded[3, 1].any()
    module = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    freeze_linears(module, "test-q4-drafter", kernel="stock", eight_bit_inputs=True)
    (rows,) = (m.linear for m in module if isinstance(m, FrozenLinear))
    assert rows.blocks.shape == (32, 2 * 20) and torch.equal(dequantize(rows.blocks, 64), rows.weight)


@needs_q8_rows
def test_eight_bit_inputs_on_the_default_target_stay_lossless_and_near_float32_inputs(smollm2_fp32):
    """The default target with its GGUF linears on 8-bit inputs (forced, whatever this machine would choose):
    speculative decoding at T = 0 gives normal decoding's tokens, and the logits stay near those of float32
    inputs (measured on SmolLM2: the logit vector 4% apart at the median position, the same argmax at 97-100%
    of positions; a wrong layout or scale moves every position by whole units)."""
    target = Target.load("smollm2-135m", dtype=torch.float32, kernel="few-rows-q8")
    assert target.rounds_inputs and not smollm2_fp32.rounds_inputs
    ids = torch.tensor(target.encode("Write a Python function that returns the sum of a list."))
    rounded, exact = (t.lm_head(t.features(ids).last_hidden) for t in (target, smollm2_fp32))
    apart = (rounded - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert 1e-3 < apart.median() < 0.1
    assert (rounded.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    speculative = SpeculativeDecoder(target, build_drafter("ngram", target), draft_length=8)
    for prompt in ("Repeat after me: the quick brown fox jumps over the lazy dog.", "Count from 1 to 20."):
        prompt_ids = target.encode(prompt)
        reference = normal.generate(prompt_ids, SamplingParams(), max_new_tokens=48)[0].token_ids
        completion = speculative.generate(prompt_ids, SamplingParams(), max_new_tokens=48)[0]
        assert completion.token_ids == reference and completion.stats.position_attempts


def test_an_exact_plan_takes_eight_bit_inputs_at_every_bucket_or_at_none():
    """The 8-bit-input kernel computes other bits than the float32 ones: where it is the fastest at one row
    count and not at another, the exact buckets still all take one family, the faster in sum, and the larger
    buckets the fastest of that family."""
    q8, gguf, floats = "few-rows-q8", "few-rows-gguf", "few-rows"
    timings = {1: {floats: 9.0, gguf: 5.0, q8: 3.5}, 2: {floats: 9.0, gguf: 5.0, q8: 4.0}}  # q8 28.5 ms in sum, gguf 28
    timings |= {b: {floats: 9.0, gguf: 6.0, q8: 7.0} for b in (4, 8, 16)}
    timings |= {b: {"onednn": 1.0, gguf: 6.0, q8: 0.5} for b in (32, 64)} | {128: {"onednn": 1.0, q8: 5.0}}
    larger = {32: "onednn", 64: "onednn", 128: "onednn"}
    assert same_bits_where_exact(timings) == {1: gguf, 2: gguf, 4: gguf, 8: gguf, 16: gguf} | larger
    timings[8][q8] = 2.0
    assert same_bits_where_exact(timings) == {b: q8 for b in ROW_BUCKETS}


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler on this machine")
def test_the_default_target_streams_its_gguf_rows_with_the_same_logits(smollm2):
    """SmolLM2's decoder linears are Q4_1 in its GGUF and its tied LM head Q8_0: the runner finds every one's
    rows (q and k reordered as the conversion reordered them), and a pass through them computes the float32
    plan's logits bit for bit."""
    if smollm2.dtype != torch.float32:
        pytest.skip("GGUF rows serve float32 targets; this machine chose bfloat16")
    linears = smollm2.runner.linears()
    assert all(lin.blocks is not None for lin in linears)
    assert all(torch.equal(dequantize(lin.blocks, lin.weight.shape[1]), lin.weight) for lin in linears)
    # vLLM loads every *.safetensors of a model folder as weights: the rows' cache beside them must not be one
    assert [p.name for p in converted_dir("smollm2-135m").glob("*.safetensors")] == ["model.safetensors"]
    ids = torch.tensor(smollm2.encode("Name three rivers in Europe."))
    plans = [dict(lin.plan) for lin in linears]
    outputs, weights_read = {}, {}
    try:
        for kernel in ("few-rows-gguf", "few-rows"):
            for lin in linears:
                lin.plan = {b: kernel if b <= FEW_ROWS_MAX else k for b, k in lin.plan.items()}
            weights_read[kernel] = smollm2.runner.weight_bytes_read(1)
            smollm2.reset()
            smollm2.forward(ids[:-3], logits=False)
            outputs[kernel] = [smollm2.forward(ids[-3:-2]).logits, smollm2.forward(ids[-2:]).logits]
    finally:
        for lin, plan in zip(linears, plans, strict=True):
            lin.plan = plan
        smollm2.reset()
    for a, b in zip(outputs["few-rows-gguf"], outputs["few-rows"], strict=True):
        assert torch.equal(a, b)
    # what a one-token pass reads (the premise's read roofline): the rows where the plan streams them
    saved = sum(lin.weight.nbytes - lin.blocks.nbytes for lin in linears)
    assert weights_read["few-rows"] - weights_read["few-rows-gguf"] == saved
    assert weights_read["few-rows-gguf"] < 0.3 * weights_read["few-rows"]


@pytest.mark.skipif(
    not cpu_kernels_available() or not torch.ops.specdecode.bfloat16_panels(), reason="no native bfloat16 products"
)
def test_bfloat16_panels_are_exact_per_row_and_compute_the_rounded_product():
    """The panel layout: row r's output is bit-identical alone (four groups at a time, then one by one: 7 groups
    on one thread and on two) or beside up to 39 other rows (two rows two groups at a time; one tile up to eight
    rows, then tiles of at most six, several a group), and equals the product of the bfloat16-rounded rows and
    weights."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(448, 202, generator=generator).bfloat16()
    assert panels_fit(weight) and not panels_fit(weight[:100]) and not panels_fit(weight.float())
    panels = pack_panels(weight)
    x = torch.randn(40, 202, generator=generator)
    for count in sorted({1, 2, torch.get_num_threads()}):
        with torch_threads(count):
            alone = torch.cat([torch.ops.specdecode.few_rows_linear(x[r : r + 1], panels) for r in range(len(x))])
            for m in (2, 3, 5, 6, 7, 8, 9, 12, 13, 16, 40):
                assert torch.equal(torch.ops.specdecode.few_rows_linear(x[:m], panels), alone[:m]), (count, m)
    torch.testing.assert_close(alone, x.bfloat16().float() @ weight.float().T, atol=1e-4, rtol=1e-5)
    assert Linear(weight).kernel_weight.shape == (7, 101, 128)


def test_forced_kernels_compute_the_same_and_auto_picks_a_measured_candidate(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(linear_module, "MAX_FOREIGN_CORES", math.inf)  # whatever else runs: cached
    monkeypatch.setattr(linear_module, "_PLANNED_HERE", {})
    generator = torch.Generator().manual_seed(1)
    linears = [Linear(torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator))]
    x = torch.randn(5, 64, generator=generator)
    expected = x @ linears[0].weight.T + linears[0].bias
    for kernel in ("stock", "onednn", "few-rows"):
        plan_kernels(linears, kernel, {"test": kernel})
        torch.testing.assert_close(linears[0](x), expected, atol=1e-4, rtol=1e-5)
    plan = plan_kernels(linears, "auto", {"test": "auto"}, reps=1)
    for rows, timings in plan["timings"].items():
        assert plan["choice"][rows] == min(timings, key=timings.get)
    assert list(tmp_path.glob("specdecode/kernel-plans/*.json"))  # measured once, then read back, not re-timed
    linear_module._PLANNED_HERE.clear()  # as a new process finds it: in the file alone
    again = plan_kernels(linears, "auto", {"test": "auto"})
    assert again["choice"] == plan["choice"] and again["timings"] == json.loads(json.dumps(plan["timings"]))


def test_a_kernel_far_behind_in_the_first_sweeps_is_timed_no_more(monkeypatch):
    """The planner's race: a kernel several times the fastest in the warm-up and the first timed sweep sits out
    the remaining sweeps, keeping that sweep's time; the others are timed every sweep. One slow sweep alone (a
    burst of another process's load) puts no kernel out."""
    calls: dict[str, int] = {}
    slow = {"onednn": {1, 2}, "stock": {2}}  # the calls (1 = the warm-up) that take 10x
    clock = [0.0]  # the planner's clock, moved by the kernels alone: no other process's load can change the race

    def run(self, x, kernel):
        calls[kernel] = calls.get(kernel, 0) + 1
        clock[0] += 0.02 if calls[kernel] in slow.get(kernel, ()) else 0.002

    monkeypatch.setattr(Linear, "run", run)
    monkeypatch.setattr(linear_module.time, "perf_counter", lambda: clock[0])
    kernels = ["stock", "onednn", "few-rows"]
    timings = linear_module._time_sweeps([Linear(torch.zeros(4, 4))], kernels, rows=1, reps=4)
    assert calls == {"stock": 5, "onednn": 2, "few-rows": 5}  # a warm-up and four timed sweeps; a warm-up and one
    assert timings == pytest.approx({"stock": 2.0, "onednn": 20.0, "few-rows": 2.0})  # ms; stock's slow sweep not kept


def test_a_plan_measured_beside_other_processes_is_not_cached(tmp_path, monkeypatch):
    """A kernel plan or dtype choice timed while other processes held a core serves that process only."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(linear_module, "MAX_FOREIGN_CORES", -1.0)  # every measurement counts as contaminated
    monkeypatch.setattr(linear_module, "_PLANNED_HERE", {})
    linears = [Linear(torch.randn(96, 64, generator=torch.Generator().manual_seed(1)))]
    plan = plan_kernels(linears, "auto", {"test": "loaded"}, reps=1)
    assert set(plan["choice"]) == set(ROW_BUCKETS) and not list(tmp_path.glob("specdecode/kernel-plans/*.json"))
    monkeypatch.setattr(linear_module, "_time_sweeps", None)  # the same model planned again in this process:
    assert plan_kernels(linears, "auto", {"test": "loaded"}, reps=1)["choice"] == plan["choice"]  # not re-timed


def test_a_damaged_cached_plan_is_timed_again(tmp_path, monkeypatch):
    """A plan file cut short (its writer killed) is measured again and rewritten, not a JSONDecodeError."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(linear_module, "MAX_FOREIGN_CORES", float("inf"))  # cached whatever the load
    monkeypatch.setattr(linear_module, "_PLANNED_HERE", {})
    linears = [Linear(torch.randn(96, 64, generator=torch.Generator().manual_seed(1)))]
    plan_kernels(linears, "auto", {"test": "damaged"}, reps=1)
    (path,) = tmp_path.glob("specdecode/kernel-plans/*.json")
    path.write_text(path.read_text()[:40])
    monkeypatch.setattr(linear_module, "_PLANNED_HERE", {})
    assert set(plan_kernels(linears, "auto", {"test": "damaged"}, reps=1)["timings"]) == set(ROW_BUCKETS)
    assert json.loads(path.read_text())["choice"]


def _hold_build_lock(build, seconds: float) -> subprocess.Popen:
    """Another process that takes the kernels' build lock, leaves torch's lock file as a build does, sleeps, then
    marks that it slept."""
    code = (
        "import fcntl, pathlib, sys, time; d = pathlib.Path(sys.argv[1]); h = open(d / 'specdecode.lock', 'w'); "
        "fcntl.flock(h, fcntl.LOCK_EX); (d / 'lock').touch(); print('held', flush=True); "
        "time.sleep(float(sys.argv[2])); (d / 'slept').touch()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(build), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_build_killed_midway_does_not_block_the_next_and_a_live_one_is_waited_for(tmp_path, capsys):
    """torch's lock file, left behind by a build killed midway, made every later process wait forever (stop 71:
    a timeout during the first build); under specdecode's flock it is stale and goes. A live build is waited for."""
    killed = _hold_build_lock(tmp_path, 60)
    killed.kill()
    killed.wait()
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "waiting" not in capsys.readouterr().err
    live = _hold_build_lock(tmp_path, 1.0)
    with build_lock(tmp_path):
        assert (tmp_path / "slept").exists() and not (tmp_path / "lock").exists()  # entered once the holder was done
    live.wait()
    assert "waiting for another process building" in capsys.readouterr().err


def test_builds_of_checkouts_that_are_gone_are_pruned_unless_held(tmp_path):
    """Each checkout builds the kernels in a folder of its own, and every clean clone that ran the tests left one."""
    builds = {}
    for name, checkout in (("gone", tmp_path / "no-such-clone"), ("here", tmp_path), ("held", tmp_path / "gone-too")):
        builds[name] = tmp_path / "kernels" / name
        builds[name].mkdir(parents=True)
        (builds[name] / linear_module.CHECKOUT_FILE).write_text(str(checkout))
    (tmp_path / "kernels" / "older-format").mkdir()  # no checkout recorded: left alone
    holder = _hold_build_lock(builds["held"], 60)
    try:
        prune_builds(tmp_path / "kernels")
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == ["held", "here", "older-format"]


def test_one_request_cache_grows_past_its_first_capacity():
    model = tiny_llama(vocab_size=24)
    target = Target(model, tiny_tokenizer(24), name="tiny")
    reference = Target(model, tiny_tokenizer(24), name="tiny-hf", runner=False)
    capacity = 16
    target.kv = target.new_cache(1, capacity)
    ids = torch.randint(2, 24, (capacity + 20,), generator=torch.Generator().manual_seed(0))
    head = capacity - 10
    out = [t.forward(ids[:head]) and t.forward(ids[head:]) for t in (target, reference)]
    assert target.kv.capacity > capacity
    torch.testing.assert_close(out[0].logits, out[1].logits, atol=1e-4, rtol=1e-4)


def test_a_float32_drafter_trains_through_a_frozen_bfloat16_head():
    """A whole-vocabulary block drafter's logits come from the target's head, which is bfloat16 wherever the
    target runs in bfloat16: a float32 trainer's activations must pass through it, gradients and all."""
    generator = torch.Generator().manual_seed(0)
    head = Linear(torch.randn(96, 64, generator=generator).bfloat16())
    x = torch.randn(5, 64, generator=generator, requires_grad=True)
    y = head(x)
    y.sum().backward()
    assert y.dtype == torch.float32 and x.grad is not None and x.grad.dtype == torch.float32
    torch.testing.assert_close(y, (x.bfloat16() @ head.weight.T).float())


@pytest.fixture
def thp_mode(tmp_path, monkeypatch):
    """The kernel's transparent-huge-page mode as `models/huge_pages.py` reads it: a file of the test's, `madvise`
    until the test writes another."""
    from specdecode.models import huge_pages

    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", mode)
    return mode


def test_weights_on_huge_pages_are_the_same_bytes_packed_in_order(thp_mode):
    """`on_huge_pages` copies tensors into one mapping (the first at a 2 MB boundary, each at 64 bytes), equal to
    the originals; where the kernel has transparent huge pages off it copies nothing."""
    from specdecode.models import huge_pages

    tensors = [torch.randint(0, 255, (3, 5, 20), dtype=torch.uint8), torch.randn(7, 9), torch.arange(5)]
    thp_mode.write_text("always madvise [never]\n")
    assert huge_pages.on_huge_pages(tensors) is None
    thp_mode.write_text("always [madvise] never\n")
    copies = huge_pages.on_huge_pages(tensors)
    assert [c.dtype for c in copies] == [t.dtype for t in tensors]
    assert all(torch.equal(c, t) and c.is_contiguous() for c, t in zip(copies, tensors, strict=True))
    starts = [c.data_ptr() for c in copies]
    assert starts[0] % huge_pages.HUGE_PAGE == 0 and all(s % 64 == 0 for s in starts)
    assert starts == sorted(starts) and starts[-1] - starts[0] < 2048  # packed, in order
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1


def test_the_runner_streams_its_8_bit_weights_from_one_mapping_in_pass_order(smollm2):
    """Where the 8-bit kernel runs the target's linears and the kernel has huge pages, their rows sit in one
    mapping in the order a pass reads them (layer by layer, the LM head last)."""
    from specdecode.models.huge_pages import huge_pages_available

    linears = [lin for lin in smollm2.runner.linears() if EIGHT_BIT_INPUTS in lin.plan.values()]
    if not linears or not huge_pages_available():
        pytest.skip("no 8-bit kernel or no transparent huge pages on this machine")
    weights = [lin.few_rows_weight(EIGHT_BIT_INPUTS) for lin in linears]
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    starts = [w.data_ptr() for w in weights]
    assert starts == sorted(starts)


def test_bfloat16_panels_move_to_huge_pages_and_still_compute_the_same(thp_mode):
    """A linear planned on the few-rows kernel over bfloat16 panels (a packed copy of its own) reads them from the
    huge-page mapping afterwards, with the same output bits; its float weight as loaded stays where it was."""
    from specdecode.models import huge_pages

    torch.manual_seed(0)
    linears = [Linear(torch.randn(128, 64).to(torch.bfloat16)) for _ in range(2)]
    if not panels_fit(linears[0].weight):
        pytest.skip("no native bfloat16 panels on this CPU")
    x = torch.randn(3, 64)
    for lin in linears:
        lin.plan = {b: "few-rows" for b in ROW_BUCKETS}
    before = [lin(x) for lin in linears]
    weights = [lin.weight for lin in linears]
    linear_module.kernel_weights_on_huge_pages(linears)
    panels = [lin.few_rows_weight("few-rows") for lin in linears]
    assert len({p.untyped_storage().data_ptr() for p in panels}) == 1
    assert panels[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(lin.weight is w for lin, w in zip(linears, weights, strict=True))
    assert all(torch.equal(lin(x), b) for lin, b in zip(linears, before, strict=True))
