"""Row argmax of f32 logits in two passes (greedy sampling): the first maximum wins, like numpy.

Pass 1: n_parts workgroups per row each write their best (value, index) pair to a scratch
buffer; pass 2: one workgroup per row reduces the pairs and writes one uint32 index. A row holding
a NaN or +inf gets NO_INDEX (no logit is its argmax; the engine reports a numeric fault).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkflash.gpu.interface import PushConstants, SpecConstants, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.views import F32, Rows
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.device import Capabilities
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class ArgmaxPush(PushConstants):
    """argmax.comp's push constants: row length and count, workgroups per row, x view, output offset."""

    n: u32
    n_rows: u32
    n_parts: u32
    x_off: u32
    x_stride: u32
    out_off: u32


@dataclass(frozen=True)
class ArgmaxSpec(SpecConstants):
    """argmax.comp's pass: 0 partial maxima, 1 their reduction."""

    stage: u32


KERNELS = [Kernel("argmax", "argmax.comp", 3, push=ArgmaxPush, spec=ArgmaxSpec)]
MAX_PARTS = 256  # partial results per row: pass 2 is one workgroup over these
MAX_ROWS = 65535
NO_INDEX = 0xFFFFFFFF  # the index of a row with a NaN or +inf


def n_parts(caps: "Capabilities", n: int) -> int:
    """Workgroups per row in pass 1 for rows of n logits."""
    return max(1, min(MAX_PARTS, -(-n // kernel("argmax").workgroup(caps))))


def scratch_bytes(caps: "Capabilities", n: int, n_rows: int = 1) -> int:
    """Bytes of the (value, index) scratch that `argmax` needs for n_rows rows of n."""
    return 8 * n_rows * n_parts(caps, n)


def argmax(g: "Graph", x: Rows, out: Buffer, out_off: int = 0, scratch: Buffer | None = None,
           name: str = "argmax") -> None:
    """out[out_off + r] = the first index of max(x_r) (uint32), or NO_INDEX where x_r holds a NaN or
    +inf, for every row r of x (the pass-1 pairs in `scratch`, default an intermediate)."""
    caps = g.gpu.caps
    parts = n_parts(caps, x.n_cols)
    if scratch is None:
        scratch = g.temp(scratch_bytes(caps, x.n_cols, x.n_rows), f"{name}.scratch")
    if x.n_rows > MAX_ROWS:
        raise ValueError(f"{name}: {x.n_rows} rows, at most {MAX_ROWS}")
    if x.stride == 0 and x.n_rows > 1:
        raise ValueError(f"{name}: input view with stride 0")
    need = scratch_bytes(caps, x.n_cols, x.n_rows)
    if scratch.nbytes < need:
        raise ValueError(f"{name}: scratch of {scratch.nbytes} B, needs {need} B (argmax.scratch_bytes)")
    if out_off < 0 or 4 * (out_off + x.n_rows) > out.nbytes:
        raise ValueError(f"{name}: {x.n_rows} indices at {out_off} overflow {out.name or 'the output'!r}")
    if scratch is x.buf or scratch is out or out is x.buf:
        raise ValueError(f"{name}: logits, scratch and output must be three different buffers")
    push = ArgmaxPush(x.n_cols, x.n_rows, parts, x.off, x.stride, out_off)
    desc = f"{x.n_rows}x{x.n_cols}"
    g.dispatch("argmax", [x.buf, scratch, out], [parts, x.n_rows], push=push, spec=ArgmaxSpec(0), writes=[1],
               name=f"{name}.partial", desc=desc, nbytes=F32 * x.size + 8 * parts * x.n_rows)
    g.dispatch("argmax", [x.buf, scratch, out], [1, x.n_rows], push=push, spec=ArgmaxSpec(1), writes=[2],
               name=f"{name}.reduce", desc=desc, nbytes=8 * parts * x.n_rows + 4 * x.n_rows)
