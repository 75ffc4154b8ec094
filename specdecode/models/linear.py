"""The linear layers of the runner, with the kernel for each number of rows chosen by measuring this machine.

A decode step and a verify pass multiply a few rows by every weight matrix: the pass is a stream over the
weights, and its speed is the kernel's bandwidth at that row count. Which kernel streams fastest differs
between CPUs (MKL's one-row path ran at 9-11 GB/s on an AMD EPYC, a fifth of its plain read bandwidth;
oneDNN with a prepacked weight is slower at one row and faster at eight on some machines), so nothing is
assumed: `plan_kernels` times every candidate on the model's own weights at each row bucket and keeps the
fastest, and the plan is cached per machine.

Candidates:
- `stock`: `F.linear` (MKL on x86 CPUs).
- `onednn`: `torch.ops.mkldnn` with the weight prepacked once (float32 and bfloat16 on x86).
- `few-rows`: specdecode's C++ kernel (`csrc/runner_kernels.cpp`, built on first use with the machine's compiler),
  float32 rows against float32 or bfloat16 weights; its outputs do not depend on how many rows share a pass.
  `few-rows-gguf` reads a float32 target's GGUF rows instead (the same bits); `few-rows-q8` multiplies those
  rows by the inputs rounded to 8 bits, as llama.cpp does (`csrc/q8_rows.cpp`): other bits, so an exact plan
  takes it for all of its exact buckets or for none, as their summed times decide.
  Where the CPU multiplies bfloat16 natively, bfloat16 weights are read as panels (`pack_panels`): a verify
  pass of 8 rows then costs about what one row costs (the weights stream once, every load serves all rows).

Exact rows: the target runner plans with `exact=True`, so every bucket up to `FEW_ROWS_MAX` (a decode step,
a verify pass) runs the few-rows kernel wherever it builds. A verify pass over k positions then computes,
bit for bit, what k one-token steps compute, and speculative decoding at temperature 0 is token-identical
to normal decoding in any dtype. Mixing kernels across those buckets broke that in bfloat16: oneDNN rounds
the rows to bfloat16 at one row count, the widening kernel kept them float32 at another, and near-ties
flipped (n-gram matched bfloat16 normal decoding on 6 of 12 prompts).
"""

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.machine import MAX_FOREIGN_CORES, ForeignLoad
from specdecode.models.gguf_rows import dequantize, interleave, quantize_q4_1, quantize_q8_0
from specdecode.models.huge_pages import on_huge_pages
from specdecode.paths import cache_dir, write_text_atomically

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # a pass with M rows uses the plan of the smallest bucket >= M
FEW_ROWS_MAX = 16
KERNELS = ("auto", "stock", "onednn", "few-rows", "few-rows-gguf", "few-rows-q8")
EIGHT_BIT_INPUTS = "few-rows-q8"  # computes other bits than the float32 kernels (see `candidates`)
# plans timed by this process, cached or not: one timed beside another job is not written, and a second load of
# the same model in the process (the CLI's `main` run again, a test) would time it again and print its note again
_PLANNED_HERE: dict[str, dict] = {}
CHECKOUT_FILE = "checkout"  # in a kernels' build folder: the csrc folder it was built from
BUILD_LOCK = "specdecode.lock"  # in a kernels' build folder: the flock of whoever builds, loads or prunes it
OUT_OF_THE_RACE = 1.5  # this many times the fastest in the warm-up and the first timed sweep: timed no more


@functools.cache
def kernels_digest() -> str:
    """Names one build of the C++ kernels: their sources and headers, this machine and torch (rebuilt, and
    replanned, on change)."""
    sources = sorted((Path(__file__).with_name("csrc")).glob("*.[ch]*"))
    return stable_digest([s.read_text() for s in sources] + [machine_key(), torch.__version__])


