"""A chain of dependent in-place dispatches and its NumPy result, for the graph-runner tests."""

from __future__ import annotations

import numpy as np

from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.views import Rows


def chain(g, p: Rows, q: Rows, alphas: np.ndarray) -> None:
    """Step k: P ← Q + P (k even) or Q ← α_k·Q (k odd), each one dispatch in place on its output.

    Every step depends on the previous one (an even step reads the Q it wrote, an odd step
    overwrites the Q it read), so each needs a barrier; α_k are powers of two, so α·x is exact and
    each add is one rounding: NumPy in f32 is exact.
    """
    for k, a in enumerate(alphas):
        if k % 2 == 0:
            E.add(g, q, p, p, name=f"chain.{k}")
        else:
            E.scale(g, q, float(a), q, name=f"chain.{k}")


def chain_ref(p: np.ndarray, q: np.ndarray, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chain in f32 NumPy."""
    p, q = p.copy(), q.copy()
    for k, a in enumerate(alphas):
        if k % 2 == 0:
            p = q + p
        else:
            q = a * q
    return p, q
