"""GDN gated RMSNorm (G9) vs float64 NumPy: per-head rms over S, ssm_norm as stored, σ or silu gate."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops import gdn
from vkflash.gpu.ops.gdn import Gate
from vkflash.gpu.ops.views import Rows
from vkflash.model.layers.common import sigmoid, silu
from vkflash.model.layers.norms import rms

pytestmark = pytest.mark.gpu
U = 2.0**-24


def _bound(o: np.ndarray, z: np.ndarray, want: np.ndarray, S: int) -> np.ndarray:
    """Relative error of y: Σo² over S terms (≤ (S/WG + 64)·u as in the norm family's bound, halved by
    the root), sqrt + divide (5.5 ulp), σ's exp/add/divide ((6 + 2|z|) ulp), three products."""
    return U * ((S / 64 + 64) / 2 + 5.5 + 6 + 2 * np.abs(z) + 4) * np.abs(want) + 1e-37


@pytest.mark.parametrize("act", list(Gate))
@pytest.mark.parametrize("T,S,n_v", [(1, 128, 48), (3, 32, 6), (65, 32, 6), (130, 64, 5)])
def test_gated_norm(gpu, rng, T, S, n_v, act):
    """y = rms(o_j) ⊙ w ⊙ act(z_j) per head, z read from a strided view (as from a fused projection)."""
    o = (rng.standard_normal((T, n_v, S)) * np.exp(rng.uniform(-8, 3, (T, n_v, 1)))).astype(np.float32)
    z = rng.normal(0, 3, (T, n_v * S)).astype(np.float32)
    w = rng.uniform(0.9, 1.1, S).astype(np.float32)
    eps = float(10 ** rng.uniform(-7, -5))
    zoff, zstride = int(rng.integers(0, 9)), n_v * S + int(rng.integers(0, 40))
    zbuf = np.full(zoff + T * zstride, np.nan, np.float32)
    zbuf[zoff:].reshape(T, zstride)[:, :n_v * S] = z
    ob, zb, wb, yb = gpu.upload(o, "o"), gpu.upload(zbuf, "z"), gpu.upload(w, "ssm_norm"), gpu.buffer(o.nbytes, "y")
    yb.fill(np.nan)
    g = gpu.graph("gated_norm")
    gdn.gated_norm(g, Rows(ob, T, n_v * S), Rows(zb, T, n_v * S, zoff, zstride), Rows.flat(wb, S),
                   Rows(yb, T, n_v * S), S, eps, act)
    g.run()
    a = sigmoid if act == Gate.SIGMOID else silu
    z64 = z.astype(np.float64).reshape(T, n_v, S)
    want = (rms(o.astype(np.float64), np.float32(eps)) * w * a(z64)).reshape(T, n_v * S)
    got = yb.read(np.float32).reshape(T, n_v * S)
    assert np.all(np.abs(got - want) <= _bound(o, z, want, S)), f"max err {np.abs(got - want).max():.3g}"


def test_gated_norm_in_place(gpu, rng):
    """y written over o (the same view): each element is read and written by one invocation."""
    T, n_v, S = int(rng.integers(2, 40)), 6, 32
    o = rng.standard_normal((T, n_v * S)).astype(np.float32)
    z = rng.standard_normal((T, n_v * S)).astype(np.float32)
    w = rng.uniform(0.9, 1.1, S).astype(np.float32)
    ob, zb, wb = gpu.upload(o, "o"), gpu.upload(z, "z"), gpu.upload(w, "ssm_norm")
    g = gpu.graph("gated_norm_inplace")
    gdn.gated_norm(g, Rows(ob, T, n_v * S), Rows(zb, T, n_v * S), Rows.flat(wb, S), Rows(ob, T, n_v * S), S, 1e-6,
                   Gate.SILU)
    g.run()
    want = (rms(o.astype(np.float64).reshape(T, n_v, S), np.float32(1e-6)) * w
            * silu(z.astype(np.float64).reshape(T, n_v, S))).reshape(T, -1)
    got = ob.read(np.float32).reshape(T, -1)
    assert np.all(np.abs(got - want) <= _bound(o, z, want, S))


def test_validation(gpu):
    b = gpu.buffer(4 * 4096, "b")
    g = gpu.graph("bad")
    with pytest.raises(ValueError, match="heads of 32"):
        gdn.gated_norm(g, Rows(b, 2, 48), Rows(b, 2, 48, 100), Rows.flat(b, 32, 300), Rows(b, 2, 48, 400), 32, 1e-6,
                       Gate.SIGMOID)
    with pytest.raises(ValueError, match="ssm_norm"):
        gdn.gated_norm(g, Rows(b, 2, 64), Rows(b, 2, 64, 200), Rows.flat(b, 64, 400), Rows(b, 2, 64, 500), 32, 1e-6,
                       Gate.SIGMOID)
    assert not g.ops
