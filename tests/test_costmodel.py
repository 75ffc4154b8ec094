"""The cost model must reproduce the chapter's numbers and count real models' parameters exactly."""

import dataclasses
import json
import math
import re
import statistics
import time

import pytest
import torch

from specdecode.costmodel import (
    DTYPE_BYTES,
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    Hardware,
    ModelShape,
    best_draft_length,
    cost_report,
    entries_cost,
    expected_accepted_length,
    expected_speedup,
    format_cost_table,
    gate_matrix_bytes,
    get_hardware,
    kv_read_bytes,
    pass_cost,
    probe_cpu_hardware,
)
from specdecode.errors import SpecDecodeError
from tests.conftest import needs_q8_rows

LLAMA = MODEL_PRESETS["llama-3-8b"]
H100 = HARDWARE_PRESETS["h100-sxm"]

LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


# ---- the chapter's numbers --------------------------------------------------------------------------


def test_llama_8b_read_time_is_4_8_ms():
    cost = pass_cost(LLAMA, H100, "bf16", 1)
    assert cost.read_ms == pytest.approx(4.8, rel=0.03)
    assert cost.bound == "memory"


def test_llama_8b_math_per_position_is_0_016_ms():
    cost = pass_cost(LLAMA, H100, "bf16", 8)
    assert cost.math_ms / 8 == pytest.approx(0.016, rel=0.05)


def test_five_positions_cost_the_same_as_one():
    assert pass_cost(LLAMA, H100, "bf16", 5).pass_ms == pass_cost(LLAMA, H100, "bf16", 1).pass_ms


def test_gate_matrix_is_117_mb():
    assert gate_matrix_bytes(LLAMA, "bf16") == 4096 * 14336 * 2
    assert round(gate_matrix_bytes(LLAMA, "bf16") / 1e6) == 117


def test_llama_8b_weights_are_16_06_gb():
    assert LLAMA.total_params == pytest.approx(8.03e9, rel=0.005)
    assert LLAMA.weight_bytes("bf16") / 1e9 == pytest.approx(16.06, abs=0.01)


def test_many_positions_are_compute_bound():
    one = pass_cost(LLAMA, H100, "bf16", 1)
    many = pass_cost(LLAMA, H100, "bf16", 4096)
    assert many.bound == "compute"
    assert many.read_ms == one.read_ms  # weights are read once whatever the number of positions
    assert many.pass_ms > many.read_ms
    assert many.pass_ms == pytest.approx(many.math_ms)


def test_pass_is_at_least_each_total_and_at_most_their_sum():
    for positions in (1, 64, 256, 300, 512, 4096):
        cost = pass_cost(LLAMA, H100, "bf16", positions, context_len=2048)
        assert max(cost.read_ms, cost.math_ms) <= cost.pass_ms <= cost.read_ms + cost.math_ms + 1e-12


def test_context_adds_attention_math_and_optional_kv_read():
    bare = pass_cost(LLAMA, H100, "bf16", 4)
    ctx = pass_cost(LLAMA, H100, "bf16", 4, context_len=8192)
    kv = pass_cost(LLAMA, H100, "bf16", 4, context_len=8192, include_kv_read=True)
    attn_flops = 32 * 4 * 8192 * (32 * 128) * 4
    assert ctx.math_ms - bare.math_ms == pytest.approx(attn_flops / 989e12 * 1e3)
    assert ctx.read_ms == bare.read_ms
    kv_bytes = 32 * 2 * 8192 * 8 * 128 * 2
    assert kv.read_ms - bare.read_ms == pytest.approx(kv_bytes / 3.35e12 * 1e3)


