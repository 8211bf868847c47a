"""Two-pass argmax vs numpy.argmax: a full-vocabulary row (V ≥ 248,320), ragged small rows,
ties (the first index wins), −inf entries, NaN / +inf rows (NO_INDEX), several rows, and replay
with new logits."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops import argmax as A
from vkflash.gpu.ops.views import Rows

pytestmark = pytest.mark.gpu


def _run(gpu, x: np.ndarray, off: int = 0) -> np.ndarray:
    rows, n = x.shape
    xb = gpu.buffer(4 * (off + x.size), "logits")
    xb.write(x, 4 * off)
    sb = gpu.buffer(A.scratch_bytes(gpu.caps, n, rows), "scratch")
    ob = gpu.buffer(4 * (rows + 1), "token")
    sb.fill(0xFFFFFFFF, np.uint32)
    ob.fill(0xDEADBEEF, np.uint32)
    g = gpu.graph("argmax")
    A.argmax(g, Rows(xb, rows, n, off), ob, out_off=1, scratch=sb)
    g.run()
    out = ob.read(np.uint32)
    assert out[0] == 0xDEADBEEF  # nothing written before out_off
    return out[1:]


def test_vocab_row(gpu, rng):
    """One row of V logits with the maximum planted near a random place (incl. the ends)."""
    V = int(rng.integers(248_320, 260_000))
    x = rng.standard_normal((1, V)).astype(np.float32)
    for where in (int(rng.integers(0, V)), 0, V - 1):
        x[0, where] = x.max() + np.float32(rng.uniform(0.01, 1))
        np.testing.assert_array_equal(_run(gpu, x, off=int(rng.integers(0, 7))), np.argmax(x, axis=1))


@pytest.mark.parametrize("n", [1, 2, 7, 255, 257, 1000, 70_001])
def test_ties_first_index_wins(gpu, rng, n):
    """Small integer-valued logits: many exact ties across lanes, subgroups and workgroups."""
    rows = int(rng.integers(1, 5))
    x = rng.integers(-3, 4, (rows, n)).astype(np.float32)
    if n > 3:
        x[0, :] = 5.0  # the whole row ties
        x[-1, n - 2:] = 9.0  # the last two tie
    np.testing.assert_array_equal(_run(gpu, x), np.argmax(x, axis=1))


def test_negative_infinity(gpu, rng):
    """Masked (−inf) logits never win over finite ones; an all −inf row gives index 0 like numpy."""
    n = int(rng.integers(300, 5000))
    x = rng.standard_normal((3, n)).astype(np.float32) - 100
    x[0, : n // 2] = -np.inf
    x[1, :] = -np.inf
    x[2, rng.integers(0, n, n // 3)] = -np.inf
    np.testing.assert_array_equal(_run(gpu, x), np.argmax(x, axis=1))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_rows_give_no_index(gpu, rng, bad):
    """A row holding a NaN or +inf anywhere (first, last, a random place, a few; beside a planted
    maximum) gives NO_INDEX; the finite rows around it keep their argmax."""
    n = int(rng.integers(300, 70_000))
    x = rng.standard_normal((6, n)).astype(np.float32)
    x[:, rng.integers(0, n, 6)] = 50.0
    for r, where in enumerate((0, n - 1, int(rng.integers(0, n)), rng.integers(0, n, 3))):
        x[r + 1, where] = bad
    x[-1, : n // 2] = -np.inf
    want = np.argmax(x, axis=1)
    want[1:5] = A.NO_INDEX
    np.testing.assert_array_equal(_run(gpu, x), want)


def test_replay_sees_new_logits(gpu, rng):
    n = int(rng.integers(10_000, 30_000))
    xb, ob = gpu.buffer(4 * n, "logits"), gpu.buffer(4, "token")
    sb = gpu.buffer(A.scratch_bytes(gpu.caps, n), "scratch")
    g = gpu.graph("argmax_replay")
    A.argmax(g, Rows.flat(xb, n), ob, scratch=sb)
    for _ in range(4):
        x = rng.standard_normal(n).astype(np.float32)
        xb.write(x)
        g.run()
        assert ob.read(np.uint32)[0] == np.argmax(x)


def test_validation(gpu):
    xb, ob = gpu.buffer(4 * 1000, "x"), gpu.buffer(8, "out")
    g = gpu.graph("bad")
    small = gpu.buffer(4, "scratch")
    with pytest.raises(ValueError, match="needs"):
        A.argmax(g, Rows.flat(xb, 1000), ob, scratch=small)
    sb = gpu.buffer(A.scratch_bytes(gpu.caps, 500, 2), "scratch")
    with pytest.raises(ValueError, match="overflow"):
        A.argmax(g, Rows(xb, 2, 500), ob, out_off=1, scratch=sb)
    with pytest.raises(ValueError, match="different buffers"):
        A.argmax(g, Rows(xb, 2, 500), sb, scratch=sb)
    assert not g.ops
