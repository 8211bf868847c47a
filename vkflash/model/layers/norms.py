"""RMSNorm variants of MODEL.md §2/§7: plain, folded gain, grouped per HC stream, and the GDN L2 norm."""

from __future__ import annotations

import numpy as np


def rms(x: np.ndarray, eps: float) -> np.ndarray:
    """rms(x) = x/√(mean(x²)+ε) over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """rms(x) ⊙ γ with a folded gain (never add 1)."""
    return rms(x, eps) * gain


def grouped_rms_norm(R: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """Grouped RMSNorm of wide vectors R (..., hc, d): rms per stream over d, then ⊙ γ (hc·d)."""
    return rms(R, eps) * gamma.reshape(R.shape[-2:])


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """(G6) x/√(Σx²+ε) over the last axis."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)
