"""Row norms (MODEL.md §2, §5.4 G6): RMSNorm, grouped RMSNorm of wide HC rows, and L2 norm.

One shader (shaders/norm.comp), one workgroup per normalised group with a subgroup +
shared-memory reduction of Σx². ε is passed as f32 bits; all statistics are f32 (§7.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np

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


def _norm(g: "Graph", mode: Mode, x: Rows, y: Rows, eps: float, n_groups: int, gamma: Buffer | None,
          gamma_off: int, post: float, name: str, combine: tuple[Rows, Rows] | None = None,
          rope: Rope | None = None, inject: tuple[Rows, Rows] | None = None) -> None:
    """Normalise each of the n_groups equal groups of every row of x into y (after the HC
    combine x_c += 2σ(ι_c/n_groups)·b in place when `combine` = (ι, b); then RoPE'd by `rope`;
    with inject = (W_inj, ι_out), also ι_out = y W_injᵀ per row)."""
    check_same_shape(name, x=x, y=y)
    check_alias(name, y, x)
    iota, b = combine if combine is not None else (x, x)
    w_inj, i_out = inject if inject is not None else (x, x)
    if inject is not None:
        if rope is not None or not 1 <= n_groups <= MAX_HC:
            raise ValueError(f"{name}: the inject projection needs 1..{MAX_HC} groups and no RoPE")
        if (w_inj.n_rows, w_inj.n_cols, w_inj.stride) != (n_groups, x.n_cols, x.n_cols):
            raise ValueError(f"{name}: W_inj must be {n_groups} dense rows of {x.n_cols}")
        if (i_out.n_rows, i_out.n_cols) != (x.n_rows, n_groups) or i_out.overlaps(x) or i_out.overlaps(y):
            raise ValueError(f"{name}: ι out must be {x.n_rows}x{n_groups}, apart from x and y")
    if rope is not None:
        check_neox(name, x, rope.n_heads, rope.n_rot, rope.theta, rope.pos, rope.pos_off)
        if n_groups != 1 or combine is not None or x.n_cols > MAX_DH:
            raise ValueError(f"{name}: norm+RoPE takes plain rows of at most {MAX_DH} (got {x.n_cols})")
    if combine is not None:
        if (iota.n_rows, iota.n_cols) != (x.n_rows, n_groups) or (b.n_rows, b.n_cols) != (x.n_rows, x.n_cols // n_groups):
            raise ValueError(f"{name}: ι must be {x.n_rows}x{n_groups} and b {x.n_rows}x{x.n_cols // n_groups}")
        if x.overlaps(y) or iota.overlaps(x) or b.overlaps(x):
            raise ValueError(f"{name}: the combined residual must not overlap y, ι or b")
    if n_groups < 1 or x.n_cols % n_groups:
        raise ValueError(f"{name}: row of {x.n_cols} does not split into {n_groups} groups")
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be ≥ 0, got {eps}")
    if gamma is not None:
        Rows(gamma, 1, x.n_cols, gamma_off)  # bounds check: gamma spans the whole row
    n = x.n_cols // n_groups
    total = x.n_rows * n_groups
    writes = [2] + [0] * (combine is not None) + [7, 8] * (inject is not None)
    part = x.buf
    if inject is not None:  # per row: a finished-groups counter, then the groups' partial ι sums
        part = g.gpu.buffer(4 * x.n_rows * (1 + n_groups * n_groups), f"{name}.inject_partials")
        part.fill(0, np.uint32)
    g.dispatch("norm", [x.buf, gamma if gamma is not None else x.buf, y.buf, iota.buf, b.buf,
                        rope.pos if rope is not None else x.buf, w_inj.buf, i_out.buf, part],
               [grid(total, 1, MAX_GROUPS)],
               push=NormPush(n, n_groups, x.n_rows, x.off, x.stride, y.off, y.stride, gamma_off, eps, post,
                             iota.off, iota.stride, b.off, b.stride, *((rope.n_heads, rope.n_rot, rope.pos_off,
                                                                        rope.theta) if rope else (1, 2, 0, 0.0)),
                             w_inj.off, i_out.off, i_out.stride, 1.0 / n_groups),
               spec=NormSpec(mode, gamma is not None, combine is not None, rope is not None, inject is not None),
               writes=sorted(writes), name=name,
               desc=f"{mode.name} {x.n_rows}x{n_groups}x{n}{' +combine' if combine else ''}",
               nbytes=F32 * (x.size * ((3 if gamma is not None else 2) + 2 * (combine is not None))
                             + (b.size if combine is not None else 0) + (w_inj.size if inject is not None else 0)))


def rms_norm(g: "Graph", x: Rows, y: Rows, eps: float, gamma: Buffer | None = None, gamma_off: int = 0,
             name: str = "rms_norm", rope: Rope | None = None) -> None:
    """y = x/√(mean(x²)+ε) ⊙ γ per row (γ of n_cols elements at gamma_off, optional); with `rope`,
    then NeoX RoPE of each head row in the same dispatch (attention q/k: A2 + A3)."""
    _norm(g, Mode.RMS, x, y, eps, 1, gamma, gamma_off, 1.0, name, rope=rope)


def grouped_rms_norm(g: "Graph", x: Rows, y: Rows, n_groups: int, eps: float, gamma: Buffer | None = None,
                     gamma_off: int = 0, name: str = "grouped_rms_norm",
                     combine: tuple[Rows, Rows] | None = None, inject: tuple[Rows, Rows] | None = None) -> None:
    """Each row of hc·d values is hc = n_groups streams of d, each RMS-normalised; then ⊙ γ ∈ R^{hc·d}.
    With combine = (ι, b), first x_c += 2σ(ι_c/hc)·b in place (HC H6; x is then the residual R);
    with inject = (W_inj f32 hc × hc·d, ι_out), also ι_out = y W_injᵀ (HC H5; summed from each group's
    workgroup by the row's last one)."""
    _norm(g, Mode.RMS, x, y, eps, n_groups, gamma, gamma_off, 1.0, name, combine, inject=inject)


def l2_norm(g: "Graph", x: Rows, y: Rows, eps: float, scale: float = 1.0, name: str = "l2_norm") -> None:
    """y = scale · x/√(Σx²+ε) per row (GDN q̂, k̂ of §5.4 G6; scale = 1/√S folds q̂'s extra factor)."""
    _norm(g, Mode.L2, x, y, eps, 1, None, 0, scale, name)
