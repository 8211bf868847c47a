"""Row softmax vs float64 NumPy: router-sized and long ragged rows, huge logits, in place."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops import softmax as S
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu


def _ref(x: np.ndarray) -> np.ndarray:
    z = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _check(got: np.ndarray, x: np.ndarray) -> None:
    """|Δy_i| ≤ y_i·(rel + 2^-22·|x_i − max|) + 2^-24·rel.

    e^{x−m} in f32 is good to ~(3 + 2|x−m|) ulp; the sum of n terms adds ≤ (n/32 + 64) ulp
    relative (lane sums, then subgroup and partials); one divide and one multiply.
    """
    want = _ref(x)
    n = x.shape[-1]
    rel = 2.0**-24 * (n / 32 + 64 + 10)
    dx = np.abs(x.astype(np.float64) - x.max(-1, keepdims=True))
    tol = want * (rel + 2.0**-22 * (3 + dx)) + 2.0**-24 * rel
    err = np.abs(got - want)
    assert np.all(err <= tol), f"max err {err.max():.3g}, worst ratio {(err / tol).max():.3g}"


@pytest.mark.parametrize("n", [1, 7, 512, 3001])
def test_softmax_rows(gpu, rng, n):
    """Rows of router size (E = 512), ragged and long; logit offsets of ±1e4 must not overflow."""
    rows, stride, off = int(rng.integers(2, 6)), n + int(rng.integers(0, 4)), int(rng.integers(0, 6))
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.1, 8, (rows, 1)) + rng.uniform(-1e4, 1e4, (rows, 1)))
    x = x.astype(np.float32)
    buf = np.zeros(off + rows * stride, np.float32)
    for r in range(rows):
        buf[off + r * stride: off + r * stride + n] = x[r]
    xb, yb = gpu.upload(buf, "logits"), gpu.buffer(4 * rows * n, "probs")
    yb.fill(np.nan)
    g = gpu.graph("softmax")
    S.softmax(g, Rows(xb, rows, n, off, stride), Rows(yb, rows, n))
    g.run()
    got = yb.read(np.float32).reshape(rows, n)
    _check(got, x)


def test_softmax_in_place_many_rows(gpu, rng, monkeypatch):
    """Fewer workgroups than rows (each loops over several rows), output over the input."""
    monkeypatch.setattr(S, "MAX_GROUPS", 5)
    rows, n = int(rng.integers(20, 40)), int(rng.integers(2, 600))
    x = (rng.standard_normal((rows, n)) * 4).astype(np.float32)
    xb = gpu.upload(x, "x")
    g = gpu.graph("softmax_inplace")
    S.softmax(g, Rows(xb, rows, n), Rows(xb, rows, n))
    g.run()
    _check(xb.read(np.float32).reshape(rows, n), x)


def test_validation(gpu):
    b = gpu.buffer(400, "b")
    g = gpu.graph("bad")
    with pytest.raises(ValueError, match="shapes differ"):
        S.softmax(g, Rows(b, 2, 10), Rows(b, 2, 12, 40))
    with pytest.raises(ValueError, match="partly overlaps"):
        S.softmax(g, Rows(b, 2, 10), Rows(b, 2, 10, 3))
    assert not g.ops