def test_entries_cost_is_pass_costs_sum_over_the_same_entries():
    """`pass_cost` prices its parameters through `entries_cost`; any (bytes, FLOPs) entries are summed alike."""
    cost = pass_cost(LLAMA, H100, "bf16", 8, context_len=4096, include_kv_read=True)
    layer = (LLAMA.layer_params * 2 + kv_read_bytes(LLAMA, 4096, 2), 2 * LLAMA.layer_params * 8 + 4 * 4096 * 4096 * 8)
    head = LLAMA.lm_head_params + LLAMA.hidden_size
    entries = [(LLAMA.embedding_params * 2, 2 * LLAMA.embedding_params * 8), *[layer] * 32, (head * 2, 2 * head * 8)]
    assert entries_cost(entries, H100, "bf16", 8) == pytest.approx(cost)
    with pytest.raises(SpecDecodeError, match="positions"):
        entries_cost(entries, H100, "bf16", 0)


def test_premise_prices_the_runner_by_what_it_streams_and_the_multiply_it_runs(smollm2):
    """The default runner's roofline reads what its kernels stream and its cache holds (SmolLM2's GGUF rows: ~97
    MB, where its float32 weights are 538 MB) at the peak of the multiply its linears run (8-bit where they round
    their inputs to 8 bits); the HF forward's is the float weights'. Until stop 67 every variant was priced as
    the float weights, ~3x the bytes the default streams."""
    from specdecode.evaluation.premise import configuration_cost, roofline_dtype
    from specdecode.models.linear import EIGHT_BIT_INPUTS

    hw = Hardware("probe", 50e9, {"fp32": 200e9, "bf16": 400e9, "int8": 800e9})
    shape = ModelShape.from_hf_config(smollm2.source)
    runner = smollm2.runner
    macs = sum(lin.weight.numel() for lin in runner.linears())
    for k, context in ((1, 128), (16, 1024)):
        cost = configuration_cost(smollm2, shape, hw, k, context)
        cache = shape.num_layers * kv_read_bytes(shape, context, runner.cache_dtype.itemsize)
        assert cost.read_ms == pytest.approx((runner.weight_bytes_read(k) + cache) / hw.bandwidth_bytes_per_s * 1e3)
        multiply = roofline_dtype(smollm2, k)
        assert (multiply == "int8") == (runner.layers[0].qkv.kernel_for(k) == EIGHT_BIT_INPUTS)
        attention = shape.num_layers * 4 * context * shape.q_dim * k
        assert cost.math_ms == pytest.approx((2 * macs * k + attention) / hw.flops_for(multiply) * 1e3)
    float_weights = pass_cost(shape, hw, "fp32", 1, 128, include_kv_read=True)
    if runner.layers[0].qkv.kernel_for(1) in ("few-rows-gguf", EIGHT_BIT_INPUTS):  # the GGUF's rows are streamed
        assert configuration_cost(smollm2, shape, hw, 1, 128).read_ms < float_weights.read_ms / 3


@needs_q8_rows
def test_the_8_bit_peak_bounds_what_the_8_bit_kernel_multiplies(smollm2):
    """A roofline's peak is an upper bound: the probed 8-bit multiply rate is at least what the runner's 8-bit-input
    kernel reaches over the LM head at 16 rows on every thread. Until stop 70 the peak was torch._int_mm's alone,
    2.3 GFLOP/s on an AVX2 Zen 3 without VNNI (oneDNN has no fast path there), where the kernel runs at ~190."""
    from specdecode.costmodel import _probe_cpu_flops
    from specdecode.models.linear import EIGHT_BIT_INPUTS

    head = smollm2.runner.lm_head
    rows = torch.randn(16, head.weight.shape[1])
    head.run(rows, EIGHT_BIT_INPUTS)  # the interleaved rows are made on first use
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        head.run(rows, EIGHT_BIT_INPUTS)
        best = min(best, time.perf_counter() - start)
    achieved = 2 * rows.shape[0] * head.weight.numel() / best
    assert _probe_cpu_flops("int8") >= achieved


