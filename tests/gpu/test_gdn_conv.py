"""GDN causal conv + silu with state planes, in place and per token (G4), and the gates (G2, G3),
vs float64 NumPy (the model reference's causal_conv / softplus)."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops import gdn
from vkflash.gpu.ops.views import Rows
from vkflash.model.layers.common import sigmoid, softplus
from vkflash.model.layers.gdn import causal_conv

pytestmark = pytest.mark.gpu
U = 2.0**-24  # f32 unit roundoff


def _strided(rng: np.random.Generator, x: np.ndarray) -> tuple[np.ndarray, int, int]:
    """x (rows, n) placed at a random offset with a random row stride ≥ n, as a flat f32 buffer."""
    rows, n = x.shape
    off, stride = int(rng.integers(0, 9)), n + int(rng.integers(0, 7))
    buf = rng.standard_normal(off + rows * stride).astype(np.float32)
    for r in range(rows):
        buf[off + r * stride: off + r * stride + n] = x[r]
    return buf, off, stride


def _planes(gpu, rng, st0: np.ndarray, n: int) -> tuple[gdn.Planes, int, np.ndarray]:
    """n NaN-poisoned planes of st0's shape with st0 in a random live plane (the index word at a
    random offset of its buffer): the view, the live plane, the buffer's first contents."""
    rows, C = st0.shape
    live = int(rng.integers(0, n))
    init = np.full((n, rows, C), np.nan, np.float32)
    init[live] = st0
    word = int(rng.integers(0, 4))
    index = np.zeros(4, np.uint32)
    index[word] = live + n * int(rng.integers(0, 3))  # the kernels take it mod n
    planes = gdn.Planes(gpu.upload(init, "conv_planes"), rows, C, n, gpu.upload(index, "live"), word)
    return planes, live, init


@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65, 130])
@pytest.mark.parametrize("K", [4, 3])
def test_conv(gpu, rng, T, K):
    """c and the new state for T below, at and above K−1 and the 32-token block, from an incoming
    non-zero state (a continuing sequence) in the live one of several planes: updated in place,
    every other plane untouched."""
    C = int(rng.integers(1, 700)) if T > 1 else 10240  # ragged channel counts; the Flash-Next width at decode
    m = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.normal(0, 0.5, (C, K)).astype(np.float32)
    st0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    n = int(rng.integers(1, 5))
    planes, live, init = _planes(gpu, rng, st0, n)
    mbuf, moff, mstride = _strided(rng, m)
    mb, wb = gpu.upload(mbuf, "m"), gpu.upload(w, "w")
    cb = gpu.buffer(4 * T * C, "c")
    cb.fill(np.nan)
    g = gpu.graph("conv")
    gdn.conv(g, Rows(mb, T, C, moff, mstride), Rows(wb, C, K), planes, Rows(cb, T, C))
    g.run()
    m64, w64, s64 = m.astype(np.float64), w.astype(np.float64), st0.astype(np.float64)
    want, want_state = causal_conv(m64, s64, w64)
    # acc = Σ_k w·x in f32: ≤ K·u·Σ|w x|, times silu' ≤ 1.1; silu's exp ((3+2|acc|) ulp), add and
    # divide move c by ≤ (6 + 2|acc|)·u relative.
    X = np.concatenate([s64, m64])
    absacc = sum(np.abs(w64[:, k] * X[k:k + T]) for k in range(K))
    pre = sum(w64[:, k] * X[k:k + T] for k in range(K))
    bound = 1.1 * K * U * absacc + (6 + 2 * np.abs(pre)) * U * np.abs(want) + 1e-30
    got = cb.read(np.float32).reshape(T, C)
    assert np.all(np.abs(got - want) <= bound), f"max err {np.abs(got - want).max():.3g}"
    # states are raw copies: exact
    after = planes.buf.read(np.float32).reshape(n, K - 1, C)
    np.testing.assert_array_equal(after[live], want_state)
    np.testing.assert_array_equal(np.delete(after, live, 0), np.delete(init, live, 0))


@pytest.mark.parametrize("T", [1, 2, 3, 7])
def test_conv_ring(gpu, rng, T):
    """A verify step (ring) leaves the live plane and writes the state after its token t into plane
    live + 1 + t (mod n), wrapping around; the outputs are those of the in-place step."""
    C, K = int(rng.integers(1, 300)), 4
    m = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.normal(0, 0.5, (C, K)).astype(np.float32)
    st0 = rng.standard_normal((K - 1, C)).astype(np.float32)
    n = T + 1 + int(rng.integers(0, 3))
    planes, live, init = _planes(gpu, rng, st0, n)
    mb, wb = gpu.upload(m, "m"), gpu.upload(w, "w")
    cb, c1 = gpu.buffer(4 * T * C, "c"), gpu.buffer(4 * T * C, "c1")
    g = gpu.graph("conv_ring")
    gdn.conv(g, Rows(mb, T, C), Rows(wb, C, K), planes, Rows(cb, T, C), ring=True)
    gdn.conv(g, Rows(mb, T, C), Rows(wb, C, K), Rows(gpu.upload(st0, "state"), K - 1, C), Rows(c1, T, C))
    g.run()
    np.testing.assert_array_equal(cb.read(np.float32), c1.read(np.float32))
    after = planes.buf.read(np.float32).reshape(n, K - 1, C)
    m64, s64, w64 = m.astype(np.float64), st0.astype(np.float64), w.astype(np.float64)
    written = {(live + 1 + t) % n: causal_conv(m64[:t + 1], s64, w64)[1] for t in range(T)}
    for q in range(n):
        np.testing.assert_array_equal(after[q], written.get(q, init[q]), err_msg=f"plane {q}")


