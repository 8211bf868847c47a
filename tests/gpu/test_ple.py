"""PLE gate kernel (MODEL.md §5.3 P7–P8) vs float64 NumPy: per-stream score, signed-sqrt sigmoid gate
(including scores inside the 1e-6 clamp and exactly 0), and V = λ·v_p, on strided views."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops.ple import ple_gate
from vkflash.gpu.ops.views import Rows
from vkflash.model.layers.common import sigmoid

pytestmark = pytest.mark.gpu


def test_ple_gate(gpu, rng):
    """λ and V match; a few streams get K̃ ⟂ Q̃ (s = 0 → λ = ½) or tiny s (the clamp). Bound: the dot
    of d f32 products has relative error ≲ d·2^-24 of Σ|K̃Q̃|; √ amplifies it by ≤ ½/√1e-6 near the
    clamp, and σ' ≤ ¼: 1e-4 absolute on λ fails for a wrong sign, divisor (√d vs √D_p) or clamp."""
    T, hc, d = int(rng.integers(1, 40)), 4, int(rng.choice([96, 128, 160]))
    Kt = rng.standard_normal((T, hc, d)).astype(np.float32)
    Qt = rng.standard_normal((T, hc, d)).astype(np.float32)
    Qt[0, 1] = 0.0  # s = 0 exactly
    Qt[-1, 2] = Kt[-1, 2] * np.float32(1e-9)  # |s| far inside the clamp
    vp = rng.standard_normal((T, d)).astype(np.float32)
    pad = int(rng.integers(0, 5))
    kb = gpu.upload(np.pad(Kt.reshape(T, -1), ((0, 0), (0, pad))), "kt")
    lam_b, V_b = gpu.buffer(4 * T * (hc + 1), "lam"), gpu.buffer(4 * T * hc * d, "V")
    lam_b.fill(np.nan)
    V_b.fill(np.nan)
    g = gpu.graph("ple_gate")
    ple_gate(g, Rows(kb, T, hc * d, 0, hc * d + pad), Rows(gpu.upload(Qt.reshape(T, -1), "qt"), T, hc * d),
             Rows(gpu.upload(vp, "vp"), T, d), Rows(lam_b, T, hc, 1, hc + 1), Rows(V_b, T, hc * d), hc)
    g.run()
    s = np.einsum("tcd,tcd->tc", Kt.astype(np.float64), Qt.astype(np.float64)) / np.sqrt(d)
    lam = sigmoid(np.sign(s) * np.sqrt(np.maximum(np.abs(s), 1e-6)))
    got_lam = lam_b.read(np.float32).reshape(T, hc + 1)[:, 1:]
    assert np.abs(got_lam - lam).max() <= 1e-4
    V = lam[:, :, None] * vp[:, None, :].astype(np.float64)
    got_V = V_b.read(np.float32).reshape(T, hc, d)
    assert np.abs(got_V - V).max() <= 1e-4 * np.abs(vp).max()