def q8_group_rows() -> int:
    """Weight rows in one interleaved group of the 8-bit-input kernel: 16 where it was built for AVX512-VNNI, else
    8. A matrix whose rows do not fill whole groups keeps float32 inputs, so a drafter's is not rounded to GGUF rows
    for nothing."""
    return torch.ops.specdecode.q8_group_rows() if cpu_kernels_available() else 8


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (once per machine, cached on disk) and load the runner's C++ kernels; False where that fails."""
    if hasattr(torch.ops.specdecode, "cached_attention"):
        return True
    from torch.utils.cpp_extension import load

    csrc = Path(__file__).with_name("csrc")
    sources = sorted(csrc.glob("*.cpp"))
    # a build per checkout and environment too: ninja rebuilds when the sources' or torch's paths change, and a
    # clean clone's CI run then cost the working tree a rebuild (~1 minute on 2 cores), and back
    build = cache_dir() / "kernels" / f"{kernels_digest()}-{stable_digest([str(csrc), sys.prefix])[:8]}"
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        print("specdecode: building the runner's C++ kernels for this machine (once, about a minute)", file=sys.stderr)
        (build / CHECKOUT_FILE).write_text(str(csrc))
        prune_builds(build.parent)
    try:
        with build_lock(build):
            load(
                "specdecode_runner_kernels",
                [str(s) for s in sources],
                extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                is_python_module=False,
            )
    except Exception as e:  # no compiler, no ninja, an unusual platform: the stock kernels remain
        print(
            f"specdecode: the runner's C++ kernels did not build ({type(e).__name__}); using stock kernels",
            file=sys.stderr,
        )
        return False
    return True


def prune_builds(kernels: Path) -> None:
    """Remove the kernel builds whose checkout is gone (a clean clone's CI run, a removed worktree: ~4 MB each, one
    more per clone), except one that another process holds."""
    for build in kernels.iterdir():
        checkout = build / CHECKOUT_FILE
        if not checkout.is_file() or Path(checkout.read_text()).exists():
            continue
        with open(build / BUILD_LOCK, "w") as handle:
            if _took_flock(handle):
                shutil.rmtree(build, ignore_errors=True)