def test_conv_split_batches_equal_one(gpu, rng):
    """Conv over 5 + 1 + 2 + 37 tokens (state carried in place) equals one batch of 45."""
    C, K = int(rng.integers(50, 400)), 4
    m = rng.standard_normal((45, C)).astype(np.float32)
    w = rng.normal(0, 0.5, (C, K)).astype(np.float32)
    mb, wb, sb = gpu.upload(m, "m"), gpu.upload(w, "w"), gpu.buffer(4 * (K - 1) * C, "conv_state")
    cb = gpu.buffer(m.nbytes, "c")
    cb.fill(np.nan)
    g = gpu.graph("conv_split")
    t0 = 0
    for n in (5, 1, 2, 37):
        gdn.conv(g, Rows(mb, n, C, t0 * C), Rows(wb, C, K), Rows(sb, K - 1, C), Rows(cb, n, C, t0 * C))
        t0 += n
    g.run()
    g1 = gpu.graph("conv_one")
    s1, c1 = gpu.buffer(4 * (K - 1) * C, "conv_state1"), gpu.buffer(m.nbytes, "c1")
    gdn.conv(g1, Rows(mb, 45, C), Rows(wb, C, K), Rows(s1, K - 1, C), Rows(c1, 45, C))
    g1.run()
    np.testing.assert_array_equal(cb.read(np.float32), c1.read(np.float32))
    np.testing.assert_array_equal(sb.read(np.float32), s1.read(np.float32))


@pytest.mark.parametrize("T", [1, 3, 130])
def test_gates(gpu, rng, T):
    """β = σ(b); g = softplus(a + dt_bias)·ssm_a with ssm_a < 0 used as stored (no second −exp)."""
    n_v = int(rng.integers(1, 50))
    b = rng.normal(0, 3, (T, n_v)).astype(np.float32)
    a = rng.normal(0, 6, (T, n_v)).astype(np.float32)
    a.flat[:: 7] = 25.0  # the softplus(x) = x branch
    dt = (1 + rng.uniform(-0.5, 0.5, n_v)).astype(np.float32)
    sa = (-rng.uniform(0.05, 1, n_v)).astype(np.float32)
    bbuf, boff, bstride = _strided(rng, b)
    abuf, aoff, astride = _strided(rng, a)
    bb, ab = gpu.upload(bbuf, "b"), gpu.upload(abuf, "a")
    pb = gpu.upload(np.concatenate([dt, sa]), "dt_bias+ssm_a")
    out = gpu.buffer(4 * 2 * T * n_v, "beta|g")
    out.fill(np.nan)
    g = gpu.graph("gates")
    gdn.gates(g, Rows(bb, T, n_v, boff, bstride), Rows(ab, T, n_v, aoff, astride), Rows.flat(pb, n_v),
              Rows.flat(pb, n_v, n_v), Rows(out, T, n_v, 0, 2 * n_v), Rows(out, T, n_v, n_v, 2 * n_v))
    g.run()
    got = out.read(np.float32).reshape(T, 2, n_v)
    x32 = (a + dt).astype(np.float64)  # the f32 sum the kernel forms, then exact
    beta = sigmoid(b.astype(np.float64))
    gate = softplus(x32) * sa
    # σ: exp (3+2|b|) ulp, add and divide: ≤ (6+2|b|)·u relative.
    assert np.all(np.abs(got[:, 0] - beta) <= (6 + 2 * np.abs(b)) * U * beta + 1e-30)
    # softplus: log near 1 is only 2^-21 absolute (GLSL), plus exp's (3+2|x|) ulp and rounding of
    # 1+eˣ, all ≤ (8+2|x|)·u relative to sp; then ×ssm_a (0.5 ulp).
    sp = softplus(x32)
    bound = np.abs(sa) * (2.0**-21 + (9 + 2 * np.abs(x32)) * U * sp)
    assert np.all(np.abs(got[:, 1] - gate) <= bound), f"max g err {np.abs(got[:, 1] - gate).max():.3g}"


def test_validation(gpu):
    b = gpu.buffer(4 * 4096, "b")
    g = gpu.graph("bad")
    with pytest.raises(ValueError, match="state is"):
        gdn.conv(g, Rows(b, 3, 10), Rows(b, 10, 4), Rows(b, 2, 10, 100), Rows(b, 3, 10, 200))
    with pytest.raises(ValueError, match="ring step of 3 tokens"):
        gdn.conv(g, Rows(b, 3, 10), Rows(b, 10, 4), gdn.Planes(b, 3, 10, 3, b, 0, 100), Rows(b, 3, 10, 300), ring=True)
    with pytest.raises(ValueError, match="partly overlaps"):
        gdn.conv(g, Rows(b, 3, 10), Rows(b, 10, 4), Rows(b, 3, 10, 100), Rows(b, 3, 10, 5))
    with pytest.raises(ValueError, match="overlap"):
        gdn.gates(g, Rows(b, 2, 4), Rows(b, 2, 4, 8), Rows.flat(b, 4, 16), Rows.flat(b, 4, 20),
                  Rows(b, 2, 4, 30), Rows(b, 2, 4, 31))
    assert not g.ops
