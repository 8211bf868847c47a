"""Hyper-connection tails (hc_pre, hc_mix, hc_combine) vs float64 NumPy, fused and plain (VKFLASH_HC_FUSE=0).

Tolerances follow the GLSL precision rules used in test_eltwise: σ(x) = 1/(1+e^{−x}) is within
(8 + 2|x|) ulp (exp 3 + 2|x|, divide 2.5, the roundings of 1 + e^{−x}), silu one more ulp; a
product or sum adds half an ulp of its result. hc = 4 makes ÷hc and ×1/hc exact, so the fused and
plain paths see the same arguments. Any wrong op (missing 1/hc, sum instead of mean, σ(ι) without
×2, a wrong stream) is off by far more than these bounds.
"""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops import hc as H
from vkflash.gpu.graph import Graph
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.options import GpuOptions
from vkflash.model.layers.hc import hc_combine as ref_combine
from vkflash.model.layers.hc import hc_mix as ref_mix
from vkflash.model.layers.norms import grouped_rms_norm
from vkflash.model.weights import HCMixW

pytestmark = pytest.mark.gpu

HC = 4
ULP = 2.0**-23
PATHS = pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])


def _sig(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def _place(gpu, rng, x: np.ndarray, name: str) -> tuple[Rows, int, int]:
    """x (T × n) in a NaN-poisoned buffer at a random offset and row stride; (view, off, stride)."""
    T, n = x.shape
    off, stride = int(rng.integers(0, 40)), n + int(rng.integers(0, 9))
    buf = gpu.buffer(4 * (off + T * stride + int(rng.integers(1, 9))), name)
    buf.fill(np.nan)
    for t in range(T):
        buf.write(x[t].astype(np.float32), 4 * (off + t * stride))
    return Rows(buf, T, n, off, stride), off, stride


def _take(v: Rows) -> tuple[np.ndarray, np.ndarray]:
    """The view's rows (T × n) and every element of its buffer outside the view."""
    all_ = v.buf.read(np.float32)
    idx = v.off + np.arange(v.n_rows)[:, None] * v.stride + np.arange(v.n_cols)[None, :]
    outside = np.ones(all_.size, bool)
    outside[idx] = False
    return all_[idx], all_[outside]


def _shape(rng) -> tuple[int, int]:
    """Ragged token count and stream width (not multiples of the workgroup)."""
    return int(rng.integers(1, 10)), int(rng.integers(1, 400))


@PATHS
def test_hc_pre(gpu, rng, fuse):
    """ℓ = silu(ℓ_pre/hc), out of place into a poisoned view."""
    T, lr = int(rng.integers(1, 10)), int(rng.integers(1, 300))
    a = (rng.standard_normal((T, lr)) * 30).astype(np.float32)
    av, _, _ = _place(gpu, rng, a, "ell_pre")
    yv, _, _ = _place(gpu, rng, np.full((T, lr), np.nan), "ell")
    g = Graph(gpu, "hc_pre", options=GpuOptions(hc_tails=fuse))
    H.hc_pre(g, av, yv, HC)
    g.run()
    got, outside = _take(yv)
    x = a.astype(np.float64) / HC
    want = x * _sig(x)
    tol = ULP * (10 + 2 * np.abs(x)) * np.abs(want)
    assert np.all(np.abs(got - want) <= tol), f"max err {np.max(np.abs(got - want)):.3g}"
    assert np.isnan(outside).all()


def _mix_ref(gp: np.ndarray, X: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """u = (1/hc)·Σ_c σ(g_c)X_c in float64, and its error bound."""
    T = gp.shape[0]
    s = _sig(gp).reshape(T, HC, d)
    sg = np.abs(gp.astype(np.float64)).reshape(T, HC, d)
    prod = s * X.astype(np.float64).reshape(T, HC, d)
    u = prod.sum(axis=1) / HC
    tol = ULP / HC * (((10 + 2 * sg) * np.abs(prod)).sum(axis=1) + HC * np.abs(prod).sum(axis=1))
    return u, tol


@PATHS
def test_hc_mix(gpu, rng, fuse):
    """u = (1/hc)·Σ_c σ(g_pre_c) ⊙ X_c over ragged T and d, strided inputs, poisoned output."""
    T, d = _shape(rng)
    gp = (rng.standard_normal((T, HC * d)) * 6).astype(np.float32)
    X = (rng.standard_normal((T, HC * d)) * 2).astype(np.float32)
    gv, _, _ = _place(gpu, rng, gp, "g_pre")
    xv, _, _ = _place(gpu, rng, X, "X")
    uv, _, _ = _place(gpu, rng, np.full((T, d), np.nan), "u")
    g = Graph(gpu, "hc_mix", options=GpuOptions(hc_tails=fuse))
    H.hc_mix(g, gv, xv, uv, HC)
    g.run()
    got, outside = _take(uv)
    want, tol = _mix_ref(gp, X, d)
    assert np.all(np.abs(got - want) <= tol), f"max err {np.max(np.abs(got - want)):.3g}"
    assert np.isnan(outside).all()
    assert np.array_equal(_take(xv)[0], X)  # X is only read
    if fuse:  # only the plain path reuses g_pre as scratch
        assert np.array_equal(_take(gv)[0], gp)


@PATHS
def test_hc_combine(gpu, rng, fuse):
    """R_c += 2σ(ι_c/hc)·b in place on a strided R; nothing outside R's view is touched."""
    T, d = _shape(rng)
    R = (rng.standard_normal((T, HC * d)) * 3).astype(np.float32)
    b = rng.standard_normal((T, d)).astype(np.float32)
    iota = (rng.standard_normal((T, HC)) * 12).astype(np.float32)
    rv, _, _ = _place(gpu, rng, R, "R")
    bv, _, _ = _place(gpu, rng, b, "b")
    iv, _, _ = _place(gpu, rng, iota, "iota")
    g = Graph(gpu, "hc_combine", options=GpuOptions(hc_tails=fuse))
    H.hc_combine(g, rv, bv, iv)
    g.run()
    got, outside = _take(rv)
    if fuse:  # only the plain path reuses ι as scratch
        assert np.array_equal(_take(iv)[0], iota)
    y = iota.astype(np.float64) / HC
    sb = (2 * _sig(y))[:, :, None] * b.astype(np.float64)[:, None, :]
    want = (R.astype(np.float64).reshape(T, HC, d) + sb).reshape(T, HC * d)
    tol = ULP * ((10 + 2 * np.abs(y))[:, :, None] * np.abs(sb)).reshape(T, HC * d) + ULP * np.abs(want)
    assert np.all(np.abs(got - want) <= tol), f"max err {np.max(np.abs(got - want)):.3g}"
    assert np.isnan(outside).all()


@PATHS
def test_hc_broadcast(gpu, rng, fuse):
    """(H0) every stream of a strided, poisoned R becomes an exact copy of x; nothing else written."""
    T, d = _shape(rng)
    x = rng.standard_normal((T, d)).astype(np.float32)
    xv, _, _ = _place(gpu, rng, x, "x")
    rv, _, _ = _place(gpu, rng, np.full((T, HC * d), np.nan), "R")
    g = Graph(gpu, "hc_broadcast", options=GpuOptions(hc_tails=fuse))
    H.hc_broadcast(g, xv, rv, HC)
    assert len(g.ops) == (1 if fuse else HC)
    g.run()
    got, outside = _take(rv)
    assert np.array_equal(got, np.tile(x, (1, HC)))
    assert np.isnan(outside).all()


def test_knob_selects_plain_path_and_paths_agree(gpu, rng):
    """VKFLASH_HC_FUSE=0 gives the multi-dispatch eltwise path; both paths give the same u and R."""
    T, d = _shape(rng)
    gp = (rng.standard_normal((T, HC * d)) * 6).astype(np.float32)
    X = rng.standard_normal((T, HC * d)).astype(np.float32)
    R = rng.standard_normal((T, HC * d)).astype(np.float32)
    b = rng.standard_normal((T, d)).astype(np.float32)
    iota = (rng.standard_normal((T, HC)) * 8).astype(np.float32)
    out = {}
    for fuse in ("1", "0"):
        gb, xb, ub = gpu.upload(gp), gpu.upload(X), gpu.buffer(4 * T * d)
        rb, bb, ib = gpu.upload(R), gpu.upload(b), gpu.upload(iota)
        ub.fill(np.nan)
        g = gpu.with_options(GpuOptions.from_knobs(VKFLASH_HC_FUSE=fuse)).graph(f"hc_fuse{fuse}")
        H.hc_mix(g, Rows(gb, T, HC * d), Rows(xb, T, HC * d), Rows(ub, T, d), HC)
        H.hc_combine(g, Rows(rb, T, HC * d), Rows(bb, T, d), Rows(ib, T, HC))
        assert (len(g.ops) == 2) == (fuse == "1")
        g.run()
        out[fuse] = ub.read(np.float32), rb.read(np.float32)
    want, tol = _mix_ref(gp, X, d)
    for u, _ in out.values():
        assert np.all(np.abs(u.reshape(T, d) - want) <= tol)
    np.testing.assert_allclose(out["0"][0], out["1"][0], rtol=0, atol=float(2 * tol.max()))
    # combine: both within a few ulp of |R| + |2σ·b| ≤ |R| + 2|b|
    bound = 2 * ULP * (10 + 2 * np.abs(iota).max() / HC) * (np.abs(R).max() + 2 * np.abs(b).max())
    np.testing.assert_allclose(out["0"][1], out["1"][1], rtol=0, atol=float(bound))


def test_mix_and_combine_match_model_reference(gpu, rng):
    """With NumPy matmuls around them, the GPU tails reproduce vkflash.model.layers.hc (H1–H6)."""
    T, d = _shape(rng)
    lr, eps = int(rng.integers(1, 40)), 1e-6
    R = rng.standard_normal((T, HC, d)).astype(np.float32)
    w = HCMixW(norm=(1 + 0.3 * rng.standard_normal(HC * d)).astype(np.float32),
               down=(rng.standard_normal((lr, HC * d)) / np.sqrt(HC * d)).astype(np.float32),
               up=rng.standard_normal((HC * d, lr)).astype(np.float32),
               inject=(rng.standard_normal((HC, HC * d)) / np.sqrt(HC * d) * 4).astype(np.float32))
    bo = rng.standard_normal((T, d)).astype(np.float32)
    u_ref, iota_ref = ref_mix(R, w, eps)
    R_ref = ref_combine(R, bo, iota_ref).reshape(T, HC * d)

    X = grouped_rms_norm(R, w.norm, eps).reshape(T, HC * d).astype(np.float32)
    ell_pre = (X @ w.down.T).astype(np.float32)
    eb = gpu.upload(ell_pre)
    g = gpu.graph("hc_pre")
    H.hc_pre(g, Rows(eb, T, lr), Rows(eb, T, lr), HC)  # in place
    g.run()
    ell = eb.read(np.float32).reshape(T, lr)
    gb, xb, ub = gpu.upload((ell @ w.up.T).astype(np.float32)), gpu.upload(X), gpu.buffer(4 * T * d)
    rb, bb, ib = gpu.upload(R.reshape(T, HC * d)), gpu.upload(bo), gpu.upload(iota_ref.astype(np.float32))
    ub.fill(np.nan)
    g = gpu.graph("hc_mix_combine")
    H.hc_mix(g, Rows(gb, T, HC * d), Rows(xb, T, HC * d), Rows(ub, T, d), HC)
    H.hc_combine(g, Rows(rb, T, HC * d), Rows(bb, T, d), Rows(ib, T, HC))
    g.run()
    # f32 end to end on both sides; ℓ's few-ulp error is amplified by ‖W_up‖ through σ: 1e-5 relative
    u, Rn = ub.read(np.float32).reshape(T, d), rb.read(np.float32).reshape(T, HC * d)
    np.testing.assert_allclose(u, u_ref, rtol=1e-5, atol=1e-5 * float(np.abs(u_ref).max()))
    np.testing.assert_allclose(Rn, R_ref, rtol=1e-6, atol=1e-6 * float(np.abs(R_ref).max()))


def test_validation(gpu):
    """Mismatched widths, token counts and R overlapping an input are refused before dispatch."""
    a, c = gpu.buffer(4 * 400, "a"), gpu.buffer(4 * 400, "c")
    g = gpu.graph("bad")
    with pytest.raises(ValueError, match="expected 40"):
        H.hc_mix(g, Rows(a, 2, 40), Rows(c, 2, 41), Rows(c, 2, 10, 200), HC)
    with pytest.raises(ValueError, match="token counts differ"):
        H.hc_mix(g, Rows(a, 2, 40), Rows(c, 2, 40), Rows(c, 1, 10, 200), HC)
    with pytest.raises(ValueError, match="overlaps the residual"):
        H.hc_combine(g, Rows(a, 2, 40), Rows(a, 2, 10, 60), Rows(c, 2, 4))
    with pytest.raises(ValueError, match="partly overlaps"):
        H.hc_pre(g, Rows(a, 2, 40), Rows(a, 2, 40, 3), HC)
    assert not g.ops
