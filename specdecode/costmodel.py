"""A roofline cost model of one target forward pass, and what it implies for speculative decoding.

Decoding one token is memory bound: every weight is read once per pass, while the math for one position is
tiny. A pass over a few positions therefore costs the same as a pass over one, which is why verifying k
drafted tokens in one pass is nearly free. The model here is deliberately simple, so its numbers can be
checked by hand against the chapter it reproduces:

* A pass is a sum over "layer" entries (the embedding, every decoder layer, the LM head) of
  max(read time, math time), because a layer's math overlaps the read of the next layer's weights.
* Read time = bytes / bandwidth. All parameters are read once per pass, whatever the number of positions,
  including the embedding table and the LM head (untied models read both, tied ones read the table once).
  Optionally the KV cache of each layer is read too.
* Math = 2 x params x positions FLOPs per entry (plus attention over the context in decoder layers),
  divided by the peak FLOP/s of the dtype. By the chapter's convention the embedding counts as math as well.
* `int8` is weights and inputs in 8 bits (W8A8), with the 8-bit multiply's peak; a runner that streams other
  bytes than `params x dtype bytes` (GGUF's 4-bit rows, a few embedding rows) is priced by `entries_cost` from the
  bytes it reads (`bench premise`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:  # for the hint only: this module imports torch where a probe needs it
    import torch

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per parameter of a dtype name, or a clear error for a name we do not model."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; expected one of: {', '.join(DTYPE_BYTES)}") from None


# --------------------------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder, enough to count its parameters exactly.

    `attention_bias` (q/k/v biases, Qwen2) and `qk_norm` (per-head RMSNorm on q and k, Qwen3) change the
    count by well under 0.1%, but keeping them makes `total_params` match the real checkpoints exactly.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """q, k, v and o projections of one layer (plus q/k/v biases when the model has them)."""
        h = self.hidden_size
        params = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.attention_bias:
            params += self.q_dim + 2 * self.kv_dim
        return params

    @property
    def mlp_params(self) -> int:
        """gate, up and down projections of one layer."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def norm_params(self) -> int:
        """The two RMSNorm weights of one layer (plus the per-head q/k norms when the model has them)."""
        params = 2 * self.hidden_size
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        return self.attention_params + self.mlp_params + self.norm_params

    @property
    def embedding_params(self) -> int:
        """The token embedding table (which is also the LM head when the embeddings are tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """A separate LM head matrix; zero when it is tied to the embedding table."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """All parameters, each shared tensor counted once, including the final norm."""
        return (
            self.num_layers * self.layer_params
            + self.embedding_params
            + self.lm_head_params
            + self.hidden_size  # final norm
        )

    def weight_bytes(self, dtype: str) -> int:
        """Bytes read per pass for the weights alone."""
        return self.total_params * dtype_bytes(dtype)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | str | os.PathLike[str], name: str | None = None) -> ModelShape:
        """Build a shape from a Hugging Face `config.json` (a file, its folder, or the loaded dict).

        Multimodal configs that nest the language model under `text_config` are unwrapped. Qwen2 configs
        carry no `attention_bias` key although the model has q/k/v biases, so the model type decides it.
        """
        source = "config"
        if isinstance(cfg, dict):
            data = cfg
        else:
            path = Path(cfg)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise SpecDecodeError(f"no HF config.json at {path}")
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise SpecDecodeError(f"cannot read HF config {path}: {exc}") from exc
            if not isinstance(data, dict):
                raise SpecDecodeError(f"HF config {path} is not a JSON object")
            source = str(path)
            if name is None:
                name = path.parent.name or None
        if "hidden_size" not in data and isinstance(data.get("text_config"), dict):
            data = {**data["text_config"], "model_type": data["text_config"].get("model_type", "")}

        def need(key: str) -> int:
            value = data.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecDecodeError(f"{source}: `{key}` must be a positive integer, got {value!r}")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        model_type = str(data.get("model_type", ""))
        kv_heads = data.get("num_key_value_heads") or heads
        head_dim = data.get("head_dim") or hidden // heads
        if "attention_bias" in data:
            attention_bias = bool(data["attention_bias"])
        else:
            attention_bias = model_type == "qwen2"
        return cls(
            name=name or str(data.get("_name_or_path") or model_type or "custom"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
        )


def gate_matrix_bytes(shape: ModelShape, dtype: str) -> int:
    """Bytes of one MLP gate matrix: the chapter's picture of how much a single weight read costs."""
    return shape.hidden_size * shape.intermediate_size * dtype_bytes(dtype)


