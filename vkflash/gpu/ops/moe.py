"""MoE router on the GPU (MODEL.md §5.7 M1–M3): softmax over all E experts, top-k, renormalised weights.

One workgroup per token (shaders/moe_router.comp). The logits z = W_r u come from the matmul op;
this op turns them into expert ids (int32, T × k, descending probability, ties to the lower index)
and weights w_i = p_{I_i} / max(Σ p_I, 2⁻¹⁴) (f32, T × k) for the expert matmuls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vkflash.gpu.ops.views import F32, Rows, grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph

KERNELS = [Kernel("moe_router", "moe_router.comp", 3)]
MAX_GROUPS = 65535  # one workgroup per token; more tokens loop


def moe_router(g: "Graph", z: Rows, ids: Rows, w: Rows, k: int, name: str = "moe_router") -> None:
    """ids, w = top-k of softmax(z) per row of z (T × E); ids and w are T × k (ids as int32)."""
    T, E = z.n_rows, z.n_cols
    if not 1 <= k <= E:
        raise ValueError(f"{name}: k = {k} must be between 1 and the expert count {E}")
    for label, v in (("ids", ids), ("w", w)):
        if (v.n_rows, v.n_cols) != (T, k):
            raise ValueError(f"{name}: {label} is {v.n_rows}x{v.n_cols}, expected {T}x{k}")
        if v.overlaps(z):
            raise ValueError(f"{name}: {label} overlaps the logits z")
    if ids.overlaps(w):
        raise ValueError(f"{name}: ids and w overlap")
    caps = g.gpu.caps
    wg = kernel("moe_router").workgroup(caps)
    shared = F32 * (E + 2 * wg)  # probabilities + the reduction slots of common/reduce.glsl
    if shared > caps.shared_memory:
        raise ValueError(f"{name}: {E} experts need {shared} B of shared memory, the device has {caps.shared_memory}")
    g.dispatch("moe_router", [z.buf, ids.buf, w.buf], [grid(T, 1, MAX_GROUPS)],
               push=[E, k, T, z.off, z.stride, ids.off, ids.stride, w.off, w.stride],
               spec=[E], writes=[1, 2], name=name, desc=f"T={T} E={E} k={k}",
               nbytes=F32 * T * (E + 2 * k))
