"""RMSNorm, grouped RMSNorm and L2 norm kernels vs float64 NumPy references (MODEL.md §2, §5.4 G6)."""

from __future__ import annotations

import numpy as np
import pytest

from fusion_util import graph
from vkflash.gpu.ops import norm as N
from vkflash.gpu.ops.views import Rows
from vkflash.gpu.options import Fusion

pytestmark = pytest.mark.gpu


def _rtol(n: int) -> float:
    """Relative error bound of y for groups of n.

    Σx² in f32: each lane sums ≤ n/WG terms, then a subgroup tree and ≤ WG/subgroup partials in
    order: ≤ (n/32 + 64)·2^-24 relative for any WG ≥ 32, subgroup ≥ 4; halved by the square
    root; plus sqrt (3 ulp by the GLSL rules), divide (2.5 ulp) and two products: ≤ 16·2^-24.
    """
    return 2.0**-24 * ((n / 32 + 64) / 2 + 16)


def _rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """Rows with very different scales; some so small that ε dominates mean(x²)."""
    scales = np.exp(rng.uniform(-9, 3, (rows, 1))).astype(np.float32)
    return rng.standard_normal((rows, n)).astype(np.float32) * scales


def _rms(x: np.ndarray, eps: float, groups: int) -> np.ndarray:
    r, n = x.shape
    xg = x.astype(np.float64).reshape(r, groups, n // groups)
    return (xg / np.sqrt((xg**2).mean(-1, keepdims=True) + np.float32(eps))).reshape(r, n)


def _check(got: np.ndarray, want: np.ndarray, n: int) -> None:
    err = np.abs(got - want) / np.maximum(np.abs(want), 1e-30)
    assert np.all(err <= _rtol(n)), f"max rel err {err.max():.3g} > {_rtol(n):.3g}"


@pytest.mark.parametrize("n", [1, 77, 2560])
def test_rms_norm_strided_with_gamma(gpu, rng, n):
    """Plain RMSNorm ⊙ γ on strided rows (ragged and model-sized d), into another buffer."""
    rows, stride, off = int(rng.integers(2, 6)), n + int(rng.integers(0, 5)), int(rng.integers(0, 9))
    x = _rows(rng, rows, n)
    gam = rng.standard_normal(n + 3).astype(np.float32)
    eps = float(10 ** rng.uniform(-7, -5))
    buf = np.zeros(off + rows * stride, np.float32)
    for r in range(rows):
        buf[off + r * stride: off + r * stride + n] = x[r]
    xb, gb, yb = gpu.upload(buf, "x"), gpu.upload(gam, "gamma"), gpu.buffer(4 * rows * n, "y")
    yb.fill(np.nan)
    g = gpu.graph("rms")
    N.rms_norm(g, Rows(xb, rows, n, off, stride), Rows(yb, rows, n), eps, gb, gamma_off=3)
    g.run()
    _check(yb.read(np.float32).reshape(rows, n), _rms(x, eps, 1) * gam[3:], n)


def test_rms_norm_no_gamma_in_place(gpu, rng):
    rows, n = int(rng.integers(3, 20)), int(rng.integers(2, 1500))
    x = _rows(rng, rows, n)
    eps = 1e-6
    xb = gpu.upload(x, "x")
    g = gpu.graph("rms_inplace")
    N.rms_norm(g, Rows(xb, rows, n), Rows(xb, rows, n), eps)
    g.run()
    _check(xb.read(np.float32).reshape(rows, n), _rms(x, eps, 1), n)


@pytest.mark.parametrize("hc,d", [(4, 2560), (3, 333)])
def test_grouped_rms_norm(gpu, rng, hc, d):
    """Each stream of d normalised on its own (not over hc·d), then ⊙ γ ∈ R^{hc·d}."""
    rows = int(rng.integers(1, 4))
    x = _rows(rng, rows, hc * d)
    x.reshape(rows, hc, d)[:, 0] *= 50  # streams of different scale: a whole-row norm would be far off
    gam = rng.standard_normal(hc * d).astype(np.float32)
    eps = 1e-6
    xb, gb, yb = gpu.upload(x, "R"), gpu.upload(gam, "gamma"), gpu.buffer(x.nbytes, "X")
    yb.fill(np.nan)
    g = gpu.graph("grouped")
    N.grouped_rms_norm(g, Rows(xb, rows, hc * d), Rows(yb, rows, hc * d), hc, eps, gb)
    g.run()
    _check(yb.read(np.float32).reshape(rows, hc * d), _rms(x, eps, hc) * gam, d)


def test_combine_then_grouped_norm(gpu, rng):
    """Fusion.COMBINE_NORM: R_c += 2σ(ι_c/hc)·b in place, then the grouped norm of the updated R, in
    one dispatch — the same bits as hc_combine followed by grouped_rms_norm, and R near float64."""
    from vkflash.gpu.ops.hc import hc_combine

    hc, d, T = int(rng.integers(2, 5)), int(rng.integers(1, 700)), int(rng.integers(1, 9))
    R = _rows(rng, T, hc * d)
    b = rng.standard_normal((T, d)).astype(np.float32)
    iota = (rng.standard_normal((T, hc)) * 8).astype(np.float32)
    gam = rng.standard_normal(hc * d).astype(np.float32)
    eps = 1e-6
    out = {}
    for fused in (True, False):
        rb, gb, xb = gpu.upload(R, "R"), gpu.upload(gam, "gamma"), gpu.buffer(R.nbytes + 64, "X")
        ib = gpu.upload(np.concatenate([np.full(3, np.nan, np.float32), iota.reshape(-1)]), "iota")
        bb = gpu.upload(b, "b")
        xb.fill(np.nan)
        iv, bv, Rv, Xv = Rows(ib, T, hc, 3, hc), Rows(bb, T, d), Rows(rb, T, hc * d), Rows(xb, T, hc * d, 16)
        g = graph(gpu, "combine_norm", fused, Fusion.COMBINE_NORM)
        hc_combine(g, Rv, bv, iv)
        N.grouped_rms_norm(g, Rv, Xv, hc, eps, gb)
        assert len(g.ops) == (1 if fused else 2)
        g.run()
        X = xb.read(np.float32)
        assert np.isnan(X[:16]).all() and np.isnan(X[16 + T * hc * d:]).all()
        out[fused] = rb.read(np.float32).reshape(T, hc * d), X[16:16 + T * hc * d].reshape(T, hc * d)
    assert np.array_equal(out[True][0], out[False][0]) and np.array_equal(out[True][1], out[False][1])
    s = 2 / (1 + np.exp(-iota.astype(np.float64) / hc))
    want = (R.astype(np.float64).reshape(T, hc, d) + s[:, :, None] * b[:, None, :]).reshape(T, hc * d)
    scale = np.abs(R).max() + 2 * np.abs(b).max()
    assert np.abs(out[True][0] - want).max() <= 2.0**-20 * scale * (1 + np.abs(iota).max())
    _check(out[True][1], _rms(out[True][0], eps, hc) * gam, d)


@pytest.mark.parametrize("combine", [True, False])
def test_grouped_norm_with_inject(gpu, rng, combine):
    """Fusion.NORM_INJECT: the groups' workgroups also compute ι = X W_injᵀ (an f32 matmul of X to
    hc values) from the X they write; X equals the plain norm's bit for bit, ι the inject matmul's
    to f32 rounding (another order)."""
    from vkflash.gpu.ops.hc import hc_combine
    from vkflash.gpu.ops.matmul import QWeight, matmul

    hc, d, T = int(rng.integers(2, 5)), int(rng.integers(1, 20)) * 32, int(rng.integers(1, 9))
    R = _rows(rng, T, hc * d)
    b = rng.standard_normal((T, d)).astype(np.float32)
    iota = (rng.standard_normal((T, hc)) * 8).astype(np.float32)
    gam = rng.standard_normal(hc * d).astype(np.float32)
    W = (rng.standard_normal((hc, hc * d)) / np.sqrt(hc * d)).astype(np.float32)
    out = {}
    for fused in (True, False):
        rb, xb, gb = gpu.upload(R, "R"), gpu.buffer(R.nbytes, "X"), gpu.upload(gam, "gamma")
        ib, bb, wb = gpu.upload(iota, "iota"), gpu.upload(b, "b"), gpu.upload(W, "w_inj")
        ob = gpu.buffer(4 * (T * 8 + 5), "iota_out")
        xb.fill(np.nan)
        ob.fill(np.nan)
        Rv, Xv, ov = Rows(rb, T, hc * d), Rows(xb, T, hc * d), Rows(ob, T, hc, 5, 8)
        g = graph(gpu, "norm_inject", fused, Fusion.NORM_INJECT, Fusion.COMBINE_NORM)
        if combine:
            hc_combine(g, Rv, Rows(bb, T, d), Rows(ib, T, hc))
        N.grouped_rms_norm(g, Rv, Xv, hc, 1e-6, gb)
        matmul(g, QWeight(wb, 0, hc * d, hc), Xv, ov)
        assert len(g.ops) == (1 if fused else 2 + combine)
        g.run()
        o = ob.read(np.float32)
        out[fused] = xb.read(np.float32).reshape(T, hc * d), o[5:].reshape(T, 8)[:, :hc], o
    assert np.array_equal(out[True][0], out[False][0])
    X = out[True][0].astype(np.float64)
    want = X @ W.T.astype(np.float64)
    bound = 2.0**-20 * (np.abs(X) @ np.abs(W.T).astype(np.float64))
    for got in (out[True][1], out[False][1]):
        assert np.all(np.abs(got - want) <= bound)
    untouched = np.ones(out[True][2].size, bool)
    untouched[5:].reshape(T, 8)[:, :hc] = False
    assert np.isnan(out[True][2][untouched]).all()


def test_inject_replays(gpu, rng):
    """The groups' workgroups meet through a per-row counter that the last one resets: replays of one
    recorded graph with fresh residuals, branch outputs and ι each give ι = X W_injᵀ and X."""
    hc, d, T = int(rng.integers(2, 9)), int(rng.integers(1, 40)) * 16, int(rng.integers(1, 9))
    gam = rng.standard_normal(hc * d).astype(np.float32)
    W = (rng.standard_normal((hc, hc * d)) / np.sqrt(hc * d)).astype(np.float32)
    rb, xb, gb = gpu.buffer(4 * T * hc * d, "R"), gpu.buffer(4 * T * hc * d, "X"), gpu.upload(gam, "gamma")
    ib, bb, wb, ob = gpu.buffer(4 * T * hc, "iota"), gpu.buffer(4 * T * d, "b"), gpu.upload(W, "w_inj"), gpu.buffer(4 * T * hc, "o")
    g = graph(gpu, "inject_replays", True)
    g.add(N.Norm(N.Mode.RMS, Rows(rb, T, hc * d), Rows(xb, T, hc * d), 1e-6, hc, gb, 0, 1.0, "norm",
                 combine=(Rows(ib, T, hc), Rows(bb, T, d)), inject=(Rows(wb, hc, hc * d), Rows(ob, T, hc))))
    for replay in range(3):
        R, b = _rows(rng, T, hc * d), rng.standard_normal((T, d)).astype(np.float32)
        iota = (rng.standard_normal((T, hc)) * 8).astype(np.float32)
        rb.write(R)
        bb.write(b)
        ib.write(iota)
        xb.fill(np.nan)
        ob.fill(np.nan)
        g.run()
        s = 2.0 / (1.0 + np.exp(-iota.astype(np.float64) / hc))
        Rn = R + np.repeat(s, d, axis=1) * np.tile(b.astype(np.float64), hc)
        R_gpu = rb.read(np.float32).reshape(T, hc * d)
        assert np.abs(R_gpu - Rn).max() <= 2.0**-20 * (np.abs(R).max() + 2 * np.abs(b).max()), f"replay {replay}: R"
        X = xb.read(np.float32).reshape(T, hc * d)
        _check(X, _rms(R_gpu, 1e-6, hc) * gam, d)
        Xd = X.astype(np.float64)
        bound = 2.0**-20 * (np.abs(Xd) @ np.abs(W.T).astype(np.float64))
        got = ob.read(np.float32).reshape(T, hc)
        assert np.all(np.abs(got - Xd @ W.T.astype(np.float64)) <= bound), f"replay {replay}: ι"


def test_l2_norm_scaled(gpu, rng):
    """q̂ = q/√(Σq²+ε)·(1/√S) per head, heads read with a stride (G6)."""
    heads, S = int(rng.integers(2, 9)), int(rng.integers(16, 200))
    stride = 2 * S
    x = _rows(rng, heads, stride)
    eps = 1e-6
    xb, yb = gpu.upload(x, "q"), gpu.buffer(4 * heads * S, "qhat")
    yb.fill(np.nan)
    g = gpu.graph("l2")
    N.l2_norm(g, Rows(xb, heads, S, 0, stride), Rows(yb, heads, S), eps, scale=1 / np.sqrt(S))
    g.run()
    q = x[:, :S].astype(np.float64)
    want = q / np.sqrt((q**2).sum(-1, keepdims=True) + np.float32(eps)) / np.sqrt(S)
    _check(yb.read(np.float32).reshape(heads, S), want, S)


def test_more_groups_than_workgroups(gpu, rng, monkeypatch):
    """With fewer workgroups than groups, each workgroup loops over several (grid-stride)."""
    monkeypatch.setattr(N, "MAX_GROUPS", 7)
    rows, n = int(rng.integers(30, 60)), int(rng.integers(1, 300))
    x = _rows(rng, rows, n)
    xb, yb = gpu.upload(x), gpu.buffer(x.nbytes)
    yb.fill(np.nan)
    g = gpu.graph("rows")
    N.rms_norm(g, Rows(xb, rows, n), Rows(yb, rows, n), 1e-6)
    g.run()
    _check(yb.read(np.float32).reshape(rows, n), _rms(x, 1e-6, 1), n)


def test_validation(gpu):
    b, c = gpu.buffer(4 * 100, "b"), gpu.buffer(4 * 10, "gamma")
    g = gpu.graph("bad")
    with pytest.raises(ValueError, match="does not split into 3 groups"):
        N.grouped_rms_norm(g, Rows(b, 2, 10), Rows(b, 2, 10, 50), 3, 1e-6)
    with pytest.raises(ValueError, match="needs 44 B"):
        N.rms_norm(g, Rows(b, 2, 10), Rows(b, 2, 10, 50), 1e-6, c, gamma_off=1)
    with pytest.raises(ValueError, match="shapes differ"):
        N.l2_norm(g, Rows(b, 2, 10), Rows(b, 2, 11, 50), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        N.rms_norm(g, Rows(b, 2, 10), Rows(b, 2, 10, 50), float("nan"))
    def fused(x: Rows, y: Rows, groups: int, **parts) -> N.Norm:
        return N.Norm(N.Mode.RMS, x, y, 1e-6, groups, None, 0, 1.0, "bad", **parts)

    with pytest.raises(ValueError, match="ι must be 2x2"):
        fused(Rows(b, 2, 10), Rows(b, 2, 10, 50), 2, combine=(Rows(c, 2, 3), Rows(c, 2, 5)))
    with pytest.raises(ValueError, match="must not overlap"):
        fused(Rows(b, 2, 10), Rows(b, 2, 10, 50), 2, combine=(Rows(c, 2, 2), Rows(b, 2, 5, 5)))
    big, pos = gpu.buffer(4 * 1200, "big"), gpu.buffer(16, "pos")
    with pytest.raises(ValueError, match="at most 512"):
        fused(Rows(big, 2, 600), Rows(big, 2, 600), 1, rope=N.Rope(1, 64, 1e4, pos))
    with pytest.raises(ValueError, match="n_rot must be even"):
        fused(Rows(b, 2, 10), Rows(b, 2, 10), 1, rope=N.Rope(1, 3, 1e4, pos))
    assert not g.ops