@contextlib.contextmanager
def build_lock(build: Path) -> Iterator[None]:
    """Held while this process builds or loads the kernels in `build`. torch's own lock there is a file that a
    build killed midway (Ctrl-C on a first run) leaves behind, and every later process then waited for it
    forever, silently; this one is an flock, which the kernel releases when its holder dies, so a torch lock
    found while holding it is stale and goes."""
    with open(build / BUILD_LOCK, "w") as handle:
        if not _took_flock(handle):
            print("specdecode: waiting for another process building the runner's C++ kernels", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        yield


def _took_flock(handle) -> bool:
    """Whether this process now holds the exclusive flock of the open file `handle` (False: another holds it)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@functools.cache
def cpu_model_and_flags() -> tuple[str, set[str]]:
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return model, flags


@functools.cache
def machine_key() -> str:
    """CPU model and instruction-set flags: kernels built or measured on one machine are not reused on another."""
    model, flags = cpu_model_and_flags()
    return f"{platform.machine()}-{stable_digest([model, sorted(flags), os.cpu_count()])}"


def native_bfloat16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_model_and_flags()[1])


def plans_eight_bit_inputs(linears: "Iterable[Linear]") -> bool:
    """Whether the plan runs some of these linears on inputs rounded to 8 bits (where it found them faster)."""
    return any(EIGHT_BIT_INPUTS in lin.plan.values() for lin in linears)


def rounded_cache_dtype(linears: "Iterable[Linear]") -> torch.dtype | None:
    """bfloat16 for the keys and values of a network whose linears take 8-bit inputs (already a rounding of
    bfloat16's class) on a CPU that reads bfloat16 natively, where the C++ attention multiplies them in pairs over
    half the bytes; None elsewhere (the caller's own dtype). The target runner's KV cache and a block drafter's
    context pool both follow it."""
    return torch.bfloat16 if plans_eight_bit_inputs(linears) and native_bfloat16() else None


BFLOAT16, FLOAT32, ROWS_8_BIT = "bfloat16", "float32", "float32 with Q4_1 rows"  # the weight formats timed


@functools.cache
def weight_format_ms(rows: tuple[int, ...] = (1, 8)) -> dict[str, float]:
    """On a CPU with native bfloat16: ms of a stack of decoder-sized linears at one row plus at a verify pass's
    rows, in float32, in bfloat16, and in float32 with Q4_1 rows (the 8-bit-input kernel a candidate, as for a
    target that ships as a Q4_1 GGUF), each with the kernels the target runner would use. Measured once per
    machine, the formats taking turns sweep by sweep after a warm-up (packing) sweep; a measurement while other
    processes held a core decides for this process only and is not cached (one taken beside a training job once
    chose float32: bfloat16 272 ms against 45 ms, at twice the time a token on an idle machine). {} where
    bfloat16 is not native (emulated, it never wins: nothing is timed)."""
    if not native_bfloat16():
        return {}
    path = cache_dir("kernel-plans") / f"weight-formats-{kernels_digest()}.json"
    cached = _read_plan(path)
    if cached and set(cached.get("ms", {})) == {FLOAT32, BFLOAT16, ROWS_8_BIT}:
        return cached["ms"]
    generator = torch.Generator().manual_seed(0)
    shapes = [(2048, 1024), (1024, 1024), (4096, 1024), (1024, 2048)] * 8  # ~200 MB in float32
    stacks = {}
    for name, dtype in ((FLOAT32, torch.float32), (BFLOAT16, torch.bfloat16), (ROWS_8_BIT, torch.float32)):
        linears = []
        for shape in shapes:
            weight, blocks = torch.randn(shape, generator=generator), None
            if name == ROWS_8_BIT:
                blocks = quantize_q4_1(weight)
                weight = dequantize(blocks, shape[1])
            linears.append(Linear(weight.to(dtype), None, blocks))
        for lin in linears:
            if "onednn" in candidates(dtype, max(rows), exact=True):
                lin.pack_onednn()
        stacks[name] = linears
    best: dict[str, float] = {}
    with ForeignLoad() as load:
        for sweep in range(4):  # the first is a warm-up
            for name, linears in stacks.items():
                quantized = has_gguf_rows(linears)
                dtype = linears[0].weight.dtype
                ms = sum(
                    min(_time_sweeps(linears, candidates(dtype, m, exact=True, quantized=quantized), m, 1).values())
                    for m in rows
                )
                if sweep:
                    best[name] = min(best.get(name, ms), ms)
    if load.cores <= MAX_FOREIGN_CORES:
        write_text_atomically(path, json.dumps({"ms": best}))
    return best


def bfloat16_is_faster() -> bool:
    """Whether bfloat16 weights stream faster than float32 ones here (native bfloat16 and measured)."""
    ms = weight_format_ms()
    return bool(ms) and ms[BFLOAT16] < ms[FLOAT32]


def rows_beat_bfloat16() -> bool:
    """Whether float32 weights over their Q4_1 rows (8-bit inputs where the kernel builds) stream faster than
    bfloat16 weights here; true where bfloat16 is not native. Zen 4, stop 61: 5.3 ms against 10.6 (float32 29.8)."""
    ms = weight_format_ms()
    return not ms or ms[ROWS_8_BIT] < ms[BFLOAT16]


def stable_digest(value) -> str:
    """A short digest of a JSON-able value that is the same in every process (unlike `hash`)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


class Linear:
    """y = x W^T (+ b) with one kernel per row bucket; `weight` (N, K) is kept as loaded, packed copies beside it."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, blocks: torch.Tensor | None = None
    ) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.blocks = blocks  # the same float32 weight as GGUF Q4_1 or Q8_0 rows (models/gguf_rows.py), if known
        self.plan: dict[int, str] = {}  # row bucket -> kernel; missing buckets use stock
        self._packed: torch.Tensor | None = None
        self._panels: torch.Tensor | None = None
        self._interleaved: torch.Tensor | None = None

    @property
    def kernel_weight(self) -> torch.Tensor:
        """What the few-rows kernel reads: bfloat16 panels where the CPU multiplies bfloat16 natively and the
        shape allows (packed once, on first use), else the weight as loaded."""
        if self._panels is None:
            self._panels = pack_panels(self.weight) if panels_fit(self.weight) else self.weight
        return self._panels

    def few_rows_weight(self, kernel: str) -> torch.Tensor:
        """What the few-rows kernel reads under `kernel`: with `few-rows-gguf`, the GGUF rows where this linear has
        them (the same bits as its float32 weight, a fifth to a quarter of the bytes); with `few-rows-q8`, those
        rows interleaved for 8-bit inputs (once, on first use; a matrix whose rows do not fill the kernel's groups
        keeps its GGUF rows and float32 inputs)."""
        if kernel == EIGHT_BIT_INPUTS and self.blocks is not None:
            if self._interleaved is None:
                interleaved = interleave(self.blocks, self.weight.shape[1], q8_group_rows())
                self._interleaved = self.blocks if interleaved is None else interleaved
            return self._interleaved
        return self.blocks if kernel == "few-rows-gguf" and self.blocks is not None else self.kernel_weight

    def kernel_for(self, rows: int) -> str:
        """The kernel planned for a pass of `rows` rows (stock where the plan has none)."""
        return self.plan.get(bucket(rows), "stock")

    def bytes_read(self, rows: int) -> int:
        """Bytes of weights a pass of `rows` rows streams through the kernel planned for them."""
        kernel = self.kernel_for(rows)
        weight = self.few_rows_weight(kernel) if kernel.startswith("few-rows") else self.weight
        return weight.nbytes + (0 if self.bias is None else self.bias.nbytes)

    def pack_onednn(self) -> None:
        if self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 8)

    def drop_onednn(self) -> None:
        self._packed = None

    def run(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel.startswith("few-rows"):
            y = torch.ops.specdecode.few_rows_linear(x, self.few_rows_weight(kernel))
            return y if self.bias is None else y + self.bias
        if kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:  # training through a frozen layer: autograd's kernel
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1])
        kernel = self.kernel_for(x.shape[0])
        y = self.run(x.to(input_dtype(kernel, self.weight.dtype)), kernel).to(dtype)
        return y.view(*shape[:-1], y.shape[-1])


def kernel_weights_on_huge_pages(linears: list[Linear]) -> None:
    """What the few-rows kernels planned for these `linears` read where it is a copy of their own (the 8-bit
    kernel's interleaved rows, bfloat16 panels), moved in their order into one mapping on 2 MB pages
    (`models/huge_pages.py`; where the kernel offers none, they stay where they are). The same bytes: only where
    they live changes. Float weights as loaded stay put (the HF modules share them)."""
    moved: list[tuple[Linear, str, torch.Tensor]] = []  # (linear, the attribute holding the copy, the copy)
    for lin in linears:
        planned = set(lin.plan.values())
        if EIGHT_BIT_INPUTS in planned and lin.blocks is not None:
            moved.append((lin, "_interleaved", lin.few_rows_weight(EIGHT_BIT_INPUTS)))
        if "few-rows" in planned and lin.kernel_weight is not lin.weight:
            moved.append((lin, "_panels", lin.kernel_weight))
    copies = on_huge_pages([weight for *_, weight in moved])
    if copies is not None:
        for (lin, name, _), copy in zip(moved, copies, strict=True):
            setattr(lin, name, copy)


PANEL_OUTPUTS = 64  # outputs per panel group of the bfloat16 kernel (csrc/runner_kernels.cpp)


def panels_fit(weight: torch.Tensor) -> bool:
    """Whether `weight` runs as bfloat16 panels: a bfloat16 CPU matrix of whole panel groups and pairs of
    inputs, on a CPU whose kernels were built with native bfloat16 products."""
    n, k = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and n % PANEL_OUTPUTS == 0
        and k % 2 == 0
        and cpu_kernels_available()
        and torch.ops.specdecode.bfloat16_panels()
    )


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N / 64, K / 2, 128): group g, input pair j holds outputs 64 g .. 64 g + 63 as four vectors of
    16 outputs x (k = 2 j, 2 j + 1), the operand layout of a pairwise bfloat16 product instruction. A group's
    weights are one contiguous stream, and no partial sum needs its lanes added at the end."""
    n, k = weight.shape
    groups = weight.view(n // PANEL_OUTPUTS, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4)
    return groups.reshape(n // PANEL_OUTPUTS, k // 2, 8 * 16).contiguous()


class FrozenLinear(nn.Module):
    """A planned `Linear` as a frozen module (a drafter's borrowed LM head): the measured kernels at inference."""

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        self.linear = linear
        self.weight = linear.weight  # a plain tensor attribute: never trained, never in a state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


ROUNDINGS = {"Q4_1": quantize_q4_1, "Q8_0": quantize_q8_0}  # float rows -> GGUF rows, for `freeze_linears`
DRAFTER_ROWS = "Q4_1"  # what a drafter's weights round to where the target runs on 8-bit inputs


def freeze_linears(
    module: nn.Module,
    label: str,
    kernel: str = "auto",
    dtype: torch.dtype | None = None,
    eight_bit_inputs: bool = False,
    rows: str = DRAFTER_ROWS,
) -> None:
    """Swap every `nn.Linear` of an inference-only module (a drafter loaded from disk) for a `FrozenLinear`
    over the same weight (cast to `dtype` when given: the target's, so a drafter streams bfloat16 where the
    machine chose it), with kernels planned for the group: a drafter runs every round at a few rows, where
    stock `F.linear` streams its weights at a fraction of the measured kernels' speed. With `eight_bit_inputs`
    (the target runs its linears on 8-bit inputs) float32 weights are rounded to GGUF `rows`, so that the
    8-bit-input kernel is a candidate of the plan too: Q4_1 (the default since stop 60: a drafting round ~0.86x of
    Q8_0's for ~2% fewer accepted drafts, results/drafter_q4_1_ab.md) or Q8_0 (a weight moved by at most 1/254 of
    its block's largest). Training code never calls this: a FrozenLinear passes no gradient to its
    weight."""
    found = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()]
    found = [(parent, name, child) for parent, name, child in found if type(child) is nn.Linear]
    if not found:
        return
    dtype = dtype or found[0][2].weight.dtype
    linears = []
    for _, _, child in found:
        weight, bias = child.weight.detach().to(dtype), None if child.bias is None else child.bias.detach().to(dtype)
        blocks = None
        fills = weight.shape[1] % 32 == 0 and weight.shape[0] % q8_group_rows() == 0  # else float32 inputs
        if eight_bit_inputs and dtype == torch.float32 and fills:
            blocks = ROUNDINGS[rows](weight)
            weight = dequantize(blocks, weight.shape[1])  # every kernel then multiplies the same weights
        linears.append(Linear(weight, bias, blocks))
    shapes = [list(lin.weight.shape) for lin in linears]
    if linears[0].weight.device.type == "cpu":
        signature = {"model": label, "shapes": shapes, "dtype": str(linears[0].weight.dtype)}
        if any(lin.blocks is not None for lin in linears):
            signature["rows"] = rows
        plan_kernels(linears, kernel, signature)
    for (parent, name, _), lin in zip(found, linears, strict=True):
        setattr(parent, name, FrozenLinear(lin))


def input_dtype(kernel: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The few-rows kernel takes float32 rows for either weight dtype; the others want the weights' dtype."""
    return torch.float32 if kernel.startswith("few-rows") else weight_dtype


def bucket(rows: int) -> int:
    return next((b for b in ROW_BUCKETS if b >= rows), ROW_BUCKETS[-1])


def candidates(dtype: torch.dtype, rows: int, exact: bool = False, quantized: bool = False) -> list[str]:
    """The kernels that may run `rows` rows; with `exact`, only the few-rows kernel up to `FEW_ROWS_MAX` rows,
    and at every row count where bfloat16 weights run as panels (then a prefill or a batch of requests computes
    each row as one request alone would: mixing kernels across buckets moved bfloat16 logits by up to 0.5).
    With `quantized` (float32 linears that also have their GGUF rows) the kernel over those rows too: it
    computes the same bits as over the float32 weights, so it stays a candidate of an exact plan; and where the
    CPU has AVX2, the kernel over 8-bit inputs (its own bits: `plan_kernels` never mixes it with the others
    among an exact plan's buckets)."""
    if dtype in (torch.float32, torch.bfloat16) and cpu_kernels_available():
        panels = dtype == torch.bfloat16 and torch.ops.specdecode.bfloat16_panels()
        few_rows = ["few-rows"]
        if quantized and dtype == torch.float32:
            few_rows += ["few-rows-gguf"] + ([EIGHT_BIT_INPUTS] if torch.ops.specdecode.q8_rows_available() else [])
        if exact and (rows <= FEW_ROWS_MAX or panels):
            return few_rows
        return ["stock", *_library_kernels(dtype), *few_rows]
    return ["stock", *_library_kernels(dtype)]


def _library_kernels(dtype: torch.dtype) -> list[str]:
    x86 = torch.backends.mkldnn.is_available() and platform.machine() in ("x86_64", "AMD64")
    return ["onednn"] if x86 and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()) else []


def _time_sweeps(linears: list[Linear], kernels: list[str], rows: int, reps: int) -> dict[str, float]:
    """Fastest ms of one pass of `rows` rows through every linear (the weights stream as in a real pass), per
    kernel. The kernels take turns sweep by sweep, so a burst of another process's load hits them alike; the
    fastest sweep, not the median, is kept: such load can only slow a sweep down. A kernel more than
    `OUT_OF_THE_RACE` times the fastest in both the warm-up and the first timed sweep sits out the others (its
    time is that sweep's): at 128 rows the few-rows kernels take 2-3.5x the best, and timing them five times was
    half of a first run's ~45 s of planning on one Zen 3 core. Both sweeps, so that one burst of another
    process's load cannot put the fastest kernel out."""
    weights = linears[0].weight.dtype
    inputs = {}
    for dtype in {input_dtype(k, weights) for k in kernels}:
        inputs[dtype] = {lin.weight.shape[1]: torch.randn(rows, lin.weight.shape[1], dtype=dtype) for lin in linears}
    times: dict[str, list[float]] = {k: [] for k in kernels}  # the warm-up first, left out of the result
    racing = list(kernels)
    for rep in range(reps + 1):
        for kernel in racing:
            x = inputs[input_dtype(kernel, weights)]
            start = time.perf_counter()
            for lin in linears:
                lin.run(x[lin.weight.shape[1]], kernel)
            times[kernel].append(time.perf_counter() - start)
        if rep == 1:
            seen = {k: min(times[k]) for k in racing}
            racing = [k for k in racing if seen[k] <= OUT_OF_THE_RACE * min(seen.values())]
    return {k: round(min(t[1:]) * 1000, 3) for k, t in times.items()}


def same_bits_where_exact(timings: dict[int, dict[str, float]]) -> dict[int, str]:
    """An exact plan's buckets up to `FEW_ROWS_MAX` must compute the same bits per row, so the 8-bit-input kernel
    takes all of them or none: the fastest kernel of each bucket among the family whose summed best times there
    are the smaller. The larger buckets keep to that family too (the fastest of it at each), so a prompt's
    prefill or a batch of many rows rounds its inputs as the plan's steps do: a plan timed beside a compile
    took the 8-bit kernel up to 32 rows and oneDNN's float32 from 64, and a batched prefill of three prompts
    (103 rows) then left other caches than their one-request prefills (31-38 rows): the next pass's logits 1.3
    apart (the same failure, to the digit, with such a plan forced)."""
    exact = [b for b in timings if b <= FEW_ROWS_MAX]

    def best(bucket: int, eight_bit: bool) -> str | None:
        found = {k: ms for k, ms in timings[bucket].items() if (k == EIGHT_BIT_INPUTS) == eight_bit}
        return min(found, key=found.get) if found else None

    families = [[best(b, eight_bit) for b in exact] for eight_bit in (False, True)]
    families = [f for f in families if None not in f]
    chosen = min(families, key=lambda f: sum(timings[b][k] for b, k in zip(exact, f, strict=True)))
    eight_bit = chosen[0] == EIGHT_BIT_INPUTS
    larger = {b: best(b, eight_bit) or best(b, not eight_bit) for b in timings if b > FEW_ROWS_MAX}
    return dict(zip(exact, chosen, strict=True)) | larger


def has_gguf_rows(linears: list[Linear]) -> bool:
    """Whether these linears also hold their GGUF rows: the row kernels are candidates of their plan."""
    return any(lin.blocks is not None for lin in linears)


def _read_plan(path: Path) -> dict | None:
    """A cached plan (or weight-format timing), or None where there is none or it is damaged (a process killed
    while writing it): then the kernels are timed again, where a damaged file raised a JSONDecodeError at every
    later load."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def plan_kernels(linears: list[Linear], kernel: str, signature: dict, reps: int = 5, exact: bool = False) -> dict:
    """Give every linear its kernel per row bucket: `kernel` everywhere, or for `auto` the fastest measured
    (cached per machine, model signature and thread count); with `exact`, the few-rows kernel at every bucket
    it covers (see the module's docstring). Returns {bucket: {kernel: ms}} of what was timed."""
    dtype = linears[0].weight.dtype
    quantized = has_gguf_rows(linears)
    if kernel != "auto":
        choice = {b: kernel if kernel in candidates(dtype, b, quantized=quantized) else "stock" for b in ROW_BUCKETS}
        timings: dict = {}
    else:
        key = {**signature, "kernels": kernels_digest(), "threads": torch.get_num_threads()}
        key["exact"] = "one input rounding at every bucket" if exact else False  # a plan of the old rule replans
        # a new candidate replans
        key["candidates"] = {str(b): candidates(dtype, b, exact, quantized) for b in ROW_BUCKETS}
        digest = stable_digest(key)
        path = cache_dir() / "kernel-plans" / f"{digest}.json"
        cached = _PLANNED_HERE.get(digest) or _read_plan(path)
        if cached and any(k.startswith("few-rows") for k in cached["choice"].values()) and not cpu_kernels_available():
            cached = None  # measured where the kernel built; here it did not
        if cached and cached.get("key") == key:
            choice, timings = {int(b): k for b, k in cached["choice"].items()}, cached["timings"]
        else:
            if "onednn" in candidates(dtype, ROW_BUCKETS[-1]):
                for lin in linears:
                    lin.pack_onednn()
            timings = {}
            print("specdecode: timing linear kernels on this machine (once per model shape)", file=sys.stderr)
            with ForeignLoad() as load:
                for b in ROW_BUCKETS:
                    timings[b] = _time_sweeps(linears, candidates(dtype, b, exact, quantized), b, reps)
            if exact:
                choice = same_bits_where_exact(timings)
            else:
                choice = {b: min(t, key=t.get) for b, t in timings.items()}
            plan = json.dumps({"key": key, "choice": choice, "timings": timings}, indent=1)
            _PLANNED_HERE[digest] = json.loads(plan)  # as read back from the file
            if load.cores <= MAX_FOREIGN_CORES:  # a plan measured beside another job serves this process only
                path.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomically(path, plan)
    uses_onednn = "onednn" in choice.values()
    for lin in linears:
        lin.plan = dict(choice)
        if uses_onednn:
            lin.pack_onednn()
        else:
            lin.drop_onednn()
    return {"choice": choice, "timings": timings}