def test_kv_read_bytes_are_the_runner_caches_bytes():
    """The premise's roofline counts the KV cache a pass reads: per layer, what the runner's cache holds for that
    many entries (keys and values, in its dtype)."""
    from tests.conftest import tiny_target

    target = tiny_target()
    shape = ModelShape.from_hf_config(target.config.to_dict())
    runner = target.runner
    for entries in (1, 37):
        cache = runner.new_cache(1, entries)
        assert shape.num_layers * kv_read_bytes(shape, entries, runner.cache_dtype.itemsize) == cache.nbytes


def test_premise_pairs_each_repetition_with_its_own_bandwidth_probe():
    """A machine that halves its bandwidth for half the repetitions doubles their pass times: the paired ratio
    stays that of either state, where one probe taken in the fast state would call every slow pass 2x over."""
    from specdecode.evaluation.premise import paired_roofline_ratio

    bytes_read = 300e6
    fast, slow = 60e9, 30e9
    times = [1.5 * bytes_read / fast * 1e3] * 3 + [1.5 * bytes_read / slow * 1e3] * 4  # 1.5x the roofline in each
    assert paired_roofline_ratio(times, [fast] * 3 + [slow] * 4, bytes_read) == pytest.approx(1.5)
    assert statistics.median(times) / (bytes_read / fast * 1e3) == pytest.approx(3.0)  # unpaired, fast probe


def test_premise_pairs_t_k_with_the_t_1_of_its_own_repetition():
    """When t(1) and t(8) move apart with the memory state, the medians of each can come from different states and
    give a ratio no repetition showed; the median of the paired ratios is one that a repetition did show."""
    from specdecode.evaluation.premise import paired_ratio

    fast, slow, middle = (8.0, 14.0), (11.0, 12.0), (9.5, 11.0)  # (t(1), t(8)) ms in three memory states
    reps = [fast] * 3 + [slow] * 3 + [middle]
    ones, eights = [r[0] for r in reps], [r[1] for r in reps]
    unpaired = statistics.median(eights) / statistics.median(ones)
    assert all(abs(unpaired - e / o) > 0.05 for o, e in reps)
    assert paired_ratio(eights, ones) in {e / o for o, e in reps}


def test_premise_runs_end_to_end_on_a_local_model(tmp_path):
    """`bench premise` on a tiny local model folder: one bandwidth probe per kept repetition and context, the
    paired t(1) / read roofline in the JSON and in the summary table, with the probe's median and range."""
    from specdecode.evaluation.premise import run_premise
    from tests.conftest import tiny_llama, tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_llama(vocab_size=160).save_pretrained(folder)  # the premise draws token ids from 100 up
    tiny_tokenizer(160).save_pretrained(folder)
    run_premise(str(folder), positions=[1, 2], contexts=[6, 12], reps=2, out_dir=str(tmp_path / "out"))
    data = json.loads((tmp_path / "out" / "premise.json").read_text())
    samples = data["cpu_probe"]["read_gb_per_s_per_repetition"]
    assert {c: len(v) for c, v in samples.items()} == {"6": 2, "12": 2}
    assert all(b > 0 for v in samples.values() for b in v)
    paired = data["t1_over_read_roofline_paired"]
    assert set(paired) == {"6", "12"} and all(r > 0 for r in paired.values())
    summary = (tmp_path / "out" / "premise.md").read_text()
    assert f"| {paired['6']:.2f} |" in summary
    for context in (6, 12):  # the probe's median and range end each context's row (the JSON keeps 0.1 GB/s)
        row = next(line for line in summary.splitlines() if line.startswith(f"| {context} | "))
        median, low, high = map(float, re.search(r"\| (\d+) \((\d+)-(\d+)\) \|$", row).groups())
        probed = samples[str(context)]
        assert low - 1 <= min(probed) and max(probed) <= high + 1 and abs(median - statistics.median(probed)) <= 1


