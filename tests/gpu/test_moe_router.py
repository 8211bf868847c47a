"""MoE router (softmax over E, top-k with ties to the lower index, clamped renormalisation) vs float64 NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from vkflash.gpu.ops.moe import moe_router
from vkflash.gpu.ops.views import Rows
from vkflash.model.layers.moe import DENOM_CLAMP

pytestmark = pytest.mark.gpu

ULP = 2.0**-23
GAP = 0.03  # distinct logits differ by ≥ GAP: p ratios ≥ e^0.03, far beyond f32 rounding, so ranks are exact


def _logits(rng: np.random.Generator, T: int, E: int, k: int) -> np.ndarray:
    """Rows of well-separated logits with exact ties copied in, some at the top-k cut."""
    z = np.stack([rng.permutation(E) * GAP for _ in range(T)]) + rng.uniform(-5, 5, (T, 1))
    for t in range(T):
        order = np.argsort(-z[t])
        for rank in {int(rng.integers(0, k)), k - 1}:  # a tie inside the top-k and one at the cut
            if rng.random() < 0.7:
                z[t, int(rng.integers(0, E))] = z[t, order[rank]]
    return z.astype(np.float32)


def _reference(z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids, weights and |z_max − z| of the chosen experts, in float64 (ties by lower index)."""
    x = z.astype(np.float64) - z.max(axis=1, keepdims=True)
    p = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    pI = np.take_along_axis(p, ids, axis=1)
    w = pI / np.maximum(pI.sum(axis=1, keepdims=True), DENOM_CLAMP)
    return ids, w, -np.take_along_axis(x, ids, axis=1)


@pytest.mark.parametrize("E,k", [(16, 4), (512, 10), (512, 4), (16, 10)])
def test_router(gpu, rng, E, k):
    """Ragged T, z read from a strided view, ids/w written to poisoned offset views."""
    T = int(rng.integers(1, 14))
    z = _logits(rng, T, E, k)
    z_off, z_stride = int(rng.integers(0, 30)), E + int(rng.integers(0, 7))
    zb = gpu.buffer(4 * (z_off + T * z_stride), "z")
    zb.fill(np.nan)
    for t in range(T):
        zb.write(z[t], 4 * (z_off + t * z_stride))
    o_off, o_stride = int(rng.integers(0, 20)), k + int(rng.integers(0, 4))
    n_out = o_off + T * o_stride + 3
    ib, wb = gpu.buffer(4 * n_out, "ids"), gpu.buffer(4 * n_out, "w")
    ib.fill(-7, np.int32)
    wb.fill(np.nan)
    g = gpu.graph("router")
    moe_router(g, Rows(zb, T, E, z_off, z_stride), Rows(ib, T, k, o_off, o_stride), Rows(wb, T, k, o_off, o_stride), k)
    g.run()

    idx = o_off + np.arange(T)[:, None] * o_stride + np.arange(k)[None, :]
    ids_all, w_all = ib.read(np.int32), wb.read(np.float32)
    ids_want, w_want, depth = _reference(z, k)
    np.testing.assert_array_equal(ids_all[idx], ids_want)
    # e_i = exp(x_i) to (3 + 2|x_i|) ulp; the divisions by Σe (cancels in w), by the selected sum
    # and that sum's k roundings add (5 + k) ulp: bound each weight by the worst selected expert.
    rel = ULP * (16 + k + 4 * depth.max(axis=1, keepdims=True))
    err = np.abs(w_all[idx] - w_want)
    assert np.all(err <= rel * w_want), f"max rel err {np.max(err / w_want):.3g}"
    outside = np.ones(n_out, bool)
    outside[idx] = False
    assert (ids_all[outside] == -7).all() and np.isnan(w_all[outside]).all()


def test_all_equal_logits(gpu, rng):
    """A row of equal logits picks experts 0..k−1, each weighted 1/k."""
    T, E, k = int(rng.integers(1, 6)), 512, 10
    z = np.full((T, E), np.float32(rng.uniform(-20, 20)), np.float32)
    zb, ib, wb = gpu.upload(z), gpu.buffer(4 * T * k), gpu.buffer(4 * T * k)
    ib.fill(-1, np.int32)
    wb.fill(np.nan)
    g = gpu.graph("router_flat")
    moe_router(g, Rows(zb, T, E), Rows(ib, T, k), Rows(wb, T, k), k)
    g.run()
    np.testing.assert_array_equal(ib.read(np.int32).reshape(T, k), np.tile(np.arange(k), (T, 1)))
    np.testing.assert_allclose(wb.read(np.float32), 1.0 / k, rtol=4 * k * ULP)


