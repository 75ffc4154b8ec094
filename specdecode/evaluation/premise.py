"""`specdecode bench premise`: does a verify pass over k positions cost about what one position costs, and
how close is one pass to what the memory allows?

Variants, all timed in one run: `hf` (the Hugging Face forward in float32, stock kernels: what specdecode
ran before its own runner), the runner with each linear kernel forced (`runner-stock`, `runner-onednn`,
`runner-few-rows`, and `runner-few-rows-gguf`: float32 inputs over the GGUF's rows, the default of a float32
target until 8-bit inputs measured faster; each where the default's dtype can run it, not stock in its place)
and `runner-auto`, the library's default (the dtype and the kernel per row count chosen on this machine), all in
the default's dtype, and the runner in the other dtype (`runner-bf16` or `runner-fp32`: bfloat16 is the default
only where the CPU multiplies it natively and it measured faster).
For each context length and k, the
median time of one target pass with the KV cache, interleaved across variants so that drift on a shared
machine hits every variant alike. Each variant's block of a repetition starts with an untimed pass: in
decoding the same model runs pass after pass, so its weights are as warm in the cache as they are here.
Each variant's roofline is the cost model's sum of max(read, math) over the bytes that configuration reads (the
weights as its kernels stream them, GGUF rows a fifth to a quarter of float32, and the KV cache in its dtype, until
stop 45 left out) and the multiply-adds it does, at this machine's measured read bandwidth and the measured peak
of the multiply its kernels use (the 8-bit one where they round their inputs to 8 bits); the HF forward's is the
float weights'. Until stop 67 every variant had the default dtype's float roofline: ~3x the bytes the default
runner streams, and a peak it never uses.
The bandwidth is probed in every repetition, right before its passes (one 256 MiB read, a few ms), and each
context's roofline takes the median of its probes (until stop 47: one best-of-four probe after all the passes;
until stop 67 the median over every context's).
"""

import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode import costmodel
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.results import write_results
from specdecode.machine import MAX_FOREIGN_CORES, ForeignLoad
from specdecode.models.linear import EIGHT_BIT_INPUTS, ROW_BUCKETS, candidates, has_gguf_rows
from specdecode.models.target import Target, other_dtype

FORCED_KERNELS = ("stock", "onednn", "few-rows", "few-rows-gguf")


BATCH_ROWS = (1, 4, 16, 64)  # requests decoded together, one new token each


def time_pass(target: Target, context: int, k: int, generator: torch.Generator) -> float:
    """Milliseconds of one pass over k random tokens after the first `context` cached ones."""
    target.rollback(context)
    ids = torch.randint(100, target.vocab_size, (k,), generator=generator)
    start = time.perf_counter()
    target.forward(ids)
    return (time.perf_counter() - start) * 1000


def check_contexts(target: Target, contexts: list[int], room: int) -> None:
    """Refuse contexts that leave no `room` positions in the target's context window (one clear error before
    minutes of loading and prefilling)."""
    if max(contexts) + room > target.max_context:
        raise SpecDecodeError(
            f"context {max(contexts)} plus {room} positions passes {target.name}'s context of {target.max_context} "
            "tokens: choose smaller --contexts"
        )


def paired_ratio(times_ms: list[float], base_ms: list[float]) -> float:
    """The median over repetitions of t(k) / t(1) measured back to back in the same repetition: t(1) reads the
    weights and follows the machine's memory state, t(8) and up are bound by the products and barely do, so a
    ratio of medians taken over both states (stop 50: t(8)/t(1) 1.16 in one process, 1.42-1.50 in the next)
    would mix them."""
    return statistics.median(t / b for t, b in zip(times_ms, base_ms, strict=True))


def paired_roofline_ratio(times_ms: list[float], read_bytes_per_s: list[float], bytes_read: float) -> float:
    """The median over repetitions of a pass's time against the time to read `bytes_read` at the bandwidth probed
    in the same repetition: a machine that changes memory state between repetitions moves both alike."""
    return statistics.median(ms * b / (bytes_read * 1e3) for ms, b in zip(times_ms, read_bytes_per_s, strict=True))


def roofline_dtype(target: Target, k: int) -> str:
    """The multiply a pass over k positions runs: 8-bit where the runner's linears round their inputs to 8 bits."""
    runner = target.runner
    if runner is not None and runner.layers[0].qkv.kernel_for(k) == EIGHT_BIT_INPUTS:
        return "int8"
    return costmodel.dtype_name(target.dtype)


