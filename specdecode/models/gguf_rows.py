"""The GGUF's own quantized rows beside the float32 weights converted from them, for the few-rows kernel.

Why: the registry's targets ship as GGUF files whose decoder linears are Q4_1 (20 bytes for 32 weights) and
whose embedding, SmolLM2's LM head too, is Q8_0 (34 bytes); converted to float32 they are 6.4x and 3.8x the
bytes a decode step streams. A Q4_1 weight is d * q + m and a Q8_0 weight d * q, with d and m float16 and q
four or eight bits: d * q is exact in float32, so a weight rebuilt in registers is the very float32 value the
conversion wrote, and the kernel (csrc/runner_kernels.cpp) sums the same products in the same order as over the
float32 weights: the same bits at a fraction of the bytes. Rows are kept only where that holds exactly: every
row of the converted weight is found among the dequantized GGUF rows (the conversion reorders the rows of q
and k for its rotary layout). Found once per converted folder and cached inside it, under a name that is not
`*.safetensors`: vLLM loads every such file of a model folder as weights (and failed on the rows' widths).
"""

import functools
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # per 32 weights: float16 d (and m), then 4-bit or 8-bit q
CACHE_FILE = "gguf-rows.cache"  # safetensors inside
_OLD_CACHE_FILE = "gguf-rows.safetensors"  # before stop 40; renamed when found
SOURCE_MARKER = "specdecode-source.json"  # written by the registry's conversion: {"gguf": path, ...}
_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HEAD = {"output.weight": "lm_head.weight", "token_embd.weight": "lm_head.weight"}  # the embedding: a tied head


