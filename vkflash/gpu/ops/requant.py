"""Cache re-quantization to q8_0 (shaders/kv_requant.comp): the deep-context guard rewrites a live
f16 (or f32) K/V or indexer-key cache as q8_0, rounded exactly as kv_append rounds at write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkflash.gpu.interface import PushConstants, SpecConstants, u32
from vkflash.gpu.ops.attention import Cache, CacheType
from vkflash.gpu.ops.views import grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph



@dataclass(frozen=True)
class RequantPush(PushConstants):
    """kv_requant.comp's push constants: the 32-element blocks to rewrite."""

    n: u32


KERNELS = [Kernel(f"kv_requant_{t.value}", "kv_requant.comp", 2, defines=((f"SRC_{t.name}", 1),), local_size=64,
                  push=RequantPush, spec=SpecConstants) for t in (CacheType.F16, CacheType.F32)]
MAX_GROUPS = 4096  # grid-stride loop covers the rest


def requant_q8_0(g: "Graph", src: Cache, dst: Cache, n_pos: int, name: str = "kv_requant") -> None:
    """dst positions [0, n_pos) = q8_0 of src's (same heads and dim; src f16 or f32)."""
    if src.type not in (CacheType.F16, CacheType.F32) or dst.type is not CacheType.Q8_0:
        raise ValueError(f"{name}: re-quantizes f16/f32 into q8_0, not {src.type.value} into {dst.type.value}")
    if (src.n_heads, src.dim) != (dst.n_heads, dst.dim):
        raise ValueError(f"{name}: caches of {src.n_heads}x{src.dim} and {dst.n_heads}x{dst.dim} differ")
    if not 0 <= n_pos <= min(src.n_ctx, dst.n_ctx):
        raise ValueError(f"{name}: {n_pos} positions outside the caches' {min(src.n_ctx, dst.n_ctx)}")
    for c in (src, dst):
        need = Cache.nbytes(n_pos, c.n_heads, c.dim, c.type)
        if need > c.buf.committed:
            raise ValueError(f"{name}: {n_pos} positions need {need} B of {c.buf.name!r}, {c.buf.committed} B committed")
    n_blocks = n_pos * src.n_heads * src.dim // 32
    if n_blocks == 0:
        return
    kname = f"kv_requant_{src.type.value}"
    wg = kernel(kname).workgroup(g.gpu.caps)
    g.dispatch(kname, [src.buf, dst.buf], [grid(n_blocks, wg, MAX_GROUPS)], push=RequantPush(n_blocks), name=name,
               desc=f"{n_pos}x{src.n_heads}x{src.dim} {src.type.value}->q8_0",
               nbytes=n_blocks * (32 * (2 if src.type is CacheType.F16 else 4) + 34))