def test_premise_refuses_contexts_past_the_targets_window(tmp_path):
    """One clear error before the variants load and minutes of prefill, not a pass past the window."""
    from specdecode.evaluation.premise import run_premise
    from tests.conftest import tiny_llama, tiny_tokenizer

    folder = tmp_path / "tiny"
    model = tiny_llama(vocab_size=160)
    model.save_pretrained(folder)
    tiny_tokenizer(160).save_pretrained(folder)
    window = model.config.max_position_embeddings
    with pytest.raises(SpecDecodeError, match=f"context {window} plus 2 positions passes .* {window} tokens"):
        run_premise(str(folder), positions=[1, 2], contexts=[6, window], reps=1, out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ---- parameter counts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("smollm2-135m", 134_515_008),
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("qwen3-8b", 8_190_735_360),
        ("qwen3-4b", 4_022_468_096),
        # The HF checkpoint ties its embeddings (494,032,768); the shipped GGUF stores a separate output.
        ("qwen2.5-coder-0.5b", 494_032_768 + 151936 * 896),
    ],
)
def test_parameter_counts_match_the_real_models(name, params):
    assert MODEL_PRESETS[name].total_params == params


def test_smollm2_count_by_hand():
    shape = MODEL_PRESETS["smollm2-135m"]
    attention = 576 * 576 * 2 + 576 * 192 * 2
    mlp = 3 * 576 * 1536
    norms = 2 * 576
    assert shape.layer_params == attention + mlp + norms
    assert shape.total_params == 49152 * 576 + 30 * (attention + mlp + norms) + 576


def test_tied_embeddings_are_read_once():
    untied = dataclasses.replace(LLAMA, tie_word_embeddings=True)
    assert LLAMA.total_params - untied.total_params == 128256 * 4096


# ---- HF configs --------------------------------------------------------------------------------------


def test_from_hf_config_dict_equals_preset():
    assert ModelShape.from_hf_config(LLAMA_3_8B_CONFIG, name="llama-3-8b") == LLAMA


def test_from_hf_config_qwen_variants_equal_presets():
    qwen3 = {
        "model_type": "qwen3",
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "attention_bias": False,
    }
    assert ModelShape.from_hf_config(qwen3, name="qwen3-4b") == MODEL_PRESETS["qwen3-4b"]
    qwen2 = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    }
    assert ModelShape.from_hf_config(qwen2, name="qwen2.5-coder-0.5b") == MODEL_PRESETS["qwen2.5-coder-0.5b"]


def test_from_hf_config_defaults_and_files(tmp_path):
    dropped = ("num_key_value_heads", "tie_word_embeddings")
    cfg = {k: v for k, v in LLAMA_3_8B_CONFIG.items() if k not in dropped}
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    from_folder = ModelShape.from_hf_config(folder)
    assert from_folder == ModelShape.from_hf_config(folder / "config.json")
    assert from_folder.name == "my-model"
    assert from_folder.num_kv_heads == 32
    assert from_folder.head_dim == 128
    assert from_folder.tie_word_embeddings is False


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(SpecDecodeError):
        ModelShape.from_hf_config(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecDecodeError):
        ModelShape.from_hf_config(tmp_path)
    with pytest.raises(SpecDecodeError, match="hidden_size"):
        ModelShape.from_hf_config({"model_type": "llama"})


# ---- hardware and dtypes -----------------------------------------------------------------------------


def test_unknown_hardware_lists_the_valid_names():
    with pytest.raises(SpecDecodeError) as err:
        get_hardware("tpu-v9", "bf16")
    for name in (*HARDWARE_PRESETS, "cpu"):
        assert name in str(err.value)


def test_unknown_or_unsupported_dtype():
    with pytest.raises(SpecDecodeError, match="dtype"):
        pass_cost(LLAMA, H100, "int3", 1)
    with pytest.raises(SpecDecodeError, match="fp8"):
        get_hardware("a100", "fp8")  # Ampere has no fp8 tensor cores
    with pytest.raises(SpecDecodeError):
        pass_cost(LLAMA, HARDWARE_PRESETS["a100"], "fp8", 1)
    assert set(DTYPE_BYTES) == {"fp32", "bf16", "fp16", "fp8", "int8"}


