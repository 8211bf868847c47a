"""Hyper-connection elementwise tails (MODEL.md §5.2 H2, H3+H4, H6) around the HC matmuls, and
the stream copies of H0.

Each is a node lowered to one dispatch of shaders/hc.comp, or, with the options' hc_tails off
(VKFLASH_HC_FUSE=0, VKFLASH_DISABLE_FUSION=1), to the plain path of eltwise ops in the same op
order, for A/B tests; the plain path works in place on its inputs (g_pre, ι), which the one-dispatch
path leaves alone (the nodes declare them written either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from vkflash.gpu.graph import Node
from vkflash.gpu.interface import PushConstants, SpecConstants, f32, u32
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.views import F32, Rows, check_alias, grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class HcPush(PushConstants):
    """hc.comp's push constants: the output shape, hc, each view's offset and row stride, 1/hc."""

    n: u32
    n_rows: u32
    hc: u32
    a_off: u32
    a_stride: u32
    b_off: u32
    b_stride: u32
    y_off: u32
    y_stride: u32
    inv_hc: f32


@dataclass(frozen=True)
class HcSpec(SpecConstants):
    """hc.comp's mode (Mode)."""

    mode: u32


KERNELS = [Kernel("hc", "hc.comp", 3, push=HcPush, spec=HcSpec)]
MAX_GROUPS = 4096  # grid-stride loop covers the rest


class Mode(IntEnum):
    """Modes of hc.comp (constant_id 1)."""

    PRE = 0
    MIX = 1
    COMBINE = 2
    ROW_AXPY = 3
    BROADCAST = 4


def _dispatch(g: "Graph", mode: Mode, a: Rows, b: Rows, y: Rows, n: int, hc: int, name: str, nbytes: int) -> None:
    """One hc.comp dispatch over y's n_rows × n output elements."""
    wg = kernel("hc").workgroup(g.gpu.caps)
    g.dispatch("hc", [a.buf, b.buf, y.buf], [grid(n * y.n_rows, wg, MAX_GROUPS)],
               push=HcPush(n, y.n_rows, hc, a.off, a.stride, b.off, b.stride, y.off, y.stride, 1.0 / hc),
               spec=HcSpec(mode), name=name, desc=f"{mode.name} T={y.n_rows} n={n} hc={hc}", nbytes=nbytes)


def _check(op: str, hc: int, **shapes: tuple[Rows, int]) -> int:
    """Every view has the same rows and its expected row length; returns T."""
    if hc < 1:
        raise ValueError(f"{op}: hc must be ≥ 1, got {hc}")
    rows = {v.n_rows for v, _ in shapes.values()}
    if len(rows) > 1:
        raise ValueError(f"{op}: token counts differ: " + ", ".join(f"{k} {v.n_rows}" for k, (v, _) in shapes.items()))
    for k, (v, cols) in shapes.items():
        if v.n_cols != cols:
            raise ValueError(f"{op}: {k} rows have {v.n_cols} elements, expected {cols}")
    return rows.pop()


@dataclass(frozen=True)
class HcPre(Node):
    """(H2) ℓ = silu(ℓ_pre / hc)."""

    ell_pre: Rows
    ell: Rows
    hc: int
    name: str

    def inputs(self) -> tuple[Rows, ...]:
        return (self.ell_pre,)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.ell,)

    def lower(self, g: "Graph") -> None:
        if g.options.hc_tails:
            _dispatch(g, Mode.PRE, self.ell_pre, self.ell_pre, self.ell, self.ell.n_cols, self.hc, self.name,
                      2 * F32 * self.ell.size)
            return
        E.scale(g, self.ell_pre, 1.0 / self.hc, self.ell, name=f"{self.name}.scale")
        E.silu(g, self.ell, self.ell, name=f"{self.name}.silu")


def hc_pre(g: "Graph", ell_pre: Rows, ell: Rows, hc: int, name: str = "hc_pre") -> None:
    """(H2) ℓ = silu(ℓ_pre / hc) for ℓ_pre = W_dn X (T × lr); ℓ may be ℓ_pre's exact view."""
    lr = ell_pre.n_cols
    _check(name, hc, ell_pre=(ell_pre, lr), ell=(ell, lr))
    check_alias(name, ell, ell_pre)
    g.add(HcPre(ell_pre, ell, hc, name))