def configuration_cost(
    target: Target, shape: costmodel.ModelShape, hardware: costmodel.Hardware, k: int, context: int
) -> costmodel.PassCost:
    """The roofline of one pass over k positions after `context` cached ones as `target` runs it: the bytes its
    kernels stream (`weight_bytes_read`) and its cache holds, the multiply-adds of its linears and attention, at the
    peak of `roofline_dtype`; the decoder layers and the LM head apart (their bytes per multiply-add differ). The HF
    forward (no runner): the cost model's float weights."""
    runner = target.runner
    if runner is None:
        dtype = costmodel.dtype_name(target.dtype)
        return costmodel.pass_cost(shape, hardware, dtype, k, context, include_kv_read=True)
    head = runner.lm_head
    layers = [lin for lin in runner.linears() if lin is not head]
    cache = shape.num_layers * costmodel.kv_read_bytes(shape, context, runner.cache_dtype.itemsize)
    attention = shape.num_layers * 4 * context * shape.q_dim * k
    entries = [
        (runner.weight_bytes_read(k) - head.bytes_read(k) + cache, 2 * k * sum(lin.weight.numel() for lin in layers)
         + attention),
        (head.bytes_read(k), 2 * k * head.weight.numel()),
    ]  # fmt: skip
    return costmodel.entries_cost(entries, hardware, roofline_dtype(target, k), k)


def load_variants(default: Target, target_name: str) -> dict[str, Target]:
    """The runner as loaded by default, beside the HF path, each forced kernel and the other dtype."""
    other = other_dtype(default.dtype)
    variants = {"hf": Target.load(target_name, dtype=torch.float32, runner=False)}
    quantized = default.runner is not None and has_gguf_rows(default.runner.linears())
    for kernel in FORCED_KERNELS:
        if kernel in candidates(default.dtype, ROW_BUCKETS[-1], quantized=quantized):  # else it would run stock
            variants[f"runner-{kernel}"] = Target.load(target_name, dtype=default.dtype, kernel=kernel)
    variants["runner-auto"] = default
    variants[f"runner-{costmodel.dtype_name(other)}"] = Target.load(target_name, dtype=other)
    return variants