MODEL_PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256, tie_word_embeddings=False),
        ModelShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256, tie_word_embeddings=False),
        ModelShape("qwen3-8b", 4096, 12288, 36, 32, 8, 128, 151936, tie_word_embeddings=False, qk_norm=True),
        ModelShape("qwen3-4b", 2560, 9728, 36, 32, 8, 128, 151936, tie_word_embeddings=True, qk_norm=True),
        ModelShape("smollm2-135m", 576, 1536, 30, 9, 3, 64, 49152, tie_word_embeddings=True),
        # The GGUF we ship stores a separate output tensor, so it is read as an untied model.
        ModelShape("qwen2.5-coder-0.5b", 896, 4864, 24, 14, 2, 64, 151936, attention_bias=True),
    )
}


def resolve_model_shape(spec: str) -> ModelShape:
    """A preset name, or the path of an HF `config.json` (or of the folder holding one)."""
    if Path(spec).expanduser().exists():
        return ModelShape.from_hf_config(Path(spec).expanduser())
    return get_model_shape(spec)


def get_model_shape(name: str) -> ModelShape:
    """A preset by name, or a clear error listing the presets."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise SpecDecodeError(
            f"unknown model {name!r}; expected one of: {', '.join(MODEL_PRESETS)} (or an HF config.json)"
        ) from None


# --------------------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    """Memory bandwidth and dense peak FLOP/s per dtype: the two numbers a roofline needs."""

    name: str
    bandwidth_bytes_per_s: float
    peak_flops: dict[str, float]

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s of a dtype, or a clear error when this hardware has none listed for it."""
        dtype_bytes(dtype)
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise SpecDecodeError(
                f"hardware {self.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                f"it has: {', '.join(self.peak_flops) or 'none'}"
            ) from None


_HOPPER_FLOPS = {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "int8": 1979e12, "fp32": 67e12}

