"""A chain of dependent in-place dispatches and its NumPy result, for the graph-runner tests."""

from __future__ import annotations

import numpy as np

from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.views import Rows


def chain(g, p: Rows, q: Rows, alphas: np.ndarray) -> None:
    """Step k: P ← Q + α_k·P (k even) or Q ← P + α_k·Q (k odd), each in place on its output.

    Every step reads the previous step's output, so each needs a barrier; α_k are powers of two,
    so α·x is exact and each step is one rounding whether fused or not: NumPy in f32 is exact.
    """
    for k, a in enumerate(alphas):
        src, dst = (q, p) if k % 2 == 0 else (p, q)
        E.add_scaled(g, src, dst, float(a), dst, name=f"chain.{k}")


def chain_ref(p: np.ndarray, q: np.ndarray, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chain in f32 NumPy."""
    p, q = p.copy(), q.copy()
    for k, a in enumerate(alphas):
        if k % 2 == 0:
            p = q + a * p
        else:
            q = p + a * q
    return p, q
