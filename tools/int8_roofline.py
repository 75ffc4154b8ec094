"""How close the 8-bit-input kernel (`few-rows-q8`) comes to this CPU's int8 multiply throughput, by row count.

Without AVX512-VNNI, 32 products of 8-bit numbers are one `vpmaddubsw`; with it, one `vpdpbusd` in its ymm form,
accumulating too (the kernel uses the zmm form there since stop 62, 64 products an instruction; the shares below
are of the ymm probe's rate). A pass over k rows does k times the products of one, so once the weights
stream at the memory's speed (one row) each further row costs its products at the multiply ports' rate. This
measures that rate with eight independent chains of the instruction the kernel uses (`vpmaddubsw` and the add
that accumulates it, or `vpdpbusd`), the least a kernel does per 32 products (built here with the machine's
compiler for this CPU, run on one core
and on every core at once; before stop 60 the chains were an array that GCC kept on the stack, and the probe
measured store-to-load forwarding: 64 GMAC/s a core on a Zen 3 that multiplies at ~147), then the target's
decoder linears and its LM head under the kernel at 1-16 rows with 1 and all threads, as GMAC/s and as a share
of the measured peak.

    python tools/int8_roofline.py --name int8_roofline
"""

import argparse
import functools
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdecode.evaluation.results import write_results
from specdecode.machine import measure_quietly
from specdecode.models.linear import EIGHT_BIT_INPUTS, cpu_kernels_available, cpu_model_and_flags
from specdecode.models.target import Target

PROBE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
// eight independent chains in named registers (an array of vectors may live on the stack at -O2, and then the
// loop measures store-to-load forwarding, not the multiplier)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define STEP(acc, a, b) acc = _mm256_dpbusd_epi32(acc, a, b); __asm__("" : "+x"(acc));
#else
#define STEP(acc, a, b) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(a, b)); __asm__("" : "+x"(acc));
#endif
int main(int argc, char**) {
  __m256i c0 = _mm256_set1_epi16(0), c1 = _mm256_set1_epi16(1), c2 = _mm256_set1_epi16(2), c3 = _mm256_set1_epi16(3);
  __m256i c4 = _mm256_set1_epi16(4), c5 = _mm256_set1_epi16(5), c6 = _mm256_set1_epi16(6), c7 = _mm256_set1_epi16(7);
  const __m256i a0 = _mm256_set1_epi8(argc), a1 = _mm256_set1_epi8(argc + 1), a2 = _mm256_set1_epi8(argc + 2);
  const __m256i a3 = _mm256_set1_epi8(argc + 3), one = _mm256_set1_epi8(1);
  __m256i b0 = _mm256_set1_epi8(argc), b1 = _mm256_set1_epi8(argc + 7);
  const long passes = 200000000;
  auto start = std::chrono::steady_clock::now();
  for (long n = 0; n < passes; ++n) {
    STEP(c0, a0, b0) STEP(c1, a1, b0) STEP(c2, a2, b0) STEP(c3, a3, b0)
    STEP(c4, a0, b1) STEP(c5, a1, b1) STEP(c6, a2, b1) STEP(c7, a3, b1)
    b0 = _mm256_add_epi8(b0, one);
    b1 = _mm256_add_epi8(b1, one);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  __m256i all = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(c0, c1), _mm256_add_epi16(c2, c3)),
                                 _mm256_add_epi16(_mm256_add_epi16(c4, c5), _mm256_add_epi16(c6, c7)));
  printf("%.6f %d\n", 32.0 * 8 * passes / s / 1e9, _mm256_extract_epi16(all, 0));
}
"""


def build_probe(folder: Path) -> Path:
    """The probe, compiled with the machine's compiler into `folder`."""
    source, binary = folder / "probe.cpp", folder / "probe"
    source.write_text(PROBE)
    subprocess.run(["c++", "-O2", "-march=native", "-o", str(binary), str(source)], check=True)
    return binary


def probe_peak(binary: Path, cores: int) -> list[float]:
    """GMAC/s of each of `cores` probes running at once."""
    running = [subprocess.Popen([str(binary)], stdout=subprocess.PIPE, text=True) for _ in range(cores)]
    return [float(p.communicate()[0].split()[0]) for p in running]


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
    with tempfile.TemporaryDirectory() as folder:
        binary = build_probe(Path(folder))
        alone = statistics.median(probe_peak(binary, 1)[0] for _ in range(3))
        together = probe_peak(binary, cores)
    peak = {1: alone, cores: sum(together)}
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
    peaks = f"{instruction} peak: {alone:.1f} GMAC/s on one core, {peak[cores]:.1f} on {cores} cores at once"
    foreign = max(r["foreign_load_cores"] for r in runs)
    notes = f"Cores used by other processes during a measurement: at most {foreign:.2f}."
    table = f"{peaks}.\n\n" + "\n".join(lines) + f"\n\n{notes}\n"
    print(table)
    write_results(args.name, args.out, target.name, runs, table, peak_gmacs=peak, probe_each_core=together)


if __name__ == "__main__":
    main()