# Dense (no sparsity) tensor-core peaks from the vendor data sheets.
HARDWARE_PRESETS: dict[str, Hardware] = {
    "h100-sxm": Hardware("h100-sxm", 3.35e12, dict(_HOPPER_FLOPS)),
    "h200": Hardware("h200", 4.8e12, dict(_HOPPER_FLOPS)),
    "b200": Hardware(
        "b200", 8.0e12, {"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "int8": 4500e12, "fp32": 80e12}
    ),
    "a100": Hardware("a100", 2.039e12, {"bf16": 312e12, "fp16": 312e12, "int8": 624e12, "fp32": 19.5e12}),
}

HARDWARE_NAMES: tuple[str, ...] = (*HARDWARE_PRESETS, "cpu")

_TORCH_DTYPE_NAMES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8": "float8_e4m3fn",
    "int8": "int8",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The cost model's name ("fp32", "bf16", ...) of a torch dtype."""
    return next(name for name, full in _TORCH_DTYPE_NAMES.items() if str(dtype) == f"torch.{full}")


READ_PROBE_BYTES = 256 * 2**20  # far beyond any per-core cache share


def read_probe_buffer() -> torch.Tensor:
    """The buffer the read-bandwidth probe sums: 256 MiB of float32 ones (ones, not empty: its pages fault in
    now, not in a timed read), on 2 MB pages where the kernel offers them, as the runner's weights are
    (`models/huge_pages.py`: on 4 KB pages a VM's reads ran at 35 GB/s where they ran at 59 on 2 MB pages; until
    stop 67 the probe read 4 KB pages). A larger buffer measured the same here but faulting its pages in took
    seconds on a busy machine."""
    import torch

    from specdecode.models.huge_pages import huge_page_bytes

    raw = huge_page_bytes(READ_PROBE_BYTES)
    if raw is None:
        return torch.ones(READ_PROBE_BYTES // 4, dtype=torch.float32)
    return raw.view(torch.float32).fill_(1.0)


def read_bandwidth(buffer: torch.Tensor) -> float:
    """Bytes/s of one timed sum over `buffer`: a decode step streams its weights once and writes little, so read
    bandwidth is what matters."""
    start = time.perf_counter()
    buffer.sum()
    return buffer.nbytes / (time.perf_counter() - start)


@functools.lru_cache(maxsize=1)
def _probe_cpu_bandwidth() -> float:
    """Best-of-several read bandwidth in bytes/s (`read_bandwidth`)."""
    buffer = read_probe_buffer()
    buffer.sum()  # warm-up
    return max(read_bandwidth(buffer) for _ in range(4))


@functools.cache
def _probe_cpu_flops(dtype: str) -> float:
    """Best-of-several square matmul FLOP/s for a dtype, within about half a second.

    The size doubles from 256 up to 2048 while a matmul stays quick, so fast dtypes are timed on a size
    large enough to reach peak, and slow ones (torch emulates fp8 on CPUs) cannot stall the probe.
    """
    import torch

    torch_dtype = getattr(torch, _TORCH_DTYPE_NAMES[dtype])
    multiply = torch._int_mm if dtype == "int8" else torch.mm  # int8 into int32 sums (oneDNN's VNNI GEMM on a CPU)

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        start = time.perf_counter()
        multiply(a, b)
        return time.perf_counter() - start

    n = 128
    elapsed = 0.0
    while n < 2048 and elapsed < 0.02:
        n *= 2
        try:
            a, b = (torch.randn(n, n).mul(40).clamp(-127, 127).to(torch_dtype) for _ in range(2))
            elapsed = timed(a, b)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            raise SpecDecodeError(f"cannot run a {dtype} matmul on this CPU with torch: {exc}") from exc
    best = elapsed
    deadline = time.perf_counter() + 0.3
    for _ in range(5):
        if time.perf_counter() > deadline:
            break
        best = min(best, timed(a, b))
    rate = 2 * n**3 / best
    return max(rate, _eight_bit_kernel_peak()) if dtype == "int8" else rate


def _eight_bit_kernel_peak() -> float:
    """FLOP/s (two a product) of the multiply the runner's 8-bit-input kernel is built on, every thread at once
    (`q8_multiply_peak`, csrc/q8_rows.cpp), best of three probes of 0.1 s (a probe of 0.05 s read 272 inside the
    premise's run where it reads 395 alone, Zen 3); 0 where that kernel does not exist. Without it the 8-bit peak was
    torch._int_mm's alone, which on AVX2 without VNNI has no fast path: 2.3 GFLOP/s on a Zen 3, where the kernel
    runs at ~190, and the premise's roofline read 122 ms for a 7 ms pass."""
    import torch

    from specdecode.models.linear import cpu_kernels_available

    if not cpu_kernels_available() or not torch.ops.specdecode.q8_rows_available():
        return 0.0
    return 2 * max(torch.ops.specdecode.q8_multiply_peak(0.1) for _ in range(3))  # best of several, as above


def probe_cpu_hardware(*dtypes: str, bandwidth_bytes_per_s: float | None = None) -> Hardware:
    """Measure this machine (about a second a dtype, cached per process) instead of trusting a data sheet: the
    peak of each dtype named (fp32 if none); a bandwidth read elsewhere (the premise's, beside the passes it
    prices) is taken as given and not probed again."""
    dtypes = dtypes or ("fp32",)
    for dtype in dtypes:
        dtype_bytes(dtype)
    bandwidth = _probe_cpu_bandwidth() if bandwidth_bytes_per_s is None else bandwidth_bytes_per_s
    return Hardware("cpu", bandwidth, {dtype: _probe_cpu_flops(dtype) for dtype in dtypes})


def get_hardware(name: str, dtype: str = "bf16") -> Hardware:
    """A hardware preset, or a fresh probe for "cpu"; checks that the dtype has a peak on it."""
    key = name.lower()
    if key == "cpu":
        return probe_cpu_hardware(dtype)
    if key not in HARDWARE_PRESETS:
        raise SpecDecodeError(f"unknown hardware {name!r}; expected one of: {', '.join(HARDWARE_NAMES)}")
    hw = HARDWARE_PRESETS[key]
    hw.flops_for(dtype)
    return hw


# --------------------------------------------------------------------------------------------------------
# Pass cost
# --------------------------------------------------------------------------------------------------------


@dataclass
class PassCost:
    """The time of one target forward pass, and which of read and math dominates it."""

    positions: int
    read_ms: float
    math_ms: float
    pass_ms: float
    bound: str  # "memory" or "compute"


def _layer_entries(shape: ModelShape) -> list[tuple[int, bool]]:
    """(params, is_decoder_layer) per entry of the sum: embedding, decoder layers, LM head + final norm."""
    entries = [(shape.embedding_params, False)]
    entries += [(shape.layer_params, True)] * shape.num_layers
    entries.append((shape.lm_head_params + shape.hidden_size, False))
    return entries


def kv_read_bytes(shape: ModelShape, context_len: int, nbytes: float) -> float:
    """Bytes of one layer's KV cache that a pass attending to `context_len` cached tokens reads."""
    return 2 * context_len * shape.kv_dim * nbytes


def pass_cost(
    shape: ModelShape,
    hw: Hardware,
    dtype: str,
    positions: int,
    context_len: int = 0,
    include_kv_read: bool = False,
) -> PassCost:
    """Cost of one pass over `positions` new tokens attending to `context_len` cached ones."""
    if context_len < 0:
        raise SpecDecodeError(f"context_len must be >= 0, got {context_len}")
    nbytes = dtype_bytes(dtype)
    attn_flops = 4 * context_len * shape.q_dim * positions
    kv_bytes = kv_read_bytes(shape, context_len, nbytes) if include_kv_read else 0
    entries = [
        (params * nbytes + (kv_bytes if is_layer else 0), 2 * params * positions + (attn_flops if is_layer else 0))
        for params, is_layer in _layer_entries(shape)
    ]
    return entries_cost(entries, hw, dtype, positions)


def entries_cost(entries: list[tuple[float, float]], hw: Hardware, dtype: str, positions: int) -> PassCost:
    """A pass as (bytes read, FLOPs) per entry, each entry max(read, math) at the bandwidth and `dtype`'s peak:
    `pass_cost`'s sum, for a runner that reads other bytes than its parameters in one dtype."""
    if positions < 1:
        raise SpecDecodeError(f"positions must be >= 1, got {positions}")
    flops = hw.flops_for(dtype)
    reads = [read / hw.bandwidth_bytes_per_s for read, _ in entries]
    works = [work / flops for _, work in entries]
    read_s, math_s = sum(reads), sum(works)
    return PassCost(
        positions=positions,
        read_ms=read_s * 1e3,
        math_ms=math_s * 1e3,
        pass_ms=sum(map(max, reads, works)) * 1e3,
        bound="compute" if math_s > read_s else "memory",
    )


# --------------------------------------------------------------------------------------------------------
# Speculative decoding
# --------------------------------------------------------------------------------------------------------


def expected_accepted_length(acceptance_rate: float, draft_length: int) -> float:
    """Tokens per round (the target's own token included) when each drafted token is accepted i.i.d."""
    if not 0.0 <= acceptance_rate <= 1.0:
        raise SpecDecodeError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
    if draft_length < 0:
        raise SpecDecodeError(f"draft_length must be >= 0, got {draft_length}")
    if acceptance_rate == 1.0:
        return float(draft_length + 1)
    return (1.0 - acceptance_rate ** (draft_length + 1)) / (1.0 - acceptance_rate)


def _speedup(accepted_length: float, draft_cost_ms: float, t_one: float, t_round: float) -> float:
    return accepted_length * t_one / (draft_cost_ms + t_round)


def expected_speedup(
    shape: ModelShape,
    hw: Hardware,
    dtype: str,
    draft_length: int,
    accepted_length: float,
    draft_cost_ms: float = 0.0,
    context_len: int = 0,
) -> float:
    """Tokens per ms of speculative decoding over tokens per ms of one-token-per-pass decoding."""
    if draft_length < 0:
        raise SpecDecodeError(f"draft_length must be >= 0, got {draft_length}")
    if not 0.0 < accepted_length <= draft_length + 1:
        raise SpecDecodeError(
            f"accepted_length must be in (0, draft_length + 1 = {draft_length + 1}], got {accepted_length}"
        )
    if draft_cost_ms < 0:
        raise SpecDecodeError(f"draft_cost_ms must be >= 0, got {draft_cost_ms}")
    t_one = pass_cost(shape, hw, dtype, 1, context_len).pass_ms
    t_round = pass_cost(shape, hw, dtype, draft_length + 1, context_len).pass_ms
    return _speedup(accepted_length, draft_cost_ms, t_one, t_round)


def best_draft_length(
    shape: ModelShape,
    hw: Hardware,
    dtype: str,
    acceptance_rate: float,
    draft_cost_ms_per_token: float = 0.0,
    max_draft_length: int = 32,
    context_len: int = 0,
) -> tuple[int, float]:
    """The draft length in 0..max with the best expected speedup (0 means: do not speculate)."""
    if max_draft_length < 0:
        raise SpecDecodeError(f"max_draft_length must be >= 0, got {max_draft_length}")
    if draft_cost_ms_per_token < 0:
        raise SpecDecodeError(f"draft_cost_ms_per_token must be >= 0, got {draft_cost_ms_per_token}")
    best_k, best = 0, 1.0
    for k in range(1, max_draft_length + 1):
        speedup = expected_speedup(
            shape,
            hw,
            dtype,
            k,
            expected_accepted_length(acceptance_rate, k),
            draft_cost_ms=k * draft_cost_ms_per_token,
            context_len=context_len,
        )
        if speedup > best:
            best_k, best = k, speedup
    return best_k, best


# --------------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------------


def cost_report(
    shape: ModelShape,
    hw: Hardware,
    dtype: str,
    positions: list[int],
    context_len: int = 0,
    include_kv_read: bool = False,
    acceptance_rate: float | None = None,
    draft_cost_ms_per_token: float = 0.0,
) -> dict[str, Any]:
    """A JSON-able summary: pass costs per number of positions, and speedups when an acceptance rate is given.

    With an acceptance rate, a row over P positions is read as a round that verifies P - 1 drafted tokens.
    """
    if not positions:
        raise SpecDecodeError("positions must list at least one number of positions")
    t_one = pass_cost(shape, hw, dtype, 1, context_len, include_kv_read).pass_ms
    rows = []
    for p in positions:
        cost = pass_cost(shape, hw, dtype, p, context_len, include_kv_read)
        row: dict[str, Any] = {
            "positions": p,
            "read_ms": cost.read_ms,
            "math_ms": cost.math_ms,
            "math_ms_per_position": cost.math_ms / p,
            "pass_ms": cost.pass_ms,
            "ratio_to_one_position": cost.pass_ms / t_one,
            "bound": cost.bound,
        }
        if acceptance_rate is not None:
            k = p - 1
            accepted = expected_accepted_length(acceptance_rate, k)
            row["draft_length"] = k
            row["expected_accepted_length"] = accepted
            row["speedup"] = _speedup(accepted, k * draft_cost_ms_per_token, t_one, cost.pass_ms)
        rows.append(row)
    report: dict[str, Any] = {
        "model": shape.name,
        "hardware": hw.name,
        "dtype": dtype,
        "bandwidth_tb_per_s": hw.bandwidth_bytes_per_s / 1e12,
        "peak_tflops": hw.flops_for(dtype) / 1e12,
        "context_len": context_len,
        "include_kv_read": include_kv_read,
        "total_params": shape.total_params,
        "gate_matrix_mb": gate_matrix_bytes(shape, dtype) / 1e6,
        "weights_gb": shape.weight_bytes(dtype) / 1e9,
        "rows": rows,
    }
    if acceptance_rate is not None:
        k, speedup = best_draft_length(
            shape, hw, dtype, acceptance_rate, draft_cost_ms_per_token, context_len=context_len
        )
        report["acceptance_rate"] = acceptance_rate
        report["draft_cost_ms_per_token"] = draft_cost_ms_per_token
        report["best_draft_length"] = k
        report["best_speedup"] = speedup
    return report


def _fmt_ms(value: float) -> str:
    """Enough digits for sub-microsecond math times and multi-second passes alike."""
    if value == 0 or not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1 else f"{value:.3f}"


def format_cost_table(report: dict[str, Any]) -> str:
    """The report as a short header and a markdown table."""
    kv = ", KV cache read" if report.get("include_kv_read") else ""
    lines = [
        f"**{report['model']}** in {report['dtype']} on **{report['hardware']}** "
        f"({report['bandwidth_tb_per_s']:.3g} TB/s, {report['peak_tflops']:.4g} TFLOP/s), "
        f"context {report['context_len']}{kv}",
        "",
        f"Weights read per pass: {report['weights_gb']:.2f} GB "
        f"({report['total_params'] / 1e9:.3f} B params); "
        f"one MLP gate matrix: {report['gate_matrix_mb']:.1f} MB",
        "",
    ]
    speculative = "acceptance_rate" in report
    header = ["positions", "read ms", "math ms", "math ms/pos", "pass ms", "x 1-pos pass", "bound"]
    if speculative:
        header += ["draft k", "E[accepted]", "speedup"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---:" if h != "bound" else ":---" for h in header) + "|")
    for row in report["rows"]:
        cells = [
            str(row["positions"]),
            _fmt_ms(row["read_ms"]),
            _fmt_ms(row["math_ms"]),
            _fmt_ms(row["math_ms_per_position"]),
            _fmt_ms(row["pass_ms"]),
            f"{row['ratio_to_one_position']:.3f}",
            row["bound"],
        ]
        if speculative:
            cells += [
                str(row["draft_length"]),
                f"{row['expected_accepted_length']:.2f}",
                f"{row['speedup']:.2f}x",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    if speculative:
        lines += [
            "",
            f"Acceptance rate {report['acceptance_rate']:g}, draft cost "
            f"{report['draft_cost_ms_per_token']:g} ms/token: best draft length "
            f"{report['best_draft_length']} ({report['best_speedup']:.2f}x)",
        ]
    return "\n".join(lines)
