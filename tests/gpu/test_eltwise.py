"""Elementwise kernels vs NumPy: every op, ragged and strided views, broadcast rows, in place."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu


def _ref(op: E.Op, a: np.ndarray, b: np.ndarray | None, alpha: float) -> np.ndarray:
    """The op in float64 on the f32 inputs (float32 for the exactly rounded ones)."""
    x = a.astype(np.float64)
    f32 = np.float32
    if op == E.Op.ADD:
        return (a + b).astype(np.float64)
    if op == E.Op.MUL:
        return (a * b).astype(np.float64)
    if op == E.Op.SCALE:
        return (f32(alpha) * a).astype(np.float64)
    sig = 1.0 / (1.0 + np.exp(-x))
    if op == E.Op.SILU:
        return x * sig
    if op == E.Op.SIGMOID:
        return sig
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def _tolerance(op: E.Op, a: np.ndarray, b: np.ndarray | None, alpha: float) -> np.ndarray | float:
    """Per-element bound on |gpu − ref|.

    add, mul, scale are single IEEE operations: bit-exact. Transcendentals, by the
    GLSL precision rules: exp 3 + 2|x| ulp, divide 2.5 ulp, plus the roundings of 1 + e^x and of
    x·σ: ≤ (10 + 2|x|) ulp of the result; log near 1 is only good to 2^-21 absolute, so softplus
    also gets 2^-21 + 2^-23 (forming 1 + e^x) absolute.
    """
    if op in (E.Op.ADD, E.Op.MUL, E.Op.SCALE):
        return 0.0
    x = np.abs(a.astype(np.float64))
    rel = 2.0**-23 * (10 + 2 * x)
    ref = np.abs(_ref(op, a, b, alpha))
    return rel * ref + (2.0**-21 + 2.0**-23 if op == E.Op.SOFTPLUS else 0)


def _draw(rng: np.random.Generator, n: int, op: E.Op) -> np.ndarray:
    spread = 12.0 if op in (E.Op.SILU, E.Op.SIGMOID, E.Op.SOFTPLUS) else 3.0
    x = rng.standard_normal(n).astype(np.float32) * np.float32(spread)
    if op == E.Op.SOFTPLUS:  # make sure both sides of the x > 20 switch are hit
        x[: min(n, 4)] = np.array([20.5, 25.0, 19.5, -30.0], np.float32)[: min(n, 4)]
    return x


@pytest.mark.parametrize("op", list(E.Op), ids=lambda o: o.name.lower())
def test_op_strided_views(gpu, rng, op):
    """Each op on ragged rows read from and written to strided, offset views."""
    rows, cols = int(rng.integers(2, 7)), int(rng.integers(1, 700))
    stride, a_off, b_off, y_off = cols + int(rng.integers(0, 9)), *(int(v) for v in rng.integers(0, 50, 3))
    n_words = max(a_off, b_off, y_off) + rows * stride
    a = _draw(rng, n_words, op)
    b = _draw(rng, n_words, op)
    alpha = float(rng.uniform(-2, 2))
    ab, bb, yb = gpu.upload(a, "a"), gpu.upload(b, "b"), gpu.buffer(4 * n_words, "y")
    yb.fill(np.nan)
    av, bv, yv = Rows(ab, rows, cols, a_off, stride), Rows(bb, rows, cols, b_off, stride), Rows(yb, rows, cols, y_off, stride)
    g = gpu.graph("eltwise")
    E.eltwise(g, op, av, bv if op in E.BINARY else None, yv, alpha)
    g.run()

    def take(x: np.ndarray, off: int) -> np.ndarray:
        return np.stack([x[off + r * stride: off + r * stride + cols] for r in range(rows)])

    aa, bbv = take(a, a_off), take(b, b_off)
    got = take(yb.read(np.float32), y_off).astype(np.float64)
    want = _ref(op, aa, bbv, alpha)
    tol = _tolerance(op, aa, bbv, alpha)
    assert np.all(np.abs(got - want) <= tol), f"{op.name}: max err {np.max(np.abs(got - want)):.3g}"
    # elements between rows are untouched (still the poison)
    gaps = np.ones(n_words, bool)
    for r in range(rows):
        gaps[y_off + r * stride: y_off + r * stride + cols] = False
    assert np.isnan(yb.read(np.float32)[gaps]).all()


def test_broadcast_row_and_in_place(gpu, rng):
    """y[r, i] = x[r, i]·w[i] in place, then x += w broadcast, then silu in place."""
    rows, cols = int(rng.integers(3, 9)), int(rng.integers(100, 3000))
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    xb, wb = gpu.upload(x, "x"), gpu.upload(w, "w")
    xv = Rows(xb, rows, cols)
    g = gpu.graph("bcast")
    E.mul(g, xv, Rows.flat(wb, cols), xv)
    E.add(g, xv, Rows.flat(wb, cols), xv)
    E.silu(g, xv, xv)
    g.run()
    t = x * w
    t = t.astype(np.float64) + w
    want = t / (1 + np.exp(-t))
    got = xb.read(np.float32).reshape(rows, cols)
    # three roundings of O(|t|) plus exp's error: a few ulp of |t|
    np.testing.assert_allclose(got, want, rtol=0, atol=float(2.0**-20 * (1 + np.abs(t).max())))


def test_more_elements_than_invocations(gpu, rng, monkeypatch):
    """With a capped grid, every invocation loops over several elements (grid-stride)."""
    monkeypatch.setattr(E, "MAX_GROUPS", 3)
    n = int(rng.integers(5000, 20000))
    a = rng.standard_normal(n).astype(np.float32)
    ab, yb = gpu.upload(a), gpu.buffer(a.nbytes)
    yb.fill(np.nan)
    g = gpu.graph("capped")
    E.scale(g, Rows.flat(ab, n), -3.0, Rows.flat(yb, n))
    g.run()
    np.testing.assert_array_equal(yb.read(np.float32), np.float32(-3.0) * a)


def test_stride0_broadcast_view_equals_one_row(gpu, rng):
    """An explicit stride-0 b view is the same broadcast as a one-row b."""
    rows, cols = 5, int(rng.integers(1, 400))
    a = rng.standard_normal((rows, cols)).astype(np.float32)
    w = rng.standard_normal(cols).astype(np.float32)
    ab, wb, yb = gpu.upload(a), gpu.upload(w), gpu.buffer(a.nbytes)
    yb.fill(np.nan)
    g = gpu.graph("stride0")
    E.add(g, Rows(ab, rows, cols), Rows(wb, rows, cols, 0, 0), Rows(yb, rows, cols))
    g.run()
    np.testing.assert_array_equal(yb.read(np.float32).reshape(rows, cols), a + w)


def test_validation(gpu):
    """Wrong shapes, overflowing views and partial overlaps are refused with a ValueError."""
    b = gpu.buffer(4 * 100, "b")
    c = gpu.buffer(4 * 100, "c")
    g = gpu.graph("bad")
    with pytest.raises(ValueError, match="needs 404 B"):
        Rows(b, 1, 101)
    with pytest.raises(ValueError, match="stride 5 < row length 10"):
        Rows(b, 2, 10, 0, 5)
    with pytest.raises(ValueError, match="shapes differ"):
        E.silu(g, Rows(b, 2, 10), Rows(c, 2, 11))
    with pytest.raises(ValueError, match="needs 4 or 1"):
        E.add(g, Rows(b, 4, 10), Rows(c, 2, 10), Rows(c, 4, 10, 50))
    with pytest.raises(ValueError, match="row lengths differ"):
        E.mul(g, Rows(b, 4, 10), Rows.flat(c, 9), Rows(c, 4, 10, 50))
    with pytest.raises(ValueError, match="partly overlaps"):
        E.silu(g, Rows(b, 2, 10), Rows(b, 2, 10, 5))
    with pytest.raises(ValueError, match="takes two inputs"):
        E.eltwise(g, E.Op.ADD, Rows(b, 2, 10), None, Rows(c, 2, 10))
    with pytest.raises(ValueError, match="stride 0"):
        E.silu(g, Rows(b, 2, 10), Rows(c, 2, 10, 0, 0))
    assert not g.ops
    # disjoint interleaved views of one buffer are fine (e.g. q and gate halves of a QG row)
    E.sigmoid(g, Rows(b, 5, 10, 0, 20), Rows(b, 5, 10, 10, 20))
    assert len(g.ops) == 1