@pytest.mark.parametrize("rank", [False, True])
def test_non_finite_rows(gpu, rng, rank):
    """Rows holding a NaN or +inf (or all −inf) get ids 0..k−1 (valid indices for the expert
    gathers) and NaN weights in both selections; the finite rows between them are routed as usual."""
    from dataclasses import replace

    E, k = int(rng.choice([16, 64, 512])), 10
    T = 6
    z = _logits(rng, T, E, k)
    bad = [1, 2, 4, 5]
    z[1, int(rng.integers(0, E))] = np.nan
    z[2, int(rng.integers(0, E))] = np.inf
    z[4, :] = -np.inf
    z[5, rng.integers(0, E, 3)] = np.nan
    g = gpu.with_options(replace(gpu.options, router_rank=rank)).graph("router_bad")
    zb, ib, wb = gpu.upload(z), gpu.buffer(4 * T * k), gpu.buffer(4 * T * k)
    ib.fill(-7, np.int32)
    wb.fill(0.5)
    moe_router(g, Rows(zb, T, E), Rows(ib, T, k), Rows(wb, T, k), k)
    g.run()
    ids, w = ib.read(np.int32).reshape(T, k), wb.read(np.float32).reshape(T, k)
    np.testing.assert_array_equal(ids[bad], np.tile(np.arange(k), (len(bad), 1)))
    assert np.isnan(w[bad]).all()
    good = [0, 3]
    np.testing.assert_array_equal(ids[good], _reference(z[good], k)[0])
    assert np.isfinite(w[good]).all()


def test_validation(gpu):
    """k outside 1..E, wrong output shapes and overlapping views are refused before dispatch."""
    z, o = gpu.buffer(4 * 200, "z"), gpu.buffer(4 * 200, "o")
    g = gpu.graph("bad")
    with pytest.raises(ValueError, match="between 1 and the expert count 16"):
        moe_router(g, Rows(z, 2, 16), Rows(o, 2, 17), Rows(o, 2, 17, 100), 17)
    with pytest.raises(ValueError, match="expected 2x4"):
        moe_router(g, Rows(z, 2, 16), Rows(o, 2, 5), Rows(o, 2, 4, 100), 4)
    with pytest.raises(ValueError, match="ids and w overlap"):
        moe_router(g, Rows(z, 2, 16), Rows(o, 2, 4), Rows(o, 2, 4, 2), 4)
    with pytest.raises(ValueError, match="overlaps the logits"):
        moe_router(g, Rows(z, 2, 16), Rows(z, 2, 4, 20), Rows(o, 2, 4), 4)
    assert not g.ops


@pytest.mark.parametrize("E,k", [(512, 10), (16, 4), (64, 64)])
def test_rank_and_rounds_agree(gpu, rng, E, k):
    """The one-pass rank selection (VKFLASH_ROUTER_RANK=1) and the k argmax rounds (default) give the same
    ids and the same weights bit for bit, ties included."""
    from dataclasses import replace

    T = int(rng.integers(1, 9))
    z = _logits(rng, T, E, k)
    z[0, : E // 2] = z[0, 0]  # a long run of equal logits
    out = {}
    for wide in (True, False):
        g = gpu.with_options(replace(gpu.options, router_rank=wide)).graph("router")
        zb, ib, wb = gpu.upload(z), gpu.buffer(4 * T * k), gpu.buffer(4 * T * k)
        moe_router(g, Rows(zb, T, E), Rows(ib, T, k), Rows(wb, T, k), k)
        assert g.ops[0].desc.endswith("rank" if wide else "rounds")
        g.run()
        out[wide] = (ib.read(np.int32).reshape(T, k), wb.read(np.float32).reshape(T, k))
    np.testing.assert_array_equal(out[True][0], out[False][0])
    np.testing.assert_array_equal(out[True][1], out[False][1])
    np.testing.assert_array_equal(out[True][0], _reference(z, k)[0])
