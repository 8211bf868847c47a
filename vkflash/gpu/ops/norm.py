"""Row norms (MODEL.md §2, §5.4 G6): RMSNorm, grouped RMSNorm of wide HC rows, and L2 norm.

One shader (shaders/norm.comp), one workgroup per normalised group with a subgroup +
shared-memory reduction of Σx². ε is passed as f32 bits; all statistics are f32 (§7.4). The
fusion pass (gpu/fuse.py) folds a following RoPE, a preceding HC combine and the HC inject
projection into the same dispatch (`Norm`'s optional parts).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from vkflash.gpu.graph import Node
from vkflash.gpu.interface import PushConstants, SpecConstants, boolean, f32, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.rope import check_neox
from vkflash.gpu.ops.views import F32, Rows, check_alias, check_same_shape, grid
from vkflash.gpu.registry import Kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class NormPush(PushConstants):
    """norm.comp's push constants (element offsets and strides; see the shader's header)."""

    n: u32
    n_groups: u32
    n_rows: u32
    x_off: u32
    x_stride: u32
    y_off: u32
    y_stride: u32
    gamma_off: u32
    eps: f32
    post: f32
    iota_off: u32
    iota_stride: u32
    b_off: u32
    b_stride: u32
    n_heads: u32
    n_rot: u32
    pos_off: u32
    theta: f32
    w_inj_off: u32
    iota_out_off: u32
    iota_out_stride: u32
    inv_groups: f32


@dataclass(frozen=True)
class NormSpec(SpecConstants):
    """norm.comp's variant: the statistic (Mode) and which fused parts run."""

    mode: u32
    has_gamma: boolean
    combine: boolean
    rope: boolean
    inject: boolean


KERNELS = [Kernel("norm", "norm.comp", 9, push=NormPush, spec=NormSpec)]
MAX_DH = 512  # norm.comp ROPE: longest head row
MAX_HC = 8  # norm.comp INJECT: most groups (hyper-connection streams)
MAX_GROUPS = 65535  # one workgroup per group; more groups loop


class Mode(IntEnum):
    """Statistic of norm.comp (constant_id 1): mean or sum of squares."""

    RMS = 0
    L2 = 1


@dataclass(frozen=True)
class Rope:
    """NeoX RoPE applied after a row norm (rope.rope_neox's parameters)."""

    n_heads: int
    n_rot: int
    theta: float
    pos: Buffer
    pos_off: int = 0