def run_premise(target_name: str, positions: list[int], contexts: list[int], reps: int, out_dir: str) -> dict:
    default = Target.load(target_name)
    check_contexts(default, contexts, max(positions))
    targets = load_variants(default, target_name)
    generator = torch.Generator().manual_seed(0)
    times: dict[tuple[str, int, int], list[float]] = {}
    probe = costmodel.read_probe_buffer()
    read_bytes_per_s: dict[int, list[float]] = {c: [] for c in contexts}  # one probe per repetition, beside its passes
    foreign: list[float] = []
    bar = tqdm(total=len(contexts) * reps, desc="premise", unit="rep")
    for context in contexts:
        prefix = torch.randint(100, default.vocab_size, (context,), generator=generator)
        for target in targets.values():
            target.reset()
            target.forward(prefix, logits=False)
            for k in positions:  # warm-up
                time_pass(target, context, k, generator)
        done = 0
        while done < reps:
            sample = {}
            with ForeignLoad() as load:
                bandwidth = costmodel.read_bandwidth(probe)
                for variant, target in targets.items():
                    time_pass(target, context, 1, generator)  # untimed: bring this model's weights back in cache
                    for k in positions:
                        sample[(variant, context, k)] = time_pass(target, context, k, generator)
            if load.cores > MAX_FOREIGN_CORES:  # contaminated by another process: measure this rep again
                time.sleep(0.5)
                continue
            foreign.append(load.cores)
            read_bytes_per_s[context].append(bandwidth)
            for key, ms in sample.items():
                times.setdefault(key, []).append(ms)
            done += 1
            bar.update()
    bar.close()

    shape = costmodel.ModelShape.from_hf_config(default.source)
    # each context's roofline at the bandwidth read beside its passes: the machine moves between memory states (a
    # plain read at 29-37 or at 60-65 GB/s on a Zen 4 EPYC, for minutes at a time), and one probe after the passes
    # (stop 46), or the median over every context's (until stop 67), could meet another state than they did
    peaks = sorted({roofline_dtype(target, k) for target in targets.values() for k in positions})
    hardware = {
        c: costmodel.probe_cpu_hardware(*peaks, bandwidth_bytes_per_s=statistics.median(read_bytes_per_s[c]))
        for c in contexts
    }
    runs = []
    for context in contexts:
        best_one = min(statistics.median(times[(variant, context, 1)]) for variant in targets)
        for variant, target in targets.items():
            ones = times[(variant, context, 1)]
            roofline_one = configuration_cost(target, shape, hardware[context], 1, context).pass_ms
            for k in positions:
                ms = statistics.median(times[(variant, context, k)])
                roofline = configuration_cost(target, shape, hardware[context], k, context).pass_ms
                runs.append(
                    {
                        "variant": variant,
                        "context": context,
                        "positions": k,
                        "ms_median": round(ms, 3),
                        "ratio_to_k1": round(paired_ratio(times[(variant, context, k)], ones), 3),
                        "ratio_to_best_k1": round(ms / best_one, 3),
                        "roofline_ms": round(roofline, 3),
                        "ratio_to_roofline": round(ms / roofline, 3),
                        "predicted_ratio": round(roofline / roofline_one, 3),
                    }
                )
    variants = list(targets)
    chosen = {"dtype": str(default.dtype), "kernel_per_rows": default.runner.kernel_plan["choice"]}
    weights_read = default.runner.weight_bytes_read(1)
    itemsize = default.runner.cache_dtype.itemsize
    cache_read = {c: shape.num_layers * costmodel.kv_read_bytes(shape, c, itemsize) for c in contexts}
    read_roofline_ms = {c: (weights_read + cache_read[c]) / hardware[c].bandwidth_bytes_per_s * 1e3 for c in contexts}
    paired = {  # rounded once: the summary shows what the JSON records (rounding 110.3152 to 110.315, then to
        # two places, gives 110.31 where the raw value gives 110.32)
        c: round(
            paired_roofline_ratio(times[("runner-auto", c, 1)], read_bytes_per_s[c], weights_read + cache_read[c]), 3
        )
        for c in contexts
    }
    batched = batched_decoding(default, contexts, reps, generator)
    summary = _summary(runs, contexts, positions, paired, read_bytes_per_s)
    summary += "\n\n" + _batched_table(batched)
    table = _table(runs, variants, positions, contexts)
    plot = _plot(runs, variants, positions, contexts, out_dir)
    write_results(
        "premise",
        out_dir,
        target_name,
        runs,
        summary + "\n\n" + table + f"\n\n![ms per pass against k]({plot.name})\n",
        reps=reps,
        foreign_load_cores_median=round(statistics.median(foreign), 3),
        cpu_probe={
            "read_gb_per_s": round(statistics.median(b for v in read_bytes_per_s.values() for b in v) / 1e9, 2),
            "read_gb_per_s_per_repetition": {c: [round(b / 1e9, 1) for b in v] for c, v in read_bytes_per_s.items()},
            **{
                f"{dtype}_matmul_gflop_per_s": round(peak / 1e9, 1)
                for dtype, peak in hardware[contexts[0]].peak_flops.items()
            },
        },
        chosen_configuration=chosen,
        weights_read_mb_one_position=round(weights_read / 1e6, 1),
        kv_cache_read_mb_one_position={c: round(b / 1e6, 1) for c, b in cache_read.items()},
        read_roofline_ms_one_position={c: round(ms, 3) for c, ms in read_roofline_ms.items()},
        t1_over_read_roofline_paired=paired,
        kernel_timings_ms=default.runner.kernel_plan["timings"],
        batched_decoding=batched,
    )
    print(summary + "\n\n" + table)
    return {"runs": runs}


def batched_decoding(target: Target, contexts: list[int], reps: int, generator: torch.Generator) -> list[dict]:
    """A decode step of R requests at once (one new token each, every request `context` tokens into its own
    KV slot), the default runner, R interleaved: the ms of a step and the tokens/s against one request's."""
    from specdecode.engine.batch import BatchedTarget

    target.set_capture_layers([])
    out = []
    for context in contexts:
        batches = {}
        for rows in BATCH_ROWS:
            batched = BatchedTarget(target, rows, context + 8)
            slots = [batched.acquire() for _ in range(rows)]
            prompts = [torch.randint(target.vocab_size, (context,), generator=generator) for _ in slots]
            batched.forward(slots, prompts, logits=False)
            batches[rows] = (batched, slots)
        times: dict[int, list[float]] = {rows: [] for rows in BATCH_ROWS}
        for _ in range(reps + 1):  # the first round warms up
            for rows, (batched, slots) in batches.items():
                new = [torch.randint(target.vocab_size, (1,), generator=generator) for _ in slots]
                for slot in slots:
                    batched.rollback(slot, context)
                start = time.perf_counter()
                batched.forward(slots, new)
                times[rows].append((time.perf_counter() - start) * 1000)
        one = statistics.median(times[1][1:])
        for rows in BATCH_ROWS:
            ms = statistics.median(times[rows][1:])
            out.append(
                {
                    "context": context,
                    "rows": rows,
                    "ms_median": round(ms, 3),
                    "throughput_vs_1": round(rows * one / ms, 2),
                }
            )
        del batches
    return out


