"""The linear kernel of the verify pass, chosen by the number of positions k.

Speculative decoding assumes a pass over k positions costs about what one costs. On x86 CPUs stock
`F.linear` (MKL sgemm) breaks that: from k = 4 its small-batch kernel is 2-3.5x slower than k = 1.
oneDNN with a prepacked weight stays near the memory roofline up to k = 16, but is slower than MKL's
GEMV path at k = 1..3. So each linear keeps both forms and dispatches on the number of rows.
`specdecode bench premise` measures every kernel per k on the machine it runs on.
"""

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("auto", "stock", "onednn")
ONEDNN_MIN_ROWS = 4  # from the premise benchmark: below this MKL's GEMV path is faster


class DispatchLinear(nn.Module):
    """An `nn.Linear` stand-in that uses a prepacked oneDNN weight for rows >= `min_rows`."""

    def __init__(self, linear: nn.Linear, min_rows: int) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.min_rows = min_rows
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < self.min_rows or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


def install_kernels(model: nn.Module, kernel: str) -> int:
    """Swap every float32 CPU `nn.Linear` of `model` for a `DispatchLinear`; returns how many."""
    if kernel == "stock":
        return 0
    min_rows = ONEDNN_MIN_ROWS if kernel == "auto" else 1
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                setattr(parent, name, DispatchLinear(child, min_rows))
                swapped += 1
    return swapped
