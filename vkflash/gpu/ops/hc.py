"""Hyper-connection elementwise tails (MODEL.md §5.2 H2, H3+H4, H6) around the HC matmuls, and
the stream copies of H0.

Fused (default): one dispatch each of shaders/hc.comp. VKFLASH_HC_FUSE=0 (or
VKFLASH_DISABLE_FUSION=1) selects the plain path of eltwise ops, same op order, for A/B tests;
the plain path works in place on its scratch inputs (g_pre, ι), which the fused path leaves alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from vkflash import settings
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


def fuse_hc() -> bool:
    """Whether the HC tails run fused (VKFLASH_HC_FUSE, VKFLASH_DISABLE_FUSION)."""
    s = settings.current()
    return bool(s["VKFLASH_HC_FUSE"]) and not s["VKFLASH_DISABLE_FUSION"]


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


def hc_pre(g: "Graph", ell_pre: Rows, ell: Rows, hc: int, fuse: bool | None = None, name: str = "hc_pre") -> None:
    """(H2) ℓ = silu(ℓ_pre / hc) for ℓ_pre = W_dn X (T × lr); ℓ may be ℓ_pre's exact view."""
    lr = ell_pre.n_cols
    _check(name, hc, ell_pre=(ell_pre, lr), ell=(ell, lr))
    check_alias(name, ell, ell_pre)
    if fuse_hc() if fuse is None else fuse:
        _dispatch(g, Mode.PRE, ell_pre, ell_pre, ell, lr, hc, name, 2 * F32 * ell.size)
        return
    E.scale(g, ell_pre, 1.0 / hc, ell, name=f"{name}.scale")
    E.silu(g, ell, ell, name=f"{name}.silu")


def hc_mix(g: "Graph", g_pre: Rows, X: Rows, u: Rows, hc: int, fuse: bool | None = None,
           name: str = "hc_mix") -> None:
    """(H3+H4) u = (1/hc)·Σ_c σ(g_pre_c) ⊙ X_c: g_pre = W_up ℓ and X are T × hc·d, u is T × d.

    The plain path overwrites g_pre with σ(g_pre) ⊙ X.
    """
    d = u.n_cols
    _check(name, hc, g_pre=(g_pre, hc * d), X=(X, hc * d), u=(u, d))
    check_alias(name, u, g_pre, X)
    if fuse_hc() if fuse is None else fuse:
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


def hc_combine(g: "Graph", R: Rows, b: Rows, iota: Rows, fuse: bool | None = None, name: str = "hc_combine") -> None:
    """(H6) R_c ← R_c + 2σ(ι_c/hc)·b in place: R is T × hc·d (un-normalised), b T × d, ι T × hc.

    The plain path overwrites ι with the gates 2σ(ι/hc).
    """
    hc, d = iota.n_cols, b.n_cols
    _check(name, hc, R=(R, hc * d), b=(b, d), iota=(iota, hc))
    for x in (b, iota):
        if x.overlaps(R):
            raise ValueError(f"{name}: an input overlaps the residual R it updates")
    nbytes = (2 * hc + 1) * F32 * b.size
    if fuse_hc() if fuse is None else fuse:
        _dispatch(g, Mode.COMBINE, iota, b, R, d, hc, name, nbytes)
        return
    E.scale(g, iota, 1.0 / hc, iota, name=f"{name}.scale")
    E.sigmoid(g, iota, iota, name=f"{name}.sigmoid")
    E.scale(g, iota, 2.0, iota, name=f"{name}.double")
    _dispatch(g, Mode.ROW_AXPY, iota, b, R, d, hc, f"{name}.axpy", nbytes)


def hc_broadcast(g: "Graph", x: Rows, R: Rows, hc: int, fuse: bool | None = None, name: str = "hc_copy") -> None:
    """(H0) R = [x; …; x]: each of the hc streams of R (T × hc·d) a copy of x (T × d); the plain
    path copies stream by stream (dispatches `name.c`)."""
    d = x.n_cols
    _check(name, hc, x=(x, d), R=(R, hc * d))
    if R.overlaps(x):
        raise ValueError(f"{name}: R overlaps x")
    if fuse_hc() if fuse is None else fuse:
        _dispatch(g, Mode.BROADCAST, x, x, R, d, hc, name, (hc + 1) * F32 * x.size)
        return
    for c in range(hc):
        E.scale(g, x, 1.0, Rows(R.buf, R.n_rows, d, R.off + c * d, R.stride), name=f"{name}.{c}")