def _batched_table(batched: list[dict]) -> str:
    lines = [
        "Batched decoding: one step of R requests, one new token each (median ms; tokens/s against one request).\n",
        "| context | " + " | ".join(f"R={r}" for r in BATCH_ROWS) + " |",
        "|---:|" + "---:|" * len(BATCH_ROWS),
    ]
    for context in sorted({b["context"] for b in batched}):
        cells = [b for b in batched if b["context"] == context]
        lines.append(
            f"| {context} | " + " | ".join(f"{b['ms_median']:.1f} ({b['throughput_vs_1']:.1f}x)" for b in cells) + " |"
        )
    return "\n".join(lines)


def _summary(
    runs: list[dict],
    contexts: list[int],
    positions: list[int],
    paired: dict[int, float],
    read_bytes_per_s: dict[int, list[float]],
) -> str:
    """Per context: the default's t(1) against its roofline (what its kernels stream and its cache holds, at the
    context's median probe) and the HF forward, and its t(8)/t(1), t(16)/t(1) beside the roofline's own: where k
    positions' multiply-adds outlast one pass's bytes, no kernel gets below it. `paired` sets each repetition's
    t(1) against the bytes at the bandwidth probed in that repetition (median of those ratios), so a change of the
    machine's memory state between repetitions cancels; the probe's median and range per context say which state
    (or states) the passes met."""
    lines = ["| context | runner t(1) ms | roofline ms | t(1) / roofline | t(1) / roofline, paired | "
             "hf t(1) / runner t(1) | t(8)/t(1) | t(16)/t(1) | roofline t(8)/t(1) | roofline t(16)/t(1) | "
             "read GB/s (range) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for context in contexts:
        cell = {(r["variant"], r["positions"]): r for r in runs if r["context"] == context}
        one = cell[("runner-auto", 1)]
        ratios = [  # measured, then the roofline's
            f"{cell[('runner-auto', k)][key]:.2f}" if k in positions else "-"
            for key in ("ratio_to_k1", "predicted_ratio")
            for k in (8, 16)
        ]
        probed = [b / 1e9 for b in read_bytes_per_s[context]]
        lines.append(
            f"| {context} | {one['ms_median']:.1f} | {one['roofline_ms']:.1f} | {one['ratio_to_roofline']:.2f} | "
            f"{paired[context]:.2f} | "
            f"{cell[('hf', 1)]['ms_median'] / one['ms_median']:.2f} | " + " | ".join(ratios) + " | "
            f"{statistics.median(probed):.0f} ({min(probed):.0f}-{max(probed):.0f}) |"
        )
    return "\n".join(lines)


def _table(runs: list[dict], variants: list[str], positions: list[int], contexts: list[int]) -> str:
    lines = [
        "Median ms of one target pass over k new positions (in parentheses: t(k) / t(1) of the same variant; "
        "`runner-auto` is the library's default on CPU).\n",
        "| variant | context | " + " | ".join(f"k={k}" for k in positions) + " |",
        "|---|---:|" + "---:|" * len(positions),
    ]
    for context in contexts:
        for variant in variants:
            cells = [r for r in runs if r["variant"] == variant and r["context"] == context]
            lines.append(
                f"| {variant} | {context} | "
                + " | ".join(f"{r['ms_median']:.1f} ({r['ratio_to_k1']:.2f})" for r in cells)
                + " |"
            )
    return "\n".join(lines)


def _plot(runs: list[dict], variants: list[str], positions: list[int], contexts: list[int], out_dir: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 4.2), sharey=True)
    for ax, context in zip(list(axes) if len(contexts) > 1 else [axes], contexts, strict=True):
        for variant in variants:
            cells = [r for r in runs if r["variant"] == variant and r["context"] == context]
            ax.plot(positions, [r["ms_median"] for r in cells], marker="o", label=variant)
        roofline = [r["roofline_ms"] for r in runs if r["variant"] == "runner-auto" and r["context"] == context]
        ax.plot(positions, roofline, "k--", label="runner-auto's roofline (its bytes; measured bandwidth, peak)")
        ax.set_title(f"context {context}")
        ax.set_xlabel("positions k in one pass")
        ax.set_yscale("log")  # the HF path is ~15x the default: on a linear axis the default and its roofline merge
        ax.grid(alpha=0.3, which="both")
    (axes[0] if len(contexts) > 1 else axes).set_ylabel("ms per pass (log)")
    handles, labels = (axes[0] if len(contexts) > 1 else axes).get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize="small")
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / "premise.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
