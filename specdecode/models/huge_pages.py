"""Tensors on 2 MB pages, for the weights a pass streams.

Why: a one-token pass of SmolLM2 streams ~97 MB of the 8-bit kernel's weights (its GGUF rows) as 121 matrices of
0.2-30 MB, each thread its share of each. On 4 KB pages that is ~24,000 pages a pass, far more than the TLB holds (a
Zen 4 core: 3,072 entries), and the hardware prefetchers stop at every page boundary. torch's allocator asks for
huge pages only under THP_MEM_ALLOC_ENABLE=1, and then only for allocations of 2 MB and more: the decoder's matrices
are smaller, and with it set passes did not move (1.04 / 1.00x at 1 / 8 positions, alternating processes, stop 67).
Copied in the order a pass reads them into one mapping advised to 2 MB pages (Linux's transparent huge pages in
`madvise` or `always` mode), a one-position pass took 0.79 / 0.84x the time at 128 / 1,024 cached tokens on a Zen 4
EPYC (alternating processes, results/huge_pages_ab_zen4_s67.md), passes over 8-16 positions ~0.95x (bfloat16 panels,
where the runner takes them: 0.94x); the same copy on 4 KB pages ~1.0x. This VM's "slow memory state"
(docs/runner.md) is partly that: a plain read of 256 MB ran at 35 GB/s on 4 KB pages and 59 GB/s on 2 MB pages in
the same second (on 2 MB pages the machine still moves between states, less often).
"""

import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether the kernel gives an advised mapping 2 MB pages: transparent huge pages in `always` or `madvise` mode."""
    try:
        mode = THP_MODE.read_text()
    except OSError:  # not Linux, or no THP
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def huge_page_bytes(nbytes: int) -> torch.Tensor | None:
    """`nbytes` zero bytes (uint8) in an anonymous mapping advised to 2 MB pages, starting at a page boundary; None
    where the kernel offers no huge pages. The mapping lives as long as the tensor or any view of it."""
    if not huge_pages_available():
        return None
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return None
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    first = -raw.data_ptr() % HUGE_PAGE
    return raw[first : first + nbytes]


def on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Copies of the contiguous CPU `tensors`, one after another in their order (each at a 64-byte boundary), on 2
    MB pages (`huge_page_bytes`); None where the kernel offers none."""
    offsets, size = [], 0
    for tensor in tensors:
        offsets.append(size)
        size += -(-tensor.nbytes // 64) * 64
    raw = huge_page_bytes(size) if tensors else None
    if raw is None:
        return None
    return [
        raw[at : at + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        for tensor, at in zip(tensors, offsets, strict=True)
    ]
