"""NeoX partial RoPE vs NumPy (MODEL.md §5.5 A3): pairs (i, i + n_rot/2), pass-through dims,
positions from a buffer (replay sees new positions), strided q rows, in place; IMRoPE sections."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops import rope as R
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu


def _ref(x: np.ndarray, pos: np.ndarray, n_rot: int, theta: float) -> np.ndarray:
    """x: (T, H, Dh). Angles in f32 exactly as specified (§7.7), rotation in float64."""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float32)
    inv = np.power(np.float32(theta), np.float32(-2.0) * i / np.float32(n_rot))  # f32 pow
    phi = (pos.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)[:, None, :]
    c, s = np.cos(phi), np.sin(phi)
    y = x.astype(np.float64).copy()
    x0, x1 = y[..., :half].copy(), y[..., half:n_rot].copy()
    y[..., :half] = x0 * c - x1 * s
    y[..., half:n_rot] = x1 * c + x0 * s
    return y


def _tol(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Per token: pow(θ, ·) = exp2(y·log2 θ) on GPUs is good to some tens of ulp for θ = 1e7
    (log2 θ ≈ 23 amplifies log2's error), so φ may differ from the f32 reference by p·32 ulp of
    θ^{-2i/n_rot} ≤ 32·2^-23·p; sin/cos and the rotation add a few 2^-23: ≤ |x|·2^-23·(32p + 16).
    Small positions are therefore checked tightly, large ones loosely (MODEL.md §7.7)."""
    mag = np.abs(x).max(axis=(1, 2), keepdims=True).astype(np.float64)
    return mag * 2.0**-23 * (32 * np.abs(pos)[:, None, None] + 16)


@pytest.mark.parametrize("dh,n_rot", [(64, 16), (256, 64), (30, 30), (10, 4)])
def test_rope_partial(gpu, rng, dh, n_rot):
    """Tokens × heads per dispatch with ragged counts; positions 0, < 100 (tight check) and up to 5e4."""
    T, H = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    theta = float(rng.choice([1e4, 1e7]))
    x = rng.standard_normal((T, H, dh)).astype(np.float32)
    pos = np.where(rng.random(T) < 0.5, rng.integers(0, 100, T), rng.integers(0, 50000, T)).astype(np.int32)
    pos[0] = 0
    xb, pb, yb = gpu.upload(x, "k"), gpu.upload(pos, "pos"), gpu.buffer(x.nbytes, "k_rot")
    yb.fill(np.nan)
    g = gpu.graph("rope")
    R.rope_neox(g, Rows(xb, T * H, dh), Rows(yb, T * H, dh), H, n_rot, theta, pb)
    g.run()
    got = yb.read(np.float32).reshape(T, H, dh)
    want = _ref(x, pos, n_rot, theta)
    assert np.all(np.abs(got - want) <= _tol(x, pos)), f"max err {np.abs(got - want).max():.3g}"
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])  # pass-through is a copy


def test_rope_in_place_strided_and_replay(gpu, rng):
    """q heads read in place from QG rows (q then gate per head, stride 2Dh); the gate halves stay
    untouched; replaying with new positions in the buffer rotates by the new angles."""
    T, H, dh, n_rot, theta = int(rng.integers(2, 6)), 3, 64, 16, 1e7
    qg = rng.standard_normal((T, H, 2 * dh)).astype(np.float32)
    pos = rng.integers(0, 4000, T).astype(np.int32)
    qb, pb = gpu.upload(qg, "QG"), gpu.buffer(4 * (T + 5), "pos")
    pb.write(pos, 4 * 5)
    q = Rows(qb, T * H, dh, 0, 2 * dh)
    g = gpu.graph("rope_qg")
    R.imrope(g, q, q, H, n_rot, theta, [3, 3, 2, 0], pb, pos_off=5)
    g.run()
    got = qb.read(np.float32).reshape(T, H, 2 * dh)
    want = _ref(qg[..., :dh], pos, n_rot, theta)
    assert np.all(np.abs(got[..., :dh] - want) <= _tol(qg[..., :dh], pos))
    np.testing.assert_array_equal(got[..., dh:], qg[..., dh:])

    pos2 = rng.integers(0, 4000, T).astype(np.int32)
    qb.write(qg)
    pb.write(pos2, 4 * 5)
    g.run()
    got2 = qb.read(np.float32).reshape(T, H, 2 * dh)[..., :dh]
    assert np.all(np.abs(got2 - _ref(qg[..., :dh], pos2, n_rot, theta)) <= _tol(qg[..., :dh], pos2))


