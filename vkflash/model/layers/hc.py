"""Hyper-connection mix, combine and head mixer (MODEL.md §5.2 H1–H6)."""

from __future__ import annotations

import numpy as np

from vkflash.model.layers.common import sigmoid, silu
from vkflash.model.layers.norms import grouped_rms_norm
from vkflash.model.weights import HCMixW


def hc_mix(R: np.ndarray, w: HCMixW, eps: float) -> tuple[np.ndarray, np.ndarray | None]:
    """(H1)–(H5) for R (T, hc, d): u (T, d) and ι (T, hc), ι None for a head mixer."""
    T, hc, d = R.shape
    X = grouped_rms_norm(R, w.norm, eps).reshape(T, hc * d)  # (H1)
    ell = silu((X @ w.down.T) / hc)  # (H2) 1/hc before the silu
    g = sigmoid(ell @ w.up.T)  # (H3)
    gX = (g * X).reshape(T, hc, d)
    u = gX[:, 0].copy()
    for c in range(1, hc):  # (H4) streams summed in order, then scaled
        u += gX[:, c]
    u /= hc
    iota = None if w.inject is None else X @ w.inject.T  # (H5)
    return u, iota


def hc_combine(R: np.ndarray, b: np.ndarray, iota: np.ndarray) -> np.ndarray:
    """(H6) R_c + 2σ(ι_c/hc)·b per stream, on the un-normalised R."""
    hc = R.shape[1]
    return R + 2 * sigmoid(iota / hc)[:, :, None] * b[:, None, :]
