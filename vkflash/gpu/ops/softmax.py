"""Row softmax in f32 (MODEL.md §7.4): router over E experts, MTP confidence, long rows.

One workgroup per row: max, then Σ e^{x−max}, then the normalised exponentials (stable for any
logit range). The output may be the input's exact view (in place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkflash.gpu.interface import PushConstants, SpecConstants, u32
from vkflash.gpu.ops.views import F32, Rows, check_alias, check_same_shape, grid
from vkflash.gpu.registry import Kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class SoftmaxPush(PushConstants):
    """softmax.comp's push constants: row length and count, x and y views."""

    n: u32
    n_rows: u32
    x_off: u32
    x_stride: u32
    y_off: u32
    y_stride: u32


KERNELS = [Kernel("softmax", "softmax.comp", 2, push=SoftmaxPush, spec=SpecConstants)]
MAX_GROUPS = 65535  # one workgroup per row; more rows loop


def softmax(g: "Graph", x: Rows, y: Rows, name: str = "softmax") -> None:
    """y_r = softmax(x_r) for every row r."""
    check_same_shape(name, x=x, y=y)
    check_alias(name, y, x)
    g.dispatch("softmax", [x.buf, y.buf], [grid(x.n_rows, 1, MAX_GROUPS)],
               push=SoftmaxPush(x.n_cols, x.n_rows, x.off, x.stride, y.off, y.stride), name=name,
               desc=f"{x.n_rows}x{x.n_cols}", nbytes=3 * F32 * x.size)