def test_rope_grid_stride(gpu, rng, monkeypatch):
    monkeypatch.setattr(R, "MAX_GROUPS", 2)
    T, H, dh, n_rot = 40, 4, 48, 32
    x = rng.standard_normal((T, H, dh)).astype(np.float32)
    pos = rng.integers(0, 1000, T).astype(np.int32)
    xb, pb, yb = gpu.upload(x), gpu.upload(pos), gpu.buffer(x.nbytes)
    yb.fill(np.nan)
    g = gpu.graph("rope_loop")
    R.rope_neox(g, Rows(xb, T * H, dh), Rows(yb, T * H, dh), H, n_rot, 1e4, pb)
    g.run()
    got = yb.read(np.float32).reshape(T, H, dh)
    assert np.all(np.abs(got - _ref(x, pos, n_rot, 1e4)) <= _tol(x, pos))


def test_validation(gpu):
    x, p = gpu.buffer(4 * 64 * 6, "x"), gpu.buffer(4 * 3, "pos")
    g = gpu.graph("bad")
    v = Rows(x, 6, 64)
    with pytest.raises(ValueError, match="not whole tokens of 4 heads"):
        R.rope_neox(g, v, v, 4, 16, 1e4, p)
    with pytest.raises(ValueError, match="n_rot must be even"):
        R.rope_neox(g, v, v, 2, 15, 1e4, p)
    with pytest.raises(ValueError, match="n_rot must be even"):
        R.rope_neox(g, v, v, 2, 66, 1e4, p)
    with pytest.raises(ValueError, match="overflow"):
        R.rope_neox(g, v, v, 2, 16, 1e4, p, pos_off=1)
    with pytest.raises(ValueError, match="4 sections"):
        R.imrope(g, v, v, 2, 16, 1e4, [3, 3, 2], p)
    with pytest.raises(ValueError, match="more than n_rot/2"):
        R.imrope(g, v, v, 2, 16, 1e4, [3, 3, 3, 0], p)
    with pytest.raises(ValueError, match="not all 0"):
        R.imrope(g, v, v, 2, 16, 1e4, [0, 0, 0, 0], p)
    assert not g.ops
    assert R.check_sections([11, 11, 10, 0], 64) == (11, 11, 10, 0)


@pytest.mark.parametrize("dh,n_rot", [(64, 16), (256, 64), (30, 30)])
def test_norm_rope_fused_in_place(gpu, rng, dh, n_rot):
    """Fusion.NORM_ROPE: rms_norm then rope_neox in one dispatch, in place on strided q rows (q then
    gate per head): equal to the two dispatches within a few ulp, near the float64 oracle, gates
    untouched."""
    from fusion_util import graph
    from vkflash.gpu.ops.norm import rms_norm
    from vkflash.gpu.options import Fusion

    T, H, theta, eps = int(rng.integers(1, 7)), int(rng.integers(1, 5)), float(rng.choice([1e4, 1e7])), 1e-6
    qg = rng.standard_normal((T, H, 2, dh)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (T, H, 1, 1)))
    qg = qg.astype(np.float32)
    gam = (1 + 0.2 * rng.standard_normal(dh)).astype(np.float32)
    pos = rng.integers(0, 3000, T).astype(np.int32)
    pb, gb = gpu.upload(pos, "pos"), gpu.upload(gam, "gamma")
    out = {}
    for fused in (True, False):
        xb = gpu.upload(qg, "qg")
        rows = Rows(xb, T * H, dh, 0, 2 * dh)
        g = graph(gpu, "norm_rope", fused, Fusion.NORM_ROPE)
        rms_norm(g, rows, rows, eps, gb)
        R.rope_neox(g, rows, rows, H, n_rot, theta, pb)
        assert len(g.ops) == (1 if fused else 2)
        g.run()
        out[fused] = xb.read(np.float32).reshape(T, H, 2, dh)
    np.testing.assert_array_equal(out[True][:, :, 1], qg[:, :, 1])  # gate halves untouched
    q = qg[:, :, 0].astype(np.float64)
    normed = q / np.sqrt((q**2).mean(-1, keepdims=True) + np.float32(eps)) * gam
    want = _ref(normed, pos, n_rot, theta)
    tol = _tol(normed, pos) + 2.0**-20 * np.abs(normed).max(axis=(1, 2), keepdims=True)
    got = out[True][:, :, 0]
    assert np.all(np.abs(got - want) <= tol), f"max err {np.abs(got - want).max():.3g}"
    plain = out[False][:, :, 0]
    assert np.abs(got - plain).max() <= 8 * 2.0**-23 * np.abs(plain).max()