@dataclass(frozen=True)
class Norm(Node):
    """Normalise each of the `groups` equal groups of every row of x into y (after the HC combine
    x_c += 2σ(ι_c/groups)·b in place when `combine` = (ι, b); then RoPE'd by `rope`; with inject =
    (W_inj, ι_out), also ι_out = y W_injᵀ per row). The combine, RoPE and inject parts come from
    the fusion pass; `taps` name the values of ops it fused away."""

    mode: Mode
    x: Rows
    y: Rows
    eps: float
    groups: int
    gamma: Buffer | None
    gamma_off: int
    post: float
    name: str
    combine: tuple[Rows, Rows] | None = None
    rope: Rope | None = None
    inject: tuple[Rows, Rows] | None = None
    taps: tuple[tuple[str, Rows], ...] = ()

    def __post_init__(self) -> None:
        x, y, name, n_groups = self.x, self.y, self.name, self.groups
        check_same_shape(name, x=x, y=y)
        check_alias(name, y, x)
        if self.inject is not None:
            w_inj, i_out = self.inject
            if self.rope is not None or not 1 <= n_groups <= MAX_HC:
                raise ValueError(f"{name}: the inject projection needs 1..{MAX_HC} groups and no RoPE")
            if (w_inj.n_rows, w_inj.n_cols, w_inj.stride) != (n_groups, x.n_cols, x.n_cols):
                raise ValueError(f"{name}: W_inj must be {n_groups} dense rows of {x.n_cols}")
            if (i_out.n_rows, i_out.n_cols) != (x.n_rows, n_groups) or i_out.overlaps(x) or i_out.overlaps(y):
                raise ValueError(f"{name}: ι out must be {x.n_rows}x{n_groups}, apart from x and y")
        if self.rope is not None:
            r = self.rope
            check_neox(name, x, r.n_heads, r.n_rot, r.theta, r.pos, r.pos_off)
            if n_groups != 1 or self.combine is not None or x.n_cols > MAX_DH:
                raise ValueError(f"{name}: norm+RoPE takes plain rows of at most {MAX_DH} (got {x.n_cols})")
        if self.combine is not None:
            iota, b = self.combine
            if (iota.n_rows, iota.n_cols) != (x.n_rows, n_groups) or (b.n_rows, b.n_cols) != (x.n_rows, x.n_cols // n_groups):
                raise ValueError(f"{name}: ι must be {x.n_rows}x{n_groups} and b {x.n_rows}x{x.n_cols // n_groups}")
            if x.overlaps(y) or iota.overlaps(x) or b.overlaps(x):
                raise ValueError(f"{name}: the combined residual must not overlap y, ι or b")
        if n_groups < 1 or x.n_cols % n_groups:
            raise ValueError(f"{name}: row of {x.n_cols} does not split into {n_groups} groups")
        if not self.eps >= 0:
            raise ValueError(f"{name}: eps must be ≥ 0, got {self.eps}")
        if self.gamma is not None:
            Rows(self.gamma, 1, x.n_cols, self.gamma_off)  # bounds check: gamma spans the whole row

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        out: list[Rows | Buffer] = [self.x]
        if self.gamma is not None:
            out.append(Rows(self.gamma, 1, self.x.n_cols, self.gamma_off))
        if self.combine is not None:
            out += list(self.combine)
        if self.rope is not None:
            out.append(self.rope.pos)
        if self.inject is not None:
            out.append(self.inject[0])
        return tuple(out)

    def outputs(self) -> tuple[Rows, ...]:
        return ((self.y,) + ((self.x,) if self.combine is not None else ())
                + ((self.inject[1],) if self.inject is not None else ()))

    def named(self) -> tuple[tuple[str, Rows], ...]:
        return self.taps or ((self.name, self.y),)

    def lower(self, g: "Graph") -> None:
        x, y, n_groups, rope = self.x, self.y, self.groups, self.rope
        iota, b = self.combine if self.combine is not None else (x, x)
        w_inj, i_out = self.inject if self.inject is not None else (x, x)
        gamma = self.gamma
        n = x.n_cols // n_groups
        writes = [2] + [0] * (self.combine is not None) + [7, 8] * (self.inject is not None)
        part = x.buf
        if self.inject is not None:  # per row: a finished-groups counter, then the groups' partial ι sums
            part = g.own(4 * x.n_rows * (1 + n_groups * n_groups), f"{self.name}.inject_partials")
        g.dispatch("norm", [x.buf, gamma if gamma is not None else x.buf, y.buf, iota.buf, b.buf,
                            rope.pos if rope is not None else x.buf, w_inj.buf, i_out.buf, part],
                   [grid(x.n_rows * n_groups, 1, MAX_GROUPS)],
                   push=NormPush(n, n_groups, x.n_rows, x.off, x.stride, y.off, y.stride, self.gamma_off, self.eps,
                                 self.post, iota.off, iota.stride, b.off, b.stride,
                                 *((rope.n_heads, rope.n_rot, rope.pos_off, rope.theta) if rope else (1, 2, 0, 0.0)),
                                 w_inj.off, i_out.off, i_out.stride, 1.0 / n_groups),
                   spec=NormSpec(self.mode, gamma is not None, self.combine is not None, rope is not None,
                                 self.inject is not None),
                   writes=sorted(writes), name=self.name,
                   desc=f"{self.mode.name} {x.n_rows}x{n_groups}x{n}{' +combine' if self.combine else ''}",
                   nbytes=F32 * (x.size * ((3 if gamma is not None else 2) + 2 * (self.combine is not None))
                                 + (b.size if self.combine is not None else 0)
                                 + (w_inj.size if self.inject is not None else 0)))


def rms_norm(g: "Graph", x: Rows, y: Rows, eps: float, gamma: Buffer | None = None, gamma_off: int = 0,
             name: str = "rms_norm") -> None:
    """y = x/√(mean(x²)+ε) ⊙ γ per row (γ of n_cols elements at gamma_off, optional)."""
    g.add(Norm(Mode.RMS, x, y, eps, 1, gamma, gamma_off, 1.0, name))


def grouped_rms_norm(g: "Graph", x: Rows, y: Rows, n_groups: int, eps: float, gamma: Buffer | None = None,
                     name: str = "grouped_rms_norm") -> None:
    """Each row of hc·d values is hc = n_groups streams of d, each RMS-normalised; then ⊙ γ ∈ R^{hc·d}
    (HC H1, PLE P6/P9)."""
    g.add(Norm(Mode.RMS, x, y, eps, n_groups, gamma, 0, 1.0, name))


def l2_norm(g: "Graph", x: Rows, y: Rows, eps: float, scale: float = 1.0, name: str = "l2_norm") -> None:
    """y = scale · x/√(Σx²+ε) per row (GDN q̂, k̂ of §5.4 G6; scale = 1/√S folds q̂'s extra factor)."""
    g.add(Norm(Mode.L2, x, y, eps, 1, None, 0, scale, name))
