"""NeoX partial RoPE (A3); qwen4exp's IMRoPE equals it for text (all four positions = p)."""

from __future__ import annotations

import numpy as np


def rope_neox(x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float) -> np.ndarray:
    """Rotate pairs (i, i+n_rot/2) of x (T, heads, D) by φ_i = p_t·θ^{−2i/n_rot}; dims ≥ n_rot pass."""
    half = n_rot // 2
    i = np.arange(half, dtype=x.dtype)
    phi = np.asarray(pos, dtype=x.dtype)[:, None] * theta ** (-2.0 * i / n_rot)[None, :]
    cos, sin = np.cos(phi)[:, None, :], np.sin(phi)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:n_rot]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:n_rot] = x2 * cos + x1 * sin
    return out
