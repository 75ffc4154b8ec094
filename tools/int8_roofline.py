"""How close the 8-bit-input kernel (`few-rows-q8`) comes to this CPU's int8 multiply throughput, by row count.

Without AVX512-VNNI, 32 products of 8-bit numbers are one `vpmaddubsw`; with it, 64 are one `vpdpbusd` in a zmm
register (the kernel's form since stop 62). A pass over k rows does k times the products of one, so once the
weights stream at the memory's speed (one row) each further row costs its products at the multiply ports' rate.
The peak is that rate as the library measures it for the premise's roofline (`q8_multiply_peak`, csrc/q8_rows.cpp:
eight independent chains of the instruction the kernel uses, the least a kernel does per product, on one thread and
on every thread at once; until stop 70 this tool compiled a probe of its own, in the ymm form with VNNI, and before
stop 60 that probe's chains sat on the stack and it measured store-to-load forwarding), then the target's decoder
linears and its LM head under the kernel at 1-16 rows with 1 and all threads, as GMAC/s and as a share of the peak.

    python tools/int8_roofline.py --name int8_roofline
"""

import argparse
import functools
import os
import statistics
import time

import torch

from specdecode.evaluation.results import write_results
from specdecode.machine import measure_quietly
from specdecode.models.linear import EIGHT_BIT_INPUTS, cpu_kernels_available, cpu_model_and_flags
from specdecode.models.target import Target


def multiply_peak(threads: int, reps: int = 3) -> float:
    """GMAC/s of the kernel's multiply on `threads` threads at once (`q8_multiply_peak`), the median of `reps`."""
    torch.set_num_threads(threads)
    return statistics.median(torch.ops.specdecode.q8_multiply_peak(0.2) for _ in range(reps)) / 1e9


def kernel_gmacs(linears: list, rows: int, threads: int, reps: int) -> tuple[float, float]:
    """(ms, GMAC/s) of one pass of `rows` rows through `linears` under the 8-bit-input kernel, best of `reps`."""
    torch.set_num_threads(threads)
    inputs = {lin.weight.shape[1]: torch.randn(rows, lin.weight.shape[1]) for lin in linears}
    best = float("inf")
    for _ in range(reps + 1):
        start = time.perf_counter()
        for lin in linears:
            lin.run(inputs[lin.weight.shape[1]], EIGHT_BIT_INPUTS)
        best = min(best, time.perf_counter() - start)
    macs = rows * sum(lin.weight.numel() for lin in linears)
    return best * 1e3, macs / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="int8_roofline")
    args = parser.parse_args()
    if not cpu_kernels_available() or not torch.ops.specdecode.q8_rows_available():
        raise SystemExit("the 8-bit-input kernel needs AVX2 (and F16C, FMA): not on this CPU")
    cores = os.cpu_count() or 1
    peak = {1: multiply_peak(1), cores: multiply_peak(cores)}
    target = Target.load()
    head = target.runner.lm_head
    parts = {"decoder linears": [lin for lin in target.runner.linears() if lin is not head], "LM head": [head]}
    runs, lines = [], ["| part | threads | rows | ms | GMAC/s | share of peak |", "|---|---:|---:|---:|---:|---:|"]
    for part, linears in parts.items():
        for threads in sorted(peak):
            for rows in (int(r) for r in args.rows.split(",")):
                timed = functools.partial(kernel_gmacs, linears, rows, threads, args.reps)
                (ms, gmacs), foreign = measure_quietly(timed)
                share = gmacs / peak[threads]
                run = {"part": part, "threads": threads, "rows": rows, "ms": ms, "gmacs": gmacs, "share": share}
                runs.append({**run, "foreign_load_cores": foreign})
                lines.append(f"| {part} | {threads} | {rows} | {ms:.2f} | {gmacs:.1f} | {share:.2f} |")
    instruction = "vpdpbusd" if {"avx512_vnni", "avx512vl"} <= cpu_model_and_flags()[1] else "vpmaddubsw"
    peaks = f"{instruction} peak: {peak[1]:.1f} GMAC/s on one core, {peak[cores]:.1f} on {cores} cores at once"
    foreign = max(r["foreign_load_cores"] for r in runs)
    notes = f"Cores used by other processes during a measurement: at most {foreign:.2f}."
    table = f"{peaks}.\n\n" + "\n".join(lines) + f"\n\n{notes}\n"
    print(table)
    write_results(args.name, args.out, target.name, runs, table, peak_gmacs=peak)


if __name__ == "__main__":
    main()