def dequantize(blocks: torch.Tensor, inputs: int) -> torch.Tensor:
    """Q4_1 rows (N, inputs / 32 * 20) or Q8_0 rows (N, inputs / 32 * 34), uint8 -> (N, inputs) float32, as the
    conversion and the kernel compute them."""
    rows = blocks.shape[0]
    b = blocks.view(rows, inputs // 32, -1)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if b.shape[-1] == BLOCK_BYTES["Q8_0"]:
        return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    q = b[..., 4:]
    q = torch.cat([q & 15, q >> 4], dim=-1).float()  # weight t < 16: low nibble of byte t; else high of t - 16
    return (d * q + m).reshape(rows, -1)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Float rows (N, K) -> Q8_0 rows (N, K / 32 * 34) uint8, as llama.cpp rounds a matrix to Q8_0: per 32 weights
    d = max |w| / 127 (float16) and q = round(w / d). For weights that come with no GGUF rows (a drafter's), so
    that the 8-bit-input kernel can read them; `dequantize` gives the float32 values they then stand for."""
    rows, inputs = weight.shape
    blocks = weight.detach().float().reshape(rows, inputs // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half()
    scale = d.float()
    q = torch.where(scale > 0, blocks / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    q = q.round().clamp(-127, 127).to(torch.int8)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(rows, -1)


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """Float rows (N, K) -> Q4_1 rows (N, K / 32 * 20) uint8, llama.cpp's Q4_1: per 32 weights m = min w and
    d = (max w - m) / 15, both float16, and q = round((w - m) / d) in 0 .. 15 against the stored m and d; weight
    t < 16 in the low nibble of byte t, else in the high nibble of byte t - 16. For a drafter's weights: on the
    8-bit-input kernel a Q4_1 block takes three instructions per 32 products where Q8_0 takes five."""
    rows, inputs = weight.shape
    blocks = weight.detach().float().reshape(rows, inputs // 32, 32)
    low = blocks.amin(-1, keepdim=True).half()
    d = ((blocks.amax(-1, keepdim=True) - low.float()) / 15).half()
    scale = d.float()
    q = torch.where(scale > 0, (blocks - low.float()) / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    q = q.round().clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([d.view(torch.uint8), low.view(torch.uint8), nibbles], dim=-1).reshape(rows, -1)


def interleave(blocks: torch.Tensor, inputs: int, group: int) -> torch.Tensor | None:
    """Q4_1 rows (N, inputs / 32 * 20) or Q8_0 rows (N, inputs / 32 * 34) -> the 8-bit-input kernel's groups of
    `group` rows (N / group, inputs / 32, 20 group or 34 group) uint8, or None where N is not a multiple of `group`
    (the kernel's `q8_group_rows`: 16 with AVX512-VNNI, else 8). Per group and block, Q4_1: four steps of 4 group
    bytes, step s giving row r's weights 8 s + t in the low nibble of byte 4 r + t and 8 s + 4 + t in its high
    nibble (t < 4), then the group's d, then its m; Q8_0: eight steps of 4 group bytes, step s giving row r's
    weights 4 s + t in byte 4 r + t (in groups of 16 plus 128: unsigned, as vpdpbusd takes them), then the group's d
    (csrc/q8_rows.cpp). The same bytes, reordered: nothing is rounded."""
    rows, count = blocks.shape[0], inputs // 32
    if rows % group:
        return None
    b = blocks.view(rows // group, group, count, -1)  # group, row, block, bytes

    def per_row(part: torch.Tensor, steps: int) -> torch.Tensor:  # (group, row, block, steps, t) -> step-major
        return part.view(rows // group, group, count, steps, 4).permute(0, 2, 3, 1, 4).reshape(rows // group, count, -1)

    def scales(offset: int) -> torch.Tensor:  # each row's float16 at `offset` of its blocks, the group's in a row
        return b[..., offset : offset + 2].permute(0, 2, 1, 3).reshape(rows // group, count, 2 * group)

    if b.shape[-1] == BLOCK_BYTES["Q8_0"]:
        weights = b[..., 2:] ^ 128 if group == 16 else b[..., 2:]
        return torch.cat([per_row(weights, 8), scales(0)], dim=-1).contiguous()
    q = torch.cat([b[..., 4:] & 15, b[..., 4:] >> 4], dim=-1).view(rows // group, group, count, 4, 2, 4)
    nibbles = per_row(q[..., 0, :] | (q[..., 1, :] << 4), 4)
    return torch.cat([nibbles, scales(0), scales(2)], dim=-1).contiguous()


def _rebuilds(blocks: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `blocks` are Q4_1 or Q8_0 rows that rebuild `weight` exactly."""
    widths = {weight.shape[1] // 32 * size for size in BLOCK_BYTES.values()}
    return (
        blocks.dtype == torch.uint8
        and weight.shape[1] % 32 == 0
        and blocks.dim() == 2
        and blocks.shape[0] == weight.shape[0]
        and blocks.shape[1] in widths
        and torch.equal(dequantize(blocks, weight.shape[1]), weight)
    )


def _in_weight_order(blocks: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`blocks` reordered so that row i rebuilds row i of `weight` exactly, or None where some row is not there."""
    values = dequantize(blocks, weight.shape[1])
    if torch.equal(values, weight):
        return blocks
    index = {row.numpy().tobytes(): i for i, row in enumerate(values)}
    order = [index.get(row.numpy().tobytes()) for row in weight]
    return None if None in order else blocks[order].contiguous()


def _decoder_name(tensor_name: str) -> str | None:
    """The HF name of a GGUF decoder linear (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`),
    else None."""
    found = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor_name)
    return f"model.layers.{found[1]}.{_GGUF_TO_HF[found[2]]}.weight" if found and found[2] in _GGUF_TO_HF else None


@functools.lru_cache(maxsize=2)
def _tensors(gguf_path: Path) -> list:
    """The GGUF's tensors (memory-mapped), parsed once per process: a folder's first load asks `holds_rows` and then
    `gguf_rows`, and each parse takes ~2.6 s (the file's vocabulary is read too)."""
    import gguf  # the conversion's own dependency; imported only when a folder's facts are first found

    return list(gguf.GGUFReader(gguf_path).tensors)


def holds_rows(source: str | Path | None) -> bool:
    """Whether the GGUF behind the converted folder `source` stores every decoder linear as Q4_1 or Q8_0 rows
    (the few-rows kernels can then stream those rows instead of float32 weights). The answer is kept in the
    folder's source marker: reading the file's tensor list takes ~2.6 s (its vocabulary is parsed too)."""
    folder = Path(source) if source else None
    marker = folder / SOURCE_MARKER if folder else None
    if marker is None or not marker.exists():
        return False
    try:
        facts = json.loads(marker.read_text())
    except ValueError:  # a broken marker: the folder's load says what is wrong
        return False
    if "holds_rows" in facts:
        return facts["holds_rows"]
    gguf_path = Path(facts.get("gguf", ""))
    if not gguf_path.is_file():
        return False
    kinds = [t.tensor_type.name for t in _tensors(gguf_path) if _decoder_name(t.name)]
    facts["holds_rows"] = bool(kinds) and all(kind in BLOCK_BYTES for kind in kinds)
    try:
        marker.write_text(json.dumps(facts))
    except OSError:  # a read-only folder: read again next time
        pass
    return facts["holds_rows"]


def gguf_rows(source: str | Path | None, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: rows} for the float32 linears of `weights` (HF names: the decoder's, the LM head) that the GGUF
    behind the converted folder `source` holds as Q4_1 or Q8_0; {} for a folder converted from nothing we know."""
    folder = Path(source) if source else None
    if folder is None or not (folder / SOURCE_MARKER).exists():
        return {}
    cached = folder / CACHE_FILE
    if (folder / _OLD_CACHE_FILE).exists():
        os.replace(folder / _OLD_CACHE_FILE, cached)
    if cached.exists():
        try:
            rows = load_file(str(cached))
        except Exception:  # a truncated cache (a killed first run): found again below
            rows = None
        if rows is not None:  # kept where it still rebuilds the weights exactly (0.3 s for SmolLM2's 211)
            return {n: r for n, r in rows.items() if n in weights and _rebuilds(r, weights[n])}
    gguf_path = Path(json.loads((folder / SOURCE_MARKER).read_text()).get("gguf", ""))
    if not gguf_path.is_file():
        return {}
    rows = {}
    for tensor in _tensors(gguf_path):
        name = _decoder_name(tensor.name)
        if name is None and tensor.name in _HEAD and _HEAD[tensor.name] not in rows:
            name = _HEAD[tensor.name]  # an untied head's own, or the embedding
        if name is None:
            continue
        weight, kind = weights.get(name), tensor.tensor_type.name
        if weight is None or weight.dtype != torch.float32 or weight.shape[1] % 32 or kind not in BLOCK_BYTES:
            continue
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        if blocks.shape != (weight.shape[0], weight.shape[1] // 32 * BLOCK_BYTES[kind]):
            continue
        ordered = _in_weight_order(blocks, weight)
        if ordered is not None:
            rows[name] = ordered
    partial = cached.with_suffix(".partial")
    try:
        save_file(rows, str(partial))
        os.replace(partial, cached)
    except OSError:  # a read-only folder: found again next time
        partial.unlink(missing_ok=True)
    return rows