def test_presets_are_returned_by_name():
    assert get_hardware("H100-SXM", "bf16") is H100
    assert get_hardware("b200", "fp8").peak_flops["fp8"] == 4500e12


def test_cpu_probe_returns_positive_finite_numbers():
    hw = probe_cpu_hardware("fp32", "int8")
    assert isinstance(hw, Hardware)
    assert math.isfinite(hw.bandwidth_bytes_per_s) and hw.bandwidth_bytes_per_s > 0
    assert set(hw.peak_flops) == {"fp32", "int8"}
    assert all(math.isfinite(peak) and peak > 0 for peak in hw.peak_flops.values())
    cost = pass_cost(MODEL_PRESETS["smollm2-135m"], get_hardware("cpu", "fp32"), "fp32", 1)
    assert cost.pass_ms > 0


# ---- speculative decoding ----------------------------------------------------------------------------


def test_expected_accepted_length_edges():
    assert expected_accepted_length(0.0, 5) == 1.0
    assert expected_accepted_length(1.0, 5) == 6.0
    assert expected_accepted_length(0.5, 0) == 1.0
    assert expected_accepted_length(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    with pytest.raises(SpecDecodeError):
        expected_accepted_length(1.5, 3)


def test_expected_speedup_is_accepted_length_when_drafting_is_free_and_memory_bound():
    assert expected_speedup(LLAMA, H100, "bf16", 4, 3.0) == pytest.approx(3.0)
    assert expected_speedup(LLAMA, H100, "bf16", 0, 1.0) == pytest.approx(1.0)
    t1 = pass_cost(LLAMA, H100, "bf16", 1).pass_ms
    assert expected_speedup(LLAMA, H100, "bf16", 4, 3.0, draft_cost_ms=t1) == pytest.approx(1.5)


def test_best_draft_length_with_cheap_drafts_speculates():
    k, speedup = best_draft_length(LLAMA, H100, "bf16", 0.8, draft_cost_ms_per_token=0.05)
    assert k > 0
    assert speedup > 2.0


def test_best_draft_length_with_expensive_drafts_does_not():
    k, speedup = best_draft_length(LLAMA, H100, "bf16", 0.8, draft_cost_ms_per_token=10.0)
    assert (k, speedup) == (0, 1.0)


# ---- reports -----------------------------------------------------------------------------------------


def test_cost_report_is_json_and_has_the_chapter_numbers():
    report = cost_report(LLAMA, H100, "bf16", [1, 5, 4096], acceptance_rate=0.8, draft_cost_ms_per_token=0.05)
    json.dumps(report)
    assert round(report["gate_matrix_mb"]) == 117
    assert report["weights_gb"] == pytest.approx(16.06, abs=0.01)
    one, five, many = report["rows"]
    assert one["ratio_to_one_position"] == 1.0
    assert five["ratio_to_one_position"] == 1.0
    assert many["bound"] == "compute"
    assert five["draft_length"] == 4
    assert five["expected_accepted_length"] == pytest.approx(expected_accepted_length(0.8, 4))
    assert report["best_draft_length"] > 0
    assert report["best_speedup"] >= five["speedup"]


def test_format_cost_table_is_markdown():
    plain = format_cost_table(cost_report(LLAMA, H100, "bf16", [1, 5]))
    table = [line for line in plain.splitlines() if line.startswith("|")]
    assert len(table) == 4  # header, separator, two rows
    assert "speedup" not in plain
    spec = format_cost_table(cost_report(LLAMA, H100, "bf16", [1, 5], acceptance_rate=0.7))
    assert "speedup" in spec and "best draft length" in spec
