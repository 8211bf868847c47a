"""NeoX partial RoPE (MODEL.md §5.5 A3, §7.7) over rows of head vectors, positions from a buffer.

IMRoPE for text equals NeoX (all four positions are p), so `imrope` only validates its sections
and calls `rope_neox`. Positions are int32, one per token, read by the shader: a recorded graph
replays with new positions without re-recording.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from vkflash.gpu.graph import Node
from vkflash.gpu.interface import PushConstants, SpecConstants, f32, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.views import F32, Rows, check_alias, check_same_shape, grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class RopePush(PushConstants):
    """rope.comp's push constants: head rows, x and y views, the positions' offset, θ."""

    n_rows: u32
    n_heads: u32
    dh: u32
    n_rot: u32
    x_off: u32
    x_stride: u32
    y_off: u32
    y_stride: u32
    pos_off: u32
    theta: f32


KERNELS = [Kernel("rope", "rope.comp", 3, push=RopePush, spec=SpecConstants)]
MAX_GROUPS = 4096  # grid-stride loop covers the rest


def check_neox(name: str, x: Rows, n_heads: int, n_rot: int, theta: float, pos: Buffer, pos_off: int) -> int:
    """Validate a NeoX RoPE over x's head rows (also used by the fused norm+RoPE); the token count."""
    dh = x.n_cols
    if n_heads < 1 or x.n_rows % n_heads:
        raise ValueError(f"{name}: {x.n_rows} rows are not whole tokens of {n_heads} heads")
    if n_rot < 2 or n_rot % 2 or n_rot > dh:
        raise ValueError(f"{name}: n_rot must be even and in 2..Dh={dh}, got {n_rot}")
    if not theta > 0:
        raise ValueError(f"{name}: rope base θ must be > 0, got {theta}")
    n_tokens = x.n_rows // n_heads
    if pos_off < 0 or 4 * (pos_off + n_tokens) > pos.nbytes:
        raise ValueError(f"{name}: {n_tokens} positions at {pos_off} overflow {pos.name or 'the positions'!r} "
                         f"of {pos.nbytes // 4}")
    return n_tokens


@dataclass(frozen=True)
class RopeNeox(Node):
    """y = NeoX RoPE of x's head rows (see rope_neox)."""

    x: Rows
    y: Rows
    n_heads: int
    n_rot: int
    theta: float
    pos: Buffer
    pos_off: int
    name: str

    def inputs(self) -> tuple[Rows | Buffer, ...]:
        return (self.x, self.pos)

    def outputs(self) -> tuple[Rows, ...]:
        return (self.y,)

    def lower(self, g: "Graph") -> None:
        x, y = self.x, self.y
        dh, n_rot = x.n_cols, self.n_rot
        wg = kernel("rope").workgroup(g.gpu.caps)
        items = x.n_rows * (n_rot // 2 + dh - n_rot)
        g.dispatch("rope", [self.pos, x.buf, y.buf], [grid(items, wg, MAX_GROUPS)],
                   push=RopePush(x.n_rows, self.n_heads, dh, n_rot, x.off, x.stride, y.off, y.stride, self.pos_off,
                                 self.theta),
                   name=self.name, desc=f"{x.n_rows // self.n_heads}x{self.n_heads}x{dh} rot {n_rot}",
                   nbytes=2 * F32 * x.size + 4 * (x.n_rows // self.n_heads))


def rope_neox(g: "Graph", x: Rows, y: Rows, n_heads: int, n_rot: int, theta: float, pos: Buffer,
              pos_off: int = 0, name: str = "rope") -> None:
    """Rotate the first n_rot dims of each head in NeoX pairs (i, i + n_rot/2) at φ_i = p·θ^{−2i/n_rot}.

    Row r of x is head r mod n_heads of token r // n_heads (Dh = x.n_cols); token t's position is
    pos[pos_off + t] (int32). Dims ≥ n_rot pass through. y may be x's exact view (in place).
    """
    check_same_shape(name, x=x, y=y)
    check_alias(name, y, x)
    check_neox(name, x, n_heads, n_rot, theta, pos, pos_off)
    g.add(RopeNeox(x, y, n_heads, n_rot, theta, pos, pos_off, name))


def check_sections(sections: Sequence[int], n_rot: int) -> tuple[int, int, int, int]:
    """IMRoPE `dimension_sections`: four non-negative pair counts, not all zero, summing to ≤ n_rot/2."""
    s = tuple(int(v) for v in sections)
    if len(s) != 4:
        raise ValueError(f"IMRoPE needs 4 sections, got {len(s)}")
    if min(s) < 0 or sum(s) == 0:
        raise ValueError(f"IMRoPE sections must be ≥ 0 and not all 0, got {list(s)}")
    if sum(s) > n_rot // 2:
        raise ValueError(f"IMRoPE sections {list(s)} cover {sum(s)} pairs, more than n_rot/2 = {n_rot // 2}")
    return s  # type: ignore[return-value]


def imrope(g: "Graph", x: Rows, y: Rows, n_heads: int, n_rot: int, theta: float, sections: Sequence[int],
           pos: Buffer, pos_off: int = 0, name: str = "imrope") -> None:
    """IMRoPE for text: every pair gets position p whatever its sector, i.e. NeoX partial RoPE."""
    check_sections(sections, n_rot)
    rope_neox(g, x, y, n_heads, n_rot, theta, pos, pos_off, name)