@dataclass(frozen=True)
class HcMix(Node):
    """(H3+H4) u = (1/hc)·Σ_c σ(g_pre_c) ⊙ X_c."""

    g_pre: Rows
    X: Rows
    u: Rows
    hc: int
    name: str

    def inputs(self) -> tuple[Rows, ...]:
        return (self.g_pre, self.X)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.u, self.g_pre)

    def lower(self, g: "Graph") -> None:
        g_pre, X, u, hc, name = self.g_pre, self.X, self.u, self.hc, self.name
        d = u.n_cols
        if g.options.hc_tails:
            _dispatch(g, Mode.MIX, g_pre, X, u, d, hc, name, (2 * hc + 1) * F32 * u.size)
            return
        E.sigmoid(g, g_pre, g_pre, name=f"{name}.sigmoid")
        E.mul(g, g_pre, X, g_pre, name=f"{name}.gate")
        T, s = g_pre.n_rows, g_pre.stride
        streams = [Rows(g_pre.buf, T, d, g_pre.off + c * d, s) for c in range(hc)]
        if hc == 1:
            E.scale(g, streams[0], 1.0, u, name=f"{name}.mean")
            return
        E.add(g, streams[0], streams[1], u, name=f"{name}.sum")
        for c in range(2, hc):  # streams summed in order, then scaled
            E.add(g, u, streams[c], u, name=f"{name}.sum")
        E.scale(g, u, 1.0 / hc, u, name=f"{name}.mean")


def hc_mix(g: "Graph", g_pre: Rows, X: Rows, u: Rows, hc: int, name: str = "hc_mix") -> None:
    """(H3+H4) u = (1/hc)·Σ_c σ(g_pre_c) ⊙ X_c: g_pre = W_up ℓ and X are T × hc·d, u is T × d
    (g_pre may be overwritten)."""
    d = u.n_cols
    _check(name, hc, g_pre=(g_pre, hc * d), X=(X, hc * d), u=(u, d))
    check_alias(name, u, g_pre, X)
    g.add(HcMix(g_pre, X, u, hc, name))


@dataclass(frozen=True)
class HcCombine(Node):
    """(H6) R_c ← R_c + 2σ(ι_c/hc)·b in place."""

    R: Rows
    b: Rows
    iota: Rows
    name: str

    def inputs(self) -> tuple[Rows, ...]:
        return (self.R, self.b, self.iota)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.R, self.iota)

    def lower(self, g: "Graph") -> None:
        R, b, iota, name = self.R, self.b, self.iota, self.name
        hc, d = iota.n_cols, b.n_cols
        nbytes = (2 * hc + 1) * F32 * b.size
        if g.options.hc_tails:
            _dispatch(g, Mode.COMBINE, iota, b, R, d, hc, name, nbytes)
            return
        E.scale(g, iota, 1.0 / hc, iota, name=f"{name}.scale")
        E.sigmoid(g, iota, iota, name=f"{name}.sigmoid")
        E.scale(g, iota, 2.0, iota, name=f"{name}.double")
        _dispatch(g, Mode.ROW_AXPY, iota, b, R, d, hc, f"{name}.axpy", nbytes)


def hc_combine(g: "Graph", R: Rows, b: Rows, iota: Rows, name: str = "hc_combine") -> None:
    """(H6) R_c ← R_c + 2σ(ι_c/hc)·b in place: R is T × hc·d (un-normalised), b T × d, ι T × hc
    (ι may be overwritten)."""
    hc, d = iota.n_cols, b.n_cols
    _check(name, hc, R=(R, hc * d), b=(b, d), iota=(iota, hc))
    for x in (b, iota):
        if x.overlaps(R):
            raise ValueError(f"{name}: an input overlaps the residual R it updates")
    g.add(HcCombine(R, b, iota, name))


@dataclass(frozen=True)
class HcBroadcast(Node):
    """(H0) R = [x; …; x]."""

    x: Rows
    R: Rows
    hc: int
    name: str

    def inputs(self) -> tuple[Rows, ...]:
        return (self.x,)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.R,)

    def lower(self, g: "Graph") -> None:
        x, R, hc, name = self.x, self.R, self.hc, self.name
        d = x.n_cols
        if g.options.hc_tails:
            _dispatch(g, Mode.BROADCAST, x, x, R, d, hc, name, (hc + 1) * F32 * x.size)
            return
        for c in range(hc):
            E.scale(g, x, 1.0, Rows(R.buf, R.n_rows, d, R.off + c * d, R.stride), name=f"{name}.{c}")


def hc_broadcast(g: "Graph", x: Rows, R: Rows, hc: int, name: str = "hc_copy") -> None:
    """(H0) R = [x; …; x]: each of the hc streams of R (T × hc·d) a copy of x (T × d); the plain
    path copies stream by stream (dispatches `name.c`)."""
    d = x.n_cols
    _check(name, hc, x=(x, d), R=(R, hc * d))
    if R.overlaps(x):
        raise ValueError(f"{name}: R overlaps x")
    g.add(HcBroadcast(x, R, hc, name))
