"""Buffer copy by compute shader (word granularity, arbitrary offsets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkflash.gpu.interface import PushConstants, SpecConstants, u32
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph
    from vkflash.gpu.memory import Buffer


@dataclass(frozen=True)
class CopyPush(PushConstants):
    """copy.comp's push constants: word offsets, word count, and whether both offsets allow uvec4 moves."""

    src_off: u32
    dst_off: u32
    n: u32
    wide: u32


KERNELS = [Kernel("copy", "copy.comp", 2, local_size=256, push=CopyPush, spec=SpecConstants)]
MAX_GROUPS = 4096  # grid-stride loop covers the rest


def copy_words(g: "Graph", src: "Buffer", src_off: int, dst: "Buffer", dst_off: int, n: int, name: str = "copy") -> None:
    """dst[dst_off:dst_off+n] = src[src_off:src_off+n], in 32-bit words."""
    if src_off + n > src.words or dst_off + n > dst.words:
        raise ValueError(f"copy of {n} words out of range ({src.words}, {dst.words})")
    vec4 = src_off % 4 == 0 and dst_off % 4 == 0
    wg = kernel("copy").workgroup(g.gpu.caps)
    groups = max(1, min(MAX_GROUPS, -(-(n // 4 if vec4 else n) // wg)))
    g.dispatch("copy", [src, dst], [groups], push=CopyPush(src_off, dst_off, n, vec4), name=name,
               desc=f"{n * 4} B", nbytes=8 * n)
