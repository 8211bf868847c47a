"""Elementwise ops on row views: add, mul, scale, silu, sigmoid, softplus (MODEL.md §2).

One shader (shaders/eltwise.comp), the op chosen by a specialization constant. Binary ops may
broadcast one row of `b` over all rows (b.n_rows == 1 or stride 0); any output may be the exact
view of an input (in place).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from vkflash.gpu.graph import Node
from vkflash.gpu.interface import PushConstants, SpecConstants, f32, u32
from vkflash.gpu.ops.views import Rows, check_alias, check_same_shape, grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class EltwisePush(PushConstants):
    """eltwise.comp's push constants: the shape, each view's offset and row stride, alpha."""

    n_cols: u32
    n_rows: u32
    a_off: u32
    a_stride: u32
    b_off: u32
    b_stride: u32
    y_off: u32
    y_stride: u32
    alpha: f32


@dataclass(frozen=True)
class EltwiseSpec(SpecConstants):
    """eltwise.comp's op (Op)."""

    op: u32


KERNELS = [Kernel("eltwise", "eltwise.comp", 3, push=EltwisePush, spec=EltwiseSpec)]
MAX_GROUPS = 4096  # grid-stride loop covers the rest


class Op(IntEnum):
    """Op codes of eltwise.comp (constant_id 1); 2 is unused."""

    ADD = 0
    MUL = 1
    SCALE = 3
    SILU = 4
    SIGMOID = 5
    SOFTPLUS = 6


BINARY = frozenset({Op.ADD, Op.MUL})


def _broadcast(op: str, a: Rows, b: Rows) -> Rows:
    """b as a view with a's shape: itself, or its single row repeated (stride 0)."""
    if b.n_cols != a.n_cols:
        raise ValueError(f"{op}: row lengths differ: a {a.n_cols}, b {b.n_cols}")
    if b.n_rows == a.n_rows:
        return b
    if b.n_rows == 1:
        return Rows(b.buf, a.n_rows, b.n_cols, b.off, 0)
    raise ValueError(f"{op}: b has {b.n_rows} rows; needs {a.n_rows} or 1 (broadcast)")


@dataclass(frozen=True)
class Eltwise(Node):
    """y = op(a, b): b is None for unary ops, or a's shape (one row repeated: stride 0)."""

    op: Op
    a: Rows
    b: Rows | None
    y: Rows
    alpha: float
    name: str

    def inputs(self) -> tuple[Rows, ...]:
        return (self.a,) if self.b is None else (self.a, self.b)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.y,)

    def lower(self, g: "Graph") -> None:
        a, y = self.a, self.y
        bb = self.b or a
        wg = kernel("eltwise").workgroup(g.gpu.caps)
        n = a.size
        g.dispatch("eltwise", [a.buf, bb.buf, y.buf], [grid(n, wg, MAX_GROUPS)],
                   push=EltwisePush(a.n_cols, a.n_rows, a.off, a.stride, bb.off, bb.stride, y.off, y.stride,
                                    self.alpha),
                   spec=EltwiseSpec(self.op), name=self.name, desc=f"{self.op.name} {a.n_rows}x{a.n_cols}",
                   nbytes=4 * n * (3 if self.op in BINARY else 2))


def eltwise(g: "Graph", op: Op, a: Rows, b: Rows | None, y: Rows, alpha: float = 1.0, name: str = "") -> None:
    """y = op(a, b) elementwise (b only for binary ops; alpha for SCALE)."""
    label = name or op.name.lower()
    if (op in BINARY) != (b is not None):
        raise ValueError(f"{label}: {op.name} takes {'two inputs' if op in BINARY else 'one input'}")
    bb = _broadcast(label, a, b) if b is not None else None
    check_same_shape(label, a=a, y=y)
    check_alias(label, y, a, *((bb,) if bb is not None else ()))
    g.add(Eltwise(op, a, bb, y, alpha, label))


def add(g: "Graph", a: Rows, b: Rows, y: Rows, name: str = "add") -> None:
    """y = a + b (b may be one row broadcast over a's rows)."""
    eltwise(g, Op.ADD, a, b, y, name=name)


def mul(g: "Graph", a: Rows, b: Rows, y: Rows, name: str = "mul") -> None:
    """y = a ⊙ b (b may be one row broadcast over a's rows, e.g. a gain w[i])."""
    eltwise(g, Op.MUL, a, b, y, name=name)


def scale(g: "Graph", a: Rows, alpha: float, y: Rows, name: str = "scale") -> None:
    """y = alpha·a."""
    eltwise(g, Op.SCALE, a, None, y, alpha, name=name)


def silu(g: "Graph", a: Rows, y: Rows, name: str = "silu") -> None:
    """y = a·σ(a)."""
    eltwise(g, Op.SILU, a, None, y, name=name)


def sigmoid(g: "Graph", a: Rows, y: Rows, name: str = "sigmoid") -> None:
    """y = 1/(1 + e^{−a})."""
    eltwise(g, Op.SIGMOID, a, None, y, name=name)


def softplus(g: "Graph", a: Rows, y: Rows, name: str = "softplus") -> None:
    """y = ln(1 + e^a), or a when a > 20."""
    eltwise(g, Op.SOFTPLUS, a, None, y, name=name)
