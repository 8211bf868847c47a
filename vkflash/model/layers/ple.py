"""PLE device part (MODEL.md §5.3 P4–P10): gathered n-gram rows, per-stream gate, dilated conv."""

from __future__ import annotations

import math
import numpy as np

from vkflash.model.hparams import HParams
from vkflash.model.layers.common import RefOptions, emit, sigmoid, silu
from vkflash.model.layers.norms import grouped_rms_norm
from vkflash.model.weights import PLEW

GATE_CLAMP = 1e-6


def ple_conv_history(hp: HParams) -> int:
    """Lh = (K_p−1)·N rows of normalised Ṽ kept in the PLE conv state."""
    return (hp.K_p - 1) * hp.N


def ple(R: np.ndarray, rows: np.ndarray, w: PLEW, hp: HParams, conv_state: np.ndarray,
        opts: RefOptions, i: int) -> tuple[np.ndarray, np.ndarray]:
    """R ← R + V + y for R (T, hc, d) and int rows (T, n_p); returns (R, new conv state)."""
    T, hc, d = R.shape
    e = w.table(rows.reshape(-1)).reshape(T, hp.n_p * hp.D_p)  # (P4) head index slowest
    kp = e @ w.wk.T  # (P5)
    vp = e @ w.wv.T
    Kt = grouped_rms_norm(kp.reshape(T, hc, d), w.norm_key, hp.eps)  # (P6)
    Qt = grouped_rms_norm(R, w.norm_query, hp.eps)
    s = np.sum(Kt * Qt, axis=-1) / math.sqrt(d)  # (P7)
    lam = sigmoid(np.sign(s) * np.sqrt(np.maximum(np.abs(s), GATE_CLAMP)))  # (P8)
    V = lam[:, :, None] * vp[:, None, :]
    Vt = grouped_rms_norm(V, w.norm_conv, hp.eps).reshape(T, hc * d)  # (P9)
    X = np.concatenate([conv_state, Vt])
    Lh = len(conv_state)
    acc = np.zeros_like(Vt)
    for k in range(hp.K_p):
        shift = (hp.K_p - 1 - k) * hp.N
        acc += w.conv[:, k] * X[Lh - shift: Lh - shift + T]
    y = silu(acc).reshape(T, hc, d)
    emit(opts, i, "ple_gate", lam)
    emit(opts, i, "ple_conv", y)
    return R + (V + y), X[len(X) - Lh:].copy()  # (P10)
